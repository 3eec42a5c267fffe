"""The building blocks of the job file's sections: the `Section` base (unknown keys are errors,
docstrings become descriptions) and the field types that parse text from flags and environment
variables (lists as `0,1,2`, command lines, mappings as YAML flow style)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


def _split_list(value: Any) -> Any:
    """Accept `0,1,2`, `[0, 1]` and a single scalar where a list is expected (env vars, flags)."""
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "colocate"):
            return text
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [part.strip() for part in text.split(",") if part.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


IdList = Annotated[list[Annotated[int, Field(ge=0)]], BeforeValidator(_split_list)]
StrList = Annotated[list[str], BeforeValidator(_split_list)]
FloatList = Annotated[list[float], BeforeValidator(_split_list)]
DevicesOrAuto = Annotated[Literal["auto"] | list[Annotated[int, Field(ge=0)]], BeforeValidator(_split_list)]
RolePlacement = Annotated[
    Literal["auto", "colocate"] | list[Annotated[int, Field(ge=0)]], BeforeValidator(_split_list)
]
RolloutPlacement = Annotated[
    Literal["colocate"] | list[Annotated[int, Field(ge=0)]], BeforeValidator(_split_list)
]


def _split_command(value: Any) -> Any:
    """A command line as one string (split like a shell) or as a list of arguments."""
    if isinstance(value, str):
        import shlex

        return shlex.split(value)
    return value


Command = Annotated[list[str], BeforeValidator(_split_command)]


def _parse_mapping(value: Any) -> Any:
    """A mapping given as text (a flag or env value): YAML flow style, `{doors: 3, letters: abcd}`."""
    if isinstance(value, str):
        import yaml

        try:
            return yaml.safe_load(value) if value.strip() else {}
        except yaml.YAMLError:
            return value
    return value


Mapping = Annotated[dict[str, Any], BeforeValidator(_parse_mapping)]


def _size(value: str) -> str:
    """A memory size as `--gpus` reads it (`20GB`, `512MiB`; GB means GiB)."""
    from gpufleet.hardware import parse_size

    if parse_size(value) is None:
        raise ValueError("a size such as 20GB or 512MB")
    return value


Size = Annotated[str, AfterValidator(_size)]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, docstrings become descriptions."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_default=True, allow_inf_nan=False
    )
