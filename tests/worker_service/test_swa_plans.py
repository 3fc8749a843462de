"""Two KV pools on the worker, without a model: the split of a memory budget
(KvCache.split_budget) and the cache's per-layer pools; the sliding page
table the ModelRunner keeps beside the full one (joins with null entries,
extends, decodes, a drafted step's trim, leaves, a reset), checked by
check_integrity after every plan; and execution validation refusing, by
name and with nothing applied, sliding pages out of the pool, the null page
inside a query's window, lists that are not parallel, and sliding pages sent
to a worker with one pool."""

from __future__ import annotations

import pytest
import torch

from common.simulated_model import simulated_token
from worker_service.device.kv_cache import KvCache
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.execution.simulated_compute import SimulatedCompute
from worker_service.sampling.params import LogprobOptions, SamplingParams

V, PS, W = 300, 4, 8
NUM_PAGES, NUM_SWA = 64, 12
GREEDY = SamplingParams(temperature=0.0)
SHAPE = dict(page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def layer_page_bytes() -> int:
    return KvCache.bytes_per_page(num_layers=1, **SHAPE)


def test_without_sliding_layers_the_budget_is_todays_pool() -> None:
    budget = 10**9 + 12345
    full, swa = KvCache.split_budget(
        budget, num_layers=32, num_swa_layers=0, swa_ratio=0.8, **SHAPE
    )
    assert swa == 0
    assert full == KvCache.pages_for_budget(budget, num_layers=32, **SHAPE)


@pytest.mark.parametrize(("layers", "sliding"), [(6, 5), (24, 12), (4, 4)])
@pytest.mark.parametrize("ratio", [0.8, 0.25, 1.0])
def test_both_pools_fit_the_budget_at_the_ratio(layers, sliding, ratio) -> None:
    """Gemma-3-shaped (5 of 6 sliding), GPT-OSS-shaped (every other), all sliding."""
    budget = 3 * 10**9
    full, swa = KvCache.split_budget(
        budget, num_layers=layers, num_swa_layers=sliding, swa_ratio=ratio, **SHAPE
    )
    page = layer_page_bytes()

    def cost(f: int, s: int) -> int:
        return f * (layers - sliding) * page + s * sliding * page

    assert swa == int(full * ratio)
    assert cost(full, swa) <= budget
    # One full page more and its share (ratio) of sliding pages would not fit.
    assert (full + 1) * ((layers - sliding) + ratio * sliding) * page > budget
    if layers == sliding:  # the full pool stores nothing: the sliding one takes it all
        assert budget - page * sliding <= cost(full, swa) <= budget


def test_sliding_layers_get_pages_of_their_own_pool() -> None:
    kv = KvCache(
        num_layers=6,
        num_pages=10,
        page_size=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
        swa_layers=frozenset({0, 1, 2, 3, 4}),
        num_swa_pages=3,
    )
    assert [t.shape[0] for t in kv.layers] == [3, 3, 3, 3, 3, 10]
    assert kv.has_full_layers and kv.num_swa_pages == 3
    with pytest.raises(ValueError, match="null page"):
        KvCache(num_layers=2, num_pages=4, **{**SHAPE, "page_size": 4}, device="cpu",
                swa_layers=frozenset({0}), num_swa_pages=1)  # fmt: skip


def runner(*, swa: bool = True) -> ModelRunner:
    return ModelRunner(
        SimulatedCompute(vocab_size=V),
        num_pages=NUM_PAGES,
        page_size=PS,
        vocab_size=V,
        num_swa_pages=NUM_SWA if swa else 0,
        swa_window=W if swa else 0,
    )


def join(slot: int, prompt: list[int], prefix: int = 0) -> Join:
    return Join(slot, f"r{slot}", GREEDY, LogprobOptions(), len(prompt), prompt[:prefix])


PROMPT = list(range(10, 24))  # 14 tokens: pages 0..3 at page size 4


def prefill(r: ModelRunner) -> Plan:
    """Slot 0's prompt (full pages 0-3, sliding 1-4), then slot 1 sharing its first
    12 tokens: sliding page 0 (positions 0-3) left every window (the first query
    at 12 sees 5..12) so it is the null page; the next two are slot 0's."""
    first = Plan(1, ForwardMode.PREFILL, joins=[join(0, PROMPT)])
    first.extends.append(Extend(0, 0, PROMPT, [0, 1, 2, 3], True, new_swa_pages=[1, 2, 3, 4]))
    assert not r.execute(first).error
    return sharer_plan(2, [0, 2, 3, 5])


def sharer_plan(step: int, swa_pages: list[int], pages: list[int] | None = None) -> Plan:
    prompt = PROMPT[:12] + [7, 8]
    plan = Plan(step, ForwardMode.PREFILL, joins=[join(1, prompt, prefix=12)])
    plan.extends.append(Extend(1, 12, [7, 8], pages or [0, 1, 2, 4], True, new_swa_pages=swa_pages))
    return plan


def test_the_sliding_table_follows_every_delta() -> None:
    r = runner()
    result = r.execute(prefill(r))
    assert not result.error, result.error
    r.check_integrity()
    assert r.slots[1].swa_pages == [0, 2, 3, 5] and r.slots[1].swa_live_from == 1
    # Decodes: slot 0 at 14 (its page 3 covers 12-15), slot 1 at 14 too; then 16
    # takes a new page in both pools.
    for step, (pos, new, new_swa) in enumerate([(14, 0, 0), (15, 0, 0), (16, 7, 8)]):
        plan = Plan(10 + step, ForwardMode.DECODE, decode_slots=[0, 1])
        plan.decode_positions = [pos, pos]
        plan.decode_new_pages = [new and new + 1, new and new + 2]
        plan.decode_new_swa_pages = [new_swa and new_swa + 1, new_swa and new_swa + 2]
        assert not r.execute(plan).error
        r.check_integrity()
    assert r.slots[0].swa_pages == [1, 2, 3, 4, 8] and r.slots[1].swa_pages == [0, 2, 3, 5, 9]
    # A drafted step: three drafts over two new pages, the rejected tail trimmed
    # from both tables alike.
    last = r.slots[0].tokens[-1]
    drafted = Extend(0, 17, [last, 1, 2, 3], [20, 21], True, draft_len=3)
    drafted.new_swa_pages = [6, 7]
    assert not r.execute(Plan(20, ForwardMode.MIXED, extends=[drafted])).error
    state = r.slots[0]
    assert len(state.pages) == len(state.swa_pages) == -(-state.kv_len // PS)
    r.check_integrity()
    assert not r.execute(Plan(21, ForwardMode.IDLE, leaves=[0])).error
    r.check_integrity()
    assert r.page_table.lengths[state.row] == r.swa_table.lengths[state.row] == 0
    r.reset()
    r.check_integrity()


def test_integrity_sees_a_sliding_table_that_missed_a_delta() -> None:
    r = runner()
    assert not r.execute(prefill(r)).error
    r.swa_table.host[r.slots[0].row, 1] = 11  # the table, not the request's list
    with pytest.raises(AssertionError, match="differs"):
        r.check_integrity()


def refused(r: ModelRunner, plan: Plan, needle: str) -> None:
    before = {s: (list(st.pages), list(st.swa_pages), st.kv_len) for s, st in r.slots.items()}
    result = r.execute(plan)
    assert needle in result.error, result.error
    assert {s: (st.pages, st.swa_pages, st.kv_len) for s, st in r.slots.items()} == before
    r.check_integrity()


def decode(step: int, pos: int, new: int, new_swa: int | None) -> Plan:
    plan = Plan(step, ForwardMode.DECODE, decode_slots=[0], decode_positions=[pos])
    plan.decode_new_pages = [new]
    plan.decode_new_swa_pages = [] if new_swa is None else [new_swa]
    return plan


def test_bad_sliding_pages_are_refused_and_change_nothing() -> None:
    r = runner()
    good_sharer = prefill(r)
    cases = [
        (sharer_plan(2, [0, 0, 3, 5]), "null page inside the window of its query at position 12"),
        (sharer_plan(2, [0, 2, 3, NUM_SWA]), f"outside the pool [0, {NUM_SWA})"),
        (sharer_plan(2, [0, 2, 3]), "3 sliding pages for 4 pages"),
        (sharer_plan(2, [0, 2, 3, -1]), "outside the pool"),
        (decode(3, 14, 0, None), "0 decode sliding pages for 1 decodes"),
        (decode(3, 14, 0, 5), "a sliding page without a page"),
        (decode(3, 14, 9, 0), "a page without one"),
        (decode(3, 14, 9, 1), "its new sliding page is the null page 0"),
        (decode(3, 14, 9, NUM_SWA + 1), "outside the pool"),
    ]
    for plan, needle in cases:
        refused(r, plan, needle)
    assert not r.execute(good_sharer).error
    # Slot 1's sliding page 0 is null: a query that sees position 3 (one at 10)
    # cannot run; slot 1 is at 14, so rewind it on a fresh runner instead:
    # its join asked for the null page where its own first query looks.
    fresh = runner()
    prefill(fresh)
    prompt = PROMPT[:8] + [7, 8]
    early = Plan(2, ForwardMode.PREFILL, joins=[join(1, prompt, prefix=8)])
    early.extends.append(Extend(1, 8, [7, 8], [0, 1, 4], True, new_swa_pages=[0, 2, 5]))
    refused(fresh, early, "sliding page 0 is the null page inside the window")
    # Decoding goes on exactly after the refusals: the simulated model's tokens.
    for step, pos in enumerate((14, 15)):
        result = r.execute(decode(5 + step, pos, 0, 0))
        assert not result.error, result.error
        assert result.token_ids[0] == simulated_token(r.slots[0].tokens[:-1], V)


def test_a_one_pool_worker_refuses_sliding_pages() -> None:
    r = runner(swa=False)
    plan = Plan(1, ForwardMode.PREFILL, joins=[join(0, PROMPT)])
    plan.extends.append(Extend(0, 0, PROMPT, [0, 1, 2, 3], True, new_swa_pages=[1, 2, 3, 4]))
    refused(r, plan, "the worker has one pool")
    plan.extends[0].new_swa_pages = []
    assert not r.execute(plan).error
    refused(r, decode(2, 14, 0, 0), "1 decode sliding pages for 1 decodes; the worker has one pool")
