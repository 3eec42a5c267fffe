"""Memory planning: predicted bytes per device before launch (`gpufleet plan`, the `check` fit rule).

    shape.py         config.json -> Arch -> parameter counts; the models a job sizes (load_models)
    memory.py        bytes of the training state and of one training micro-batch (pure arithmetic)
    inference.py     bytes of the rollout (KV cache, sampler) and of scoring (pure arithmetic)
    overhead.py      the per-process framework overhead setting (GPUFLEET_PLAN_OVERHEAD)
    change.py        `Change`: one job field set to a value; applied with `apply`, shown with `flag`
    loads.py         ProcessLoad / DeviceLoad / `Plan` (checks itself, renders itself as JSON)
    build.py         the bytes of every process of a laid-out job
    search.py        make_plan: the planner's choices (auto placements) and why
    fixes.py         verified fixes for a job that does not fit; layouts for one that cannot be laid out
    largest.py       the largest per_device_batch / num_generations / completion length that fit
    fit_rule.py      the `gpufleet check` fit rule

Imports run one way: shape/memory/inference -> loads -> build -> search -> fixes/largest -> fit_rule (the `plan` verb is gpufleet.verbs.plan).
No torch import anywhere in this package.
"""
