"""README's model families table is the registry's (scripts/families_table.py
writes it from each family's architectures and FamilySupport), for any
family, whatever it supports."""

from __future__ import annotations

import runpy
from pathlib import Path

from worker_service.models.family import FamilySupport, ModelFamily

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "families_table.py"))


def test_the_readme_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("\n", readme.index(SCRIPT["START"])) + 1
    end = readme.index(SCRIPT["END"])
    assert readme[start:end] == SCRIPT["table"](), (
        "run python scripts/families_table.py --write (README.md's families table)"
    )


def test_a_row_says_what_a_family_supports():
    family = ModelFamily(
        name="moe",
        architectures=("AForCausalLM", "BForCausalLM"),
        model_class=object,
        read_config=lambda arch, cfg: None,  # type: ignore[arg-type,return-value]
        support=FamilySupport(
            tensor_parallel=False,
            lora=True,
            lora_note="attention only",
            speculative=False,
            grammar=True,
            gguf=True,
        ),
    )
    assert SCRIPT["row"](family) == (
        "| moe | `AForCausalLM`, `BForCausalLM` | no | yes (attention only) | no | yes | yes |"
    )
