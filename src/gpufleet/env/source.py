"""`env.name` -> a factory of text environments, and the checks `gpufleet check` runs on it.

    builtin:keys               gpufleet's own (env/builtin.py)
    gymnasium:FrozenLake-v1    a Gymnasium environment through the text adapter (env/gym.py)
    my_envs:Sokoban            the user's class (module:Class or path/to/file.py:Class), looked up
                               like reward functions (the job's folder, the working directory, PYTHONPATH);
                               a TRL environment class (reset, no step: env/trl.py) runs through TrlEnv

`env.kwargs` go to the class (to `gymnasium.make` for gymnasium:). Every failure is a `UserError` on
`env.name` / `env.kwargs` with the fix.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from gpufleet.env.base import EnvError, checked_reset
from gpufleet.errors import UserError

BUILTIN = "builtin:"
GYMNASIUM = "gymnasium:"
FIELD = "env.name"


def factory(name: str, kwargs: dict[str, Any], folders: Sequence[str] | None = None) -> Callable[[], Any]:
    """A function making one fresh environment of `name`; import errors are raised now."""
    if name.startswith(BUILTIN):
        from gpufleet.env.builtin import BUILTIN_ENVS

        key = name[len(BUILTIN) :]
        if key not in BUILTIN_ENVS:
            close = difflib.get_close_matches(key, list(BUILTIN_ENVS), n=1)
            raise UserError(
                f"env.name {name!r}: there is no built-in environment {key!r}.",
                field=FIELD,
                fix=f"did you mean builtin:{close[0]}?"
                if close
                else "built-in: " + ", ".join(BUILTIN + k for k in BUILTIN_ENVS),
            )
        cls = BUILTIN_ENVS[key]
        _check_kwargs(name, cls, kwargs)
        return lambda: cls(**kwargs)
    if name.startswith(GYMNASIUM):
        env_id = name[len(GYMNASIUM) :]
        _check_gymnasium_id(name, env_id)
        from gpufleet.env.gym import GymTextEnv

        return lambda: GymTextEnv(env_id, **kwargs)
    from gpufleet import usercode
    from gpufleet.env.trl import TrlEnv, classes, is_trl_env, is_trl_envs

    cls = usercode.import_object(
        name, folders, field=FIELD, what="environment", example="my_envs:Sokoban", form="Class", dicts=True
    )
    if isinstance(cls, dict) and not is_trl_envs(cls):
        raise UserError(
            f"env.name {name} is a dict, but not of TRL environment classes by name.",
            field=FIELD,
            fix="name a class, or a dict {name: Class} whose classes have a reset method and no step "
            "(TRL's dict form of environment_factory)",
        )
    for one in classes(cls).values():
        _check_kwargs(name, one, kwargs)
    if is_trl_env(cls) or isinstance(cls, dict):  # TRL's environment_factory contract: env/trl.py
        return lambda: TrlEnv(cls, kwargs)
    return lambda: cls(**kwargs)


def is_users(name: str) -> bool:
    """Whether `name` is the user's class (module:Class, file.py:Class), not builtin: or gymnasium:."""
    return not name.startswith((BUILTIN, GYMNASIUM))


def check(name: str, kwargs: dict[str, Any], folders: Sequence[str] | None = None) -> None:
    """Resolve `name`; builtin: and gymnasium: environments are also made and reset once (cheap and
    ours); a user's class is imported and its constructor checked against env.kwargs (`gpufleet check`
    then makes and resets it in a child process: probe.py)."""
    if is_users(name):
        factory(name, kwargs, folders)
        return
    make = factory(name, kwargs, folders)
    try:
        env = make()
        checked_reset(env, 0, name)
    except EnvError as e:
        raise UserError(str(e), field="env.kwargs", fix="check env.kwargs against the environment") from None
    except Exception as e:
        raise UserError(
            f"env.name {name!r} with env.kwargs {kwargs}: {type(e).__name__}: {e}",
            field="env.kwargs",
            fix="check env.kwargs against the environment's options",
        ) from None


def _check_gymnasium_id(name: str, env_id: str) -> None:
    import gymnasium

    if env_id in gymnasium.registry:
        return
    close = difflib.get_close_matches(env_id, list(gymnasium.registry), n=1)
    raise UserError(
        f"env.name {name!r}: Gymnasium has no environment {env_id!r}.",
        field=FIELD,
        fix=f"did you mean gymnasium:{close[0]}?" if close else "e.g. gymnasium:FrozenLake-v1",
    )


def _check_kwargs(name: str, cls: Callable, kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise UserError(
            f"env.kwargs {kwargs} do not fit {name}{sig}: {e}.",
            field="env.kwargs",
            fix=f"give env.kwargs that {name}'s constructor takes",
        ) from None
