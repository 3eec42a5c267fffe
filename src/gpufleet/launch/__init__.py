"""The launcher engine shared by `gpufleet train` and `gpufleet launch`: torchrun's command and agent
(torchrun.py), a gpufleet rank (worker.py), a rank of someone else's script (rankexec.py), the recipe
arithmetic (recipe.py) and what went wrong (diagnose.py for gpufleet's ranks, scriptfail.py for scripts)."""
