"""The host tier on the wire: a scheduler with a host tier sends its plans'
write-backs and loads as four packed columns (worker_codec.py), the worker
reads them back column for column (convert.py), and validation refuses a
plan whose columns do not fit the pools, naming the problem and applying
nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.engine.worker_codec import WorkerCodec
from tests.scheduler_service.core.support.sim_driver import make_pair
from worker_service.execution.convert import plan_from_proto
from worker_service.execution.plan import ForwardMode, PageCopies, Plan
from worker_service.execution.validation import PlanError, validate_plan

V = 40
DEVICE_PAGES, HOST_PAGES = 12, 24


def _answer(result, plan) -> pb.StepResult:
    sampled = [e for e in plan.extends if e.sample] + plan.decodes
    by_rid = {o.rid: o.token_id for o in result.outputs}
    return pb.StepResult(step_id=plan.step_id, token_ids=[by_rid[e.rid] for e in sampled])


def _wire_plans(policy: str) -> list[tuple[object, pb.StepPlan]]:
    """Turns of conversations sharing a prefix, on a device pool that holds
    about one of them: plans carry write-backs and loads."""
    cfg = SchedulerConfig(
        page_size=4,
        eos_token_ids=frozenset({0}),
        vocab_size=V,
        hicache_host_pages=HOST_PAGES,
        hicache_write_policy=policy,
        hicache_load_back_threshold=0,
        speculative_ngram=False,
    )
    sched, worker = make_pair(cfg, DEVICE_PAGES, V)
    codec = WorkerCodec()
    out = []
    prompts = [[1 + (i * 7 + j) % (V - 1) for j in range(20)] for i in range(3)]
    for turn in range(3):
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(max_new_tokens=2, ignore_eos=True)
            sched.add_request(Request(f"c{i}t{turn}", list(prompt), sp))
            while (plan := sched.step()) is not None:
                msg = codec.encode(plan)
                out.append((plan, msg))
                sched.update(codec.decode(_answer(worker.execute(plan), plan), plan))
                sched.check_integrity()
    return out


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_copies_cross_the_wire_column_for_column(policy):
    plans = _wire_plans(policy)
    loads = writes = 0
    for plan, msg in plans:
        got = plan_from_proto(pb.StepPlan.FromString(msg.SerializeToString())).copies
        wb, ld = plan.write_backs, plan.loads
        if wb is None and ld is None:
            assert got is None
            continue
        assert got is not None
        assert got.write_back_device.tolist() == (list(wb.src) if wb else [])
        assert got.write_back_host.tolist() == (list(wb.dst) if wb else [])
        assert got.load_host.tolist() == (list(ld.src) if ld else [])
        assert got.load_device.tolist() == (list(ld.dst) if ld else [])
        writes += got.num_write_backs
        loads += got.num_loads
        # Each plan's copies fit the pools the worker reports.
        validate_plan(
            Plan(step_id=plan.step_id, mode=ForwardMode.IDLE, copies=got),
            {},
            num_pages=DEVICE_PAGES,
            num_host_pages=HOST_PAGES,
            page_size=4,
            vocab_size=V,
            max_context=1 << 20,
        )
    assert writes > 0 and loads > 0


def _copies(wb_dev=(), wb_host=(), ld_host=(), ld_dev=()) -> PageCopies:
    def col(x):
        return np.array(x, dtype=np.int64)

    return PageCopies(col(wb_dev), col(wb_host), col(ld_host), col(ld_dev))


def _validate(copies: PageCopies, host_pages: int = 8) -> None:
    validate_plan(
        Plan(step_id=1, mode=ForwardMode.IDLE, copies=copies),
        {},
        num_pages=4,
        num_host_pages=host_pages,
        page_size=4,
        vocab_size=V,
        max_context=64,
    )


@pytest.mark.parametrize(
    ("copies", "host_pages", "error"),
    [
        (_copies([1], [2]), 0, "no host KV pool"),
        (_copies([1, 2], [3]), 8, "2 write_back_device_pages but 1 write_back_host_pages"),
        (_copies(ld_host=[1], ld_dev=[]), 8, "1 load_host_pages but 0 load_device_pages"),
        (_copies([4], [0]), 8, "write_back_device_pages: page ids outside the pool [0, 4): [4]"),
        (_copies([0], [8]), 8, "write_back_host_pages: page ids outside the pool [0, 8): [8]"),
        (_copies(ld_host=[9], ld_dev=[0]), 8, "load_host_pages: page ids outside the pool"),
        (_copies(ld_host=[1], ld_dev=[5]), 8, "load_device_pages: page ids outside the pool"),
        (_copies(ld_host=[1, 2], ld_dev=[3, 3]), 8, "device pages loaded twice: [3]"),
    ],
)
def test_bad_columns_are_refused_by_name(copies, host_pages, error):
    with pytest.raises(PlanError, match=re.escape(error)):
        _validate(copies, host_pages)


def test_a_host_page_written_back_twice_is_allowed():
    _validate(_copies([0, 1], [5, 5], [5], [2]))


def test_a_refused_plan_applies_nothing():
    """A plan whose copies are bad is answered with an error, and its joins,
    extends and copies are not applied (the runner validates first)."""
    from tests.worker_service.support.host_tier import tiny_runner

    runner, kv, host = tiny_runner(num_pages=4, host_pages=4)
    before = [layer.clone() for layer in kv.layers]
    host_before = [layer.clone() for layer in host.layers]
    msg = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    j = msg.joins.add(slot=0, rid="r", prompt_len=4)
    j.sampling.temperature = 0.0
    msg.extends.add(slot=0, start_pos=0, input_ids=[1, 2, 3, 4], new_pages=[0], sample=True)
    msg.load_host_pages.extend([1, 2])
    msg.load_device_pages.extend([1])  # one short
    result = runner.execute(plan_from_proto(msg))
    assert "1 load_device_pages" in result.error or "2 load_host_pages" in result.error
    assert not runner.slots
    assert all(torch_equal(a, b) for a, b in zip(before, kv.layers, strict=True))
    assert all(torch_equal(a, b) for a, b in zip(host_before, host.layers, strict=True))


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
