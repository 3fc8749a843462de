"""lora/graph_slots.py: adapters in fixed slots compute the deltas of
batch.py's grouped path (the fixed-shape form CUDA graphs capture), and the
slots are assigned least recently used first, refusing what cannot be held."""

from __future__ import annotations

import pytest
import torch

from worker_service.lora.adapter import ColumnLora, LoraAdapter, RowLora
from worker_service.lora.batch import build_lora_batch
from worker_service.lora.graph_slots import LoraSlots, SlotLoraBatch
from worker_service.lora.targets import LoraTargets, ProjectionShape

D = 8  # hidden size; q, k, v of D each in qkv_proj

TARGETS = LoraTargets(
    num_layers=2,
    projections={
        name: ProjectionShape(name, "self_attn", "qkv_proj", True, D, D, 0, D, start)
        for name, start in (("q_proj", 0), ("k_proj", D), ("v_proj", 2 * D))
    }
    | {"o_proj": ProjectionShape("o_proj", "self_attn", "o_proj", False, D, D, 0, D)},
    fused_widths={"qkv_proj": 3 * D},
)


def adapter(name: str, rank: int, *, parts: int, seed: int) -> LoraAdapter:
    """``parts`` of q, k, v targeted (the first ones) and o_proj."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(TARGETS.num_layers):
        b = torch.zeros(parts * D, parts * rank)
        for p in range(parts):  # block structured, as the loader builds it
            b[p * D : (p + 1) * D, p * rank : (p + 1) * rank] = torch.randn(D, rank, generator=g)
        layers.append(
            {
                "qkv_proj": ColumnLora(torch.randn(parts * rank, D, generator=g), b, 0, parts * D),
                "o_proj": RowLora(
                    torch.randn(rank, D, generator=g), torch.randn(D, rank, generator=g)
                ),
            }
        )
    return LoraAdapter(name, rank, 1.0, ("q_proj", "o_proj"), layers)


def slots(n: int = 2, max_rank: int = 4) -> LoraSlots:
    return LoraSlots.create(
        TARGETS, slots=n, max_rank=max_rank, dtype=torch.float32, device=torch.device("cpu")
    )


def test_slot_deltas_equal_the_grouped_path() -> None:
    a, b = adapter("a", 4, parts=3, seed=1), adapter("b", 2, parts=1, seed=2)
    rows = [a, None, b, a, a, None, b]  # scattered groups and base rows
    stack = slots()
    where = stack.assign([r for r in rows if r is not None])
    assert where is not None
    row_slot = torch.tensor([-1 if r is None else where[id(r)] for r in rows])
    fixed = SlotLoraBatch(stack, row_slot)
    grouped = build_lora_batch([(r, i, 1) for i, r in enumerate(rows)], torch.device("cpu"))
    x = torch.randn(len(rows), D, generator=torch.Generator().manual_seed(3))
    for layer in range(TARGETS.num_layers):
        got, want = torch.zeros(len(rows), 3 * D), torch.zeros(len(rows), 3 * D)
        fixed.column(layer, "qkv_proj", x, got)
        grouped.column(layer, "qkv_proj", x, want)
        torch.testing.assert_close(got, want)
        got, want = torch.zeros(len(rows), D), torch.zeros(len(rows), D)
        fixed.row(layer, "o_proj", x, got)
        grouped.row(layer, "o_proj", x, want)
        torch.testing.assert_close(got, want)
        assert got[1].abs().max() == 0 and want[1].abs().max() == 0  # a base row


def test_slots_are_reused_least_recently_used_first() -> None:
    a, b, c = (adapter(n, 2, parts=1, seed=i) for i, n in enumerate("abc"))
    stack = slots()
    first = stack.assign([a, b])
    assert first is not None and sorted(first.values()) == [0, 1]
    assert stack.assign([b]) == {id(b): first[id(b)]}  # b used last
    assert stack.assign([c]) == {id(c): first[id(a)]}  # a's slot: least recently used
    expected = [c, b] if first[id(a)] == 0 else [b, c]
    assert [id(x) for x in stack.held] == [id(x) for x in expected]
    assert stack.assign([a, b, c]) is None  # three adapters, two slots
    assert stack.assign([adapter("big", 8, parts=1, seed=9)]) is None  # rank above 4


def test_a_reloaded_slot_forgets_its_last_adapter() -> None:
    """A slot loaded with a smaller adapter keeps none of the larger one's weights."""
    big, small = adapter("big", 4, parts=3, seed=5), adapter("small", 1, parts=1, seed=6)
    stack = slots(n=1)
    stack.assign([big])
    where = stack.assign([small])
    assert where == {id(small): 0}
    fixed = SlotLoraBatch(stack, torch.tensor([0]))
    grouped = build_lora_batch([(small, 0, 1)], torch.device("cpu"))
    x = torch.randn(1, D)
    got, want = torch.zeros(1, 3 * D), torch.zeros(1, 3 * D)
    fixed.column(0, "qkv_proj", x, got)
    grouped.column(0, "qkv_proj", x, want)
    torch.testing.assert_close(got, want)
    assert pytest.approx(0.0) == float(got[0, D:].abs().max())
