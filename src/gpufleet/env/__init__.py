"""Environments for multi-turn agent RL (the `env:` section of a job).

    base.py     the text environment API (Gymnasium's, with text observations and actions), checked calls
    builtin.py  built-in environments (`builtin:keys`)
    gym.py      Gymnasium toy-text environments as text environments (`gymnasium:FrozenLake-v1`)
    source.py   `env.name` -> a factory of environments: builtin:, gymnasium:<id>, module:Class
    wire.py     the protocol both sides share: addresses, requests, /health, JSON-safe info, servers.json
    table.py    the table of live environments (a server's episodes) and LocalPool (environments in process)
    runner.py   environment calls on a thread of their own: heartbeats, env.reset_timeout / env.step_timeout
    probe.py    `gpufleet check` makes the user's environment and resets it in a child process
    server.py   an environment server process (HTTP, batch endpoints, per-run token)
    servers.py  start / watch / restart / stop the servers of a run
    client.py   the trainer's side: episodes spread over the servers, retried from their seed on failure
    connect.py  which pool a trainer rank uses: in process, the run's servers (by device), env.address

Torch-free (`gpufleet check` and the servers import it). The multi-turn rollout that drives these is
gpufleet/rl/episodes.py.
"""
