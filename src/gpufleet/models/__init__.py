"""Models, in one place: what a model path names and how it is read or loaded.

    info.py     config.json facts (heads, context, dtype) and a model folder's problems, read without torch
    known.py    config.json of well-known hub models, for offline checks and plans
    builtin.py  the tiny `builtin:` models, built locally from a transformers config (no download)
    load.py     loading the tokenizer and the model (torch and transformers imported inside the functions)

`from gpufleet.models import load_causal_lm, load_tokenizer, resolve_model_path` stays cheap: load.py
imports torch and transformers only when a function runs.
"""

from gpufleet.models.load import load_causal_lm, load_tokenizer, resolve_model_path

__all__ = ["load_causal_lm", "load_tokenizer", "resolve_model_path"]
