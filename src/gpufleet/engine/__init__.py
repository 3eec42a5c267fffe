"""How tokens and log-probs are computed fast: the engine under the RL algorithm (``gpufleet.rl``).

One call crosses the seam: ``rollout.generate`` takes prompts, one seed per completion and the sampling
settings, and returns the tokens (a ``Rollout``); ``logprobs.sequence_logprobs`` gives the log-probs of
what was sampled. Behind them: the fast decoders (``fastdecode`` and its C step ``fastdecode_native``,
``nativeloop``, the CUDA-graph step ``graphdecode``), the CPU kernels (``cpu_kernels`` and its ``.c``
files), the fused training layers (``fusedlayers``, ``packedattention``), packing (``packing``), the
chunked log-prob head (``loghead``), sampling (``sampling``), and the switches that turn each off
(``switches``). Nothing here knows about advantages, losses or rewards.
"""
