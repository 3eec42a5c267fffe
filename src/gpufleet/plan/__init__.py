"""Memory planning: predicted bytes per device before launch (`gpufleet plan`, the `check` fit rule).

    memory.py        bytes per role from config.json (pure arithmetic)
    known_models.py  config.json of well-known hub models, for offline use
    placement.py     roles -> devices, a `Plan` that checks itself, fixes, largest-that-fits
    command.py       the `plan` verb

No torch import anywhere in this package.
"""
