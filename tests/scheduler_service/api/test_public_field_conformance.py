"""Every field of every request message of the public API (read from the
proto's descriptors) has a row in tests/support/public_field_table.py saying
how its effect is checked or the refusal it gets, so a new proto field fails
here until it is handled. The rows themselves run against real servers in
tests/e2e/test_public_field_effects.py; this file checks the table."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.public_field_table import FIELDS, PENDING_OWNERS, WHOLE
from tests.support.public_fields import Elsewhere, Pending, Refused, field_paths, leaf_paths

ROOT = Path(__file__).resolve().parents[3]


def test_every_public_request_field_has_a_row_and_every_row_a_field():
    walked = field_paths(WHOLE)
    missing = [p for p in walked if p not in FIELDS]
    assert not missing, f"public request fields with no row in public_field_table.py: {missing}"
    stale = sorted(set(FIELDS) - set(walked))
    assert not stale, f"rows for fields the proto no longer has: {stale}"


def test_the_walk_reaches_nested_and_new_fields():
    walked = field_paths(WHOLE)
    assert "GenerateRequest.sampling_params.top_k" in walked
    assert "GenerateRequest.tokenized.original_text" in walked
    assert "GenerateRequest.mm_inputs" in walked  # covered whole
    assert "GenerateRequest.mm_inputs.pixel_values.dtype" in leaf_paths("GenerateRequest.mm_inputs")
    assert "EmbedRequest.is_cross_encoder" in leaf_paths("EmbedRequest")
    # without the whole rows, their fields would each need one
    assert "GenerateRequest.mm_inputs.image_urls" in field_paths(())


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_elsewhere_rows_name_tests_that_exist():
    for field, row in FIELDS.items():
        if isinstance(row, Elsewhere):
            file, _, name = row.test.partition("::")
            assert name.startswith("test_"), f"{field}: {row.test} names no test"
            assert name in _functions(ROOT / file), f"{field}: {row.test} does not exist"


def test_pending_fields_and_owned_refusals_belong_to_a_branch_in_flight():
    for field, row in FIELDS.items():
        owner = row.owner if isinstance(row, Refused | Pending) else ""
        if isinstance(row, Pending) or owner:
            assert owner in PENDING_OWNERS, f"{field}: {owner!r} is no branch in flight"
