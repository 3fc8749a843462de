"""README.md's model families table, from the registry (models/registry.py:
each family's architectures and FamilySupport); a test checks that the README
holds exactly this. ``python scripts/families_table.py`` prints it,
``--write`` puts it into README.md between its markers."""

from __future__ import annotations

import sys

from scripts.readme_block import README, write_block
from worker_service.models.family import ModelFamily
from worker_service.models.registry import FAMILIES

HEADER = [
    "| family | architectures | TP | LoRA | speculative | grammar | GGUF |",
    "|---|---|---|---|---|---|---|",
]


def _yes(flag: bool, note: str = "") -> str:
    if not flag:
        return "no"
    return f"yes ({note})" if note else "yes"


def row(family: ModelFamily) -> str:
    s = family.support
    archs = ", ".join(f"`{a}`" for a in family.architectures)
    cells = [
        family.name,
        archs,
        _yes(s.tensor_parallel),
        _yes(s.lora, s.lora_note),
        _yes(s.speculative),
        _yes(s.grammar),
        _yes(s.gguf),
    ]
    return "| " + " | ".join(cells) + " |"


def table() -> str:
    return "\n".join([*HEADER, *(row(f) for f in FAMILIES)]) + "\n"


START = "<!-- families table:"
END = "<!-- end of the families table -->"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_block(README, start=START, end=END, body=table())
    else:
        print(table(), end="")
