"""Markdown reference of every job field, generated from the schema docstrings.

python -m gpufleet.config.reference > /tmp/ref.md   # the README's "Job file reference" section
"""

from __future__ import annotations

from gpufleet.config.problems import format_value
from gpufleet.config.schema import SECTIONS, field_doc


def markdown() -> str:
    out = []
    for section, cls in SECTIONS.items():
        out.append(f"### `{section}`\n")
        out.append("| field | default | meaning |")
        out.append("|---|---|---|")
        for name, info in cls.model_fields.items():
            default = format_value(info.get_default(call_default_factory=True))
            out.append(f"| `{section}.{name}` | `{default}` | {field_doc(f'{section}.{name}')} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown())
