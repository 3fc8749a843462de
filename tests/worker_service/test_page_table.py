"""The page table (worker_service/device/page_table.py) stays equal to the
requests' page lists: under random deltas on its own (rows taken and freed,
pages appended, tails trimmed, growth, a reset), with the device copy kept
apart and updated by ``sync`` as on CUDA; through the real ModelRunner after
every step of the real Scheduler's plans (joins with cached prefixes, chunked
extends, decodes taking a page every page_size steps, leaves, retractions in
a tiny pool, drafted steps trimming rejected pages (a drafter whose drafts
are partly right), aborts), page sizes 1 and 16, also with a sliding pool
(sliding-window layers: a second table, entries the window left behind
freed by the scheduler and reused, cached prefixes with null entries); and
the flat indices ``gather`` builds on the device are the lists' concatenation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.simulated_model import expected_output
from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.engine.worker_codec import WorkerCodec
from tests.scheduler_service.core.support.spec_support import OracleDrafter
from worker_service.device.page_table import PageTable
from worker_service.execution.convert import plan_from_proto, result_to_proto
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.simulated_compute import SimulatedCompute

V = 300


def gathered(table: PageTable, rows: list[int], counts: list[int]) -> list[int]:
    """``PageTable.gather`` of the first ``counts[i]`` pages of ``rows[i]``."""
    counts_np = np.array(counts, np.int32)
    bases = table.flat_bases(np.array(rows, np.int64), counts_np)
    total = int(counts_np.sum())
    out = torch.empty(total, dtype=torch.int32)
    return table.gather(
        torch.from_numpy(bases), torch.from_numpy(counts_np), total, out=out
    ).tolist()


@pytest.mark.parametrize("separate", [False, True])
def test_random_deltas_keep_the_table_equal_to_the_lists(separate: bool) -> None:
    rng = random.Random(7 + separate)
    table = PageTable("cpu", rows=2, columns=3, separate=separate)
    lists: dict[int, list[int]] = {}
    for _ in range(1500):
        op = rng.random()
        if op < 0.2 or not lists:
            row = table.acquire()
            assert row not in lists
            lists[row] = []
        elif op < 0.3:
            row = rng.choice(sorted(lists))
            table.release(row)
            del lists[row]
        elif op < 0.75:
            row = rng.choice(sorted(lists))
            new = [rng.randrange(10_000) for _ in range(rng.choice([1, 1, 1, 2, 7, 40]))]
            table.append(row, new)
            lists[row] += new
        elif op < 0.85:
            row = rng.choice(sorted(lists))
            keep = rng.randrange(len(lists[row]) + 2)
            table.truncate(row, keep)
            del lists[row][keep:]
        elif op < 0.995:
            table.sync()
            rows = [r for r in lists if lists[r] and rng.random() < 0.7]
            counts = [rng.randint(1, len(lists[r])) for r in rows]
            want = [p for r, c in zip(rows, counts, strict=True) for p in lists[r][:c]]
            assert gathered(table, rows, counts) == want
        else:
            table.clear()
            lists.clear()
        table.check_integrity(lists)
    assert table.host.shape[0] >= 8 and table.stride >= 40  # it grew both ways


def test_an_upload_is_needed_for_the_device_copy() -> None:
    """With a device copy of its own, the device sees appended pages only after sync."""
    table = PageTable("cpu", rows=2, columns=4, separate=True)
    row = table.acquire()
    table.append(row, [5, 6])
    assert table.table[row, :2].tolist() == [0, 0]
    table.sync()
    assert table.table[row, :2].tolist() == [5, 6]


def test_integrity_catches_a_missed_delta() -> None:
    table = PageTable("cpu", separate=True)
    row = table.acquire()
    table.append(row, [3, 4])
    table.check_integrity({row: [3, 4]})
    with pytest.raises(AssertionError, match="has 2 pages, its request 3"):
        table.check_integrity({row: [3, 4, 9]})
    with pytest.raises(AssertionError, match="neither held nor free"):
        table.check_integrity({})
    table.host[row, 1] = 8  # the mirror changed but no delta recorded: the device differs
    with pytest.raises(AssertionError, match="differs on the device"):
        table.check_integrity({row: [3, 8]})


def _served(page_size: int, seed: int, *, window: int = 0) -> dict[str, int]:
    """The real Scheduler's plans over the wire to a ModelRunner (simulated
    model); the runner's page tables are checked after every step. Returns how
    often each kind of page delta happened. ``window``: the model's layers
    slide, with a sliding pool of their own (two tables)."""
    rng = random.Random(seed)
    pages = 16 if page_size == 16 else 200  # tight: decodes retract
    swa_pages = (pages * 3 // 4) if window else 0
    sched = Scheduler(
        SchedulerConfig(
            vocab_size=V,
            page_size=page_size,
            chunked_prefill_size=64,
            speculative_ngram=True,
            speculative_max_draft=4,
            schedule_conservativeness=0.2,  # admits more than fits: decodes retract
        ),
        pages,
        drafter=OracleDrafter(V, "mixed", seed),  # drafts partly right: rejected pages trimmed
        num_swa_pages=swa_pages,
        swa_window=window,
    )
    runner = ModelRunner(
        SimulatedCompute(vocab_size=V),
        num_pages=pages,
        page_size=page_size,
        vocab_size=V,
        # the upload path, as on CUDA; tiny, so that it grows
        page_table=PageTable("cpu", rows=1, columns=1, separate=True),
        num_swa_pages=swa_pages,
        swa_window=window,
        swa_table=PageTable("cpu", rows=1, columns=1, separate=True) if window else None,
    )
    codec = WorkerCodec(sliding=bool(window))
    kinds = ["joins", "rejoins", "cached", "leaves", "decode_pages", "drafted", "trims"]
    kinds += ["null_entries", "reused_sliding"] if window else []
    seen = dict.fromkeys(kinds, 0)
    swa_owner: dict[int, int] = {}  # sliding page -> the slot it was last given to
    joined: set[str] = set()
    shared = [rng.randrange(2, V) for _ in range(40)]
    repeat = [rng.randrange(2, V) for _ in range(6)] * 8  # n-gram drafts find matches
    reqs: list[Request] = []
    for i in range(14):
        prompt = (shared if i % 2 else repeat)[: rng.randint(10, 40)] + [rng.randrange(2, V)]
        sp = SamplingParams(max_new_tokens=rng.randint(5, 150), ignore_eos=True)
        reqs.append(Request(f"r{i}", prompt, sp))
    pending = list(reqs)
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.003 and sched.live_rids():
            sched.abort(rng.choice(sorted(sched.live_rids())))
        plan = sched.step()
        if plan is None:
            if sched.is_idle() and not pending:
                break
            continue
        msg = codec.encode(plan)
        before = {s: len(st.pages) for s, st in runner.slots.items()}
        result = runner.execute(plan_from_proto(msg))
        assert not result.error, result.error
        runner.check_integrity()
        seen["joins"] += len(msg.joins)
        seen["rejoins"] += sum(1 for j in msg.joins if j.rid in joined)  # after a retraction
        joined.update(j.rid for j in msg.joins)
        seen["cached"] += sum(1 for j in msg.joins if j.prefix_ids)
        seen["leaves"] += len(msg.leaves)
        if window:
            given = [(e.slot, p) for e in msg.extends for p in e.new_swa_pages]
            decoded = zip(msg.decode_slots, msg.decode_new_swa_pages, strict=True)
            given += [(s, p - 1) for s, p in decoded if p]
            seen["null_entries"] += sum(1 for _, p in given if p == 0)
            for slot, page in given:
                seen["reused_sliding"] += swa_owner.get(page, slot) != slot
                swa_owner[page] = slot
        seen["decode_pages"] += sum(1 for p in msg.decode_new_pages if p)
        drafted = [e.slot for e in msg.extends if e.draft_len]
        seen["drafted"] += len(drafted)
        for slot in drafted:
            grown = before[slot] + len(next(e for e in msg.extends if e.slot == slot).new_pages)
            seen["trims"] += len(runner.slots[slot].pages) < grown
        wire = pb.StepResult.FromString(result_to_proto(result).SerializeToString())
        sched.update(codec.decode(wire, plan))
        sched.drain()
    assert sched.is_idle() and not pending
    for r in reqs:  # the simulated tokens: right whatever was cached, retracted or drafted
        if r.finish_reason is not None and r.finish_reason.kind == "length":
            assert r.output_ids == expected_output(r.prompt_ids, len(r.output_ids), V)
    return seen


@pytest.mark.parametrize(("page_size", "seed"), [(1, 1), (16, 2)])
def test_the_runners_table_equals_its_page_lists_after_every_step(page_size, seed) -> None:
    seen = _served(page_size, seed)
    # The workload made every kind of delta the runner applies.
    assert all(seen[k] > 0 for k in seen), seen


@pytest.mark.parametrize(("page_size", "seed"), [(1, 3), (16, 10)])
def test_the_sliding_table_equals_its_page_lists_after_every_step(page_size, seed) -> None:
    """Window 8: the scheduler frees sliding entries behind it (pages reused by
    other requests, null entries in cached prefixes); the runner validates and
    applies every plan, both tables checked after each step."""
    seen = _served(page_size, seed, window=8)
    assert all(seen[k] > 0 for k in seen), seen
