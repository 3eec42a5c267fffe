"""The CLI's verbs, one module each: check, config, plan, train, export, launch. `gpufleet.cli` parses the
command line and calls one function here; the engine they drive lives in config/, rules/, plan/, launch/
(torchrun, ranks, failure diagnosis) and rl/."""
