"""Adapter slots on the worker: a request keeps the adapter of the slot it
joined through, whatever later plans do with the slot or UnloadAdapter does
with the name; plans naming what is not there are refused whole."""

from __future__ import annotations

import pytest

from tests.support.lora_adapters import standard_adapters
from tests.worker_service.support.lora_workers import (
    default_worker,
    max_logprob_gap,
    prompts,
    reference,
)
from tests.worker_service.support.plan_driver import GREEDY
from worker_service.execution.plan import AdapterSlot, Extend, ForwardMode, Join, Plan
from worker_service.sampling.params import LogprobOptions

# Out of make test-fast: the default model with PEFT adapters.
pytestmark = pytest.mark.slow

STEPS = 8
PAGE = 16


class Requests:
    """Hand-built plans for a few requests on the default worker."""

    def __init__(self) -> None:
        self.runner = default_worker().runner
        self.runner.reset()
        self.step = 0
        self.next_page = 0
        self.kv: dict[int, int] = {}
        self.outputs: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}

    def plan(self) -> Plan:
        self.step += 1
        return Plan(self.step, ForwardMode.MIXED)

    def join(self, plan: Plan, slot: int, prompt: list[int], adapter_slot: int) -> None:
        n = -(-(len(prompt) + STEPS) // PAGE)  # every page it will need, up front
        pages = list(range(self.next_page, self.next_page + n))
        self.next_page += n
        spec = Join(slot, f"r{slot}", GREEDY, LogprobOptions(), len(prompt), [])
        spec.adapter_slot = adapter_slot
        plan.joins.append(spec)
        plan.extends.append(Extend(slot, 0, prompt, pages, True))
        self.kv[slot] = len(prompt)

    def decode(self, plan: Plan, slot: int) -> None:
        plan.decode_slots.append(slot)
        plan.decode_positions.append(self.kv[slot])
        plan.decode_new_pages.append(0)
        self.kv[slot] += 1

    def run(self, plan: Plan) -> str:
        result = self.runner.execute(plan)
        for slot, token, lp in zip(result.slots, result.token_ids, result.logprobs, strict=True):
            self.outputs.setdefault(slot, []).append(token)
            self.logprobs.setdefault(slot, []).append(lp)
        return result.error


def test_unload_and_reassign_while_slotted_requests_run():
    adapters = default_worker().runner.adapters
    loader = default_worker().adapter_loader
    paths = standard_adapters()
    adapters.put(loader.load("x", paths["attn-r4"], 0))
    p0, p1 = list(prompts()[0]), list(prompts()[1])
    reqs = Requests()
    plan = reqs.plan()
    plan.adapter_slots = [AdapterSlot(1, "x")]
    reqs.join(plan, 0, p0, adapter_slot=1)
    assert not reqs.run(plan)
    # Unloaded while request 0 runs: it keeps the adapter it joined with.
    assert adapters.remove("x")
    assert not adapters.remove("x")
    plan = reqs.plan()
    plan.adapter_slots = [AdapterSlot(1, "mlp-r8")]  # the slot now holds another
    reqs.join(plan, 1, p1, adapter_slot=1)
    reqs.decode(plan, 0)
    assert not reqs.run(plan)
    # Refused whole: an unloaded name, a join on an empty slot, slot 0, a slot
    # assigned twice; decoding then goes on as if they never came.
    bad = reqs.plan()
    bad.adapter_slots = [AdapterSlot(2, "x")]
    bad.decode_slots, bad.decode_positions, bad.decode_new_pages = [0], [reqs.kv[0]], [0]
    assert "'x' is not loaded" in reqs.run(bad)
    bad = reqs.plan()
    bad.joins.append(Join(2, "r2", GREEDY, LogprobOptions(), 3, [], adapter_slot=3))
    assert "adapter slot 3, which holds no adapter" in reqs.run(bad)
    bad = reqs.plan()
    bad.adapter_slots = [AdapterSlot(1, ""), AdapterSlot(1, "all-r16")]
    assert "assigned twice" in reqs.run(bad)
    bad = reqs.plan()
    bad.adapter_slots = [AdapterSlot(0, "all-r16")]
    assert "numbered from 1" in reqs.run(bad)
    # Emptying the slot does not touch the requests that joined through it.
    plan = reqs.plan()
    plan.adapter_slots = [AdapterSlot(1, "")]
    reqs.decode(plan, 0)
    reqs.decode(plan, 1)
    assert not reqs.run(plan)
    assert 1 not in adapters.slots
    bad = reqs.plan()
    bad.joins.append(Join(2, "r2", GREEDY, LogprobOptions(), 3, [], adapter_slot=1))
    assert "holds no adapter" in reqs.run(bad)
    while len(reqs.outputs[1]) < STEPS:
        plan = reqs.plan()
        if len(reqs.outputs[0]) < STEPS:
            reqs.decode(plan, 0)
        reqs.decode(plan, 1)
        assert not reqs.run(plan)
    for slot, adapter, prompt in ((0, "attn-r4", p0), (1, "mlp-r8", p1)):
        tokens, logprobs = reference(adapter, tuple(prompt), STEPS)
        assert reqs.outputs[slot] == tokens, adapter
        assert max_logprob_gap(reqs.logprobs[slot], logprobs) < 1e-4


def test_a_new_stream_starts_with_empty_slots_and_adapters_still_loaded():
    runner = default_worker().runner
    plan = Plan(1, ForwardMode.IDLE, adapter_slots=[AdapterSlot(3, "all-r16")])
    assert not runner.execute(plan).error
    assert 3 in runner.adapters.slots
    runner.reset()
    assert not runner.adapters.slots
    assert "all-r16" in runner.adapters.names()
