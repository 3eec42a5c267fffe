"""gpufleet: take a group-relative RL training job from one GPU to many.

Importing this package is cheap: no torch, no transformers. Heavy modules import them lazily.
"""

__version__ = "0.1.0"
