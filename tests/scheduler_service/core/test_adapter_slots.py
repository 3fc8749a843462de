"""LoRA adapter slots in the scheduler core: the table's rules, and random
workloads over several adapters (and the base model) through Scheduler +
SimulatedWorker with check_integrity() after every step and update.

The oracle (scheduler_service/testing/simulated_worker.py) makes each
adapter a different simulated model, refuses a join naming an empty slot or
a slot reassigned while a request still uses it, and checks that KV read by
a request was written under the same adapter (cache namespaces).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.core import Request, SamplingParams, SchedulerConfig
from scheduler_service.core.adapters import Adapter, AdapterError, AdapterSlots
from scheduler_service.core.sampling import InvalidRequestError
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

VOCAB = 40
EOS = 0
EXAMPLES = int(os.environ.get("RADIXSERVE_PROPERTY_EXAMPLES", "120"))


def adapter(lora_id: str, pinned: bool = False) -> Adapter:
    return Adapter(lora_id, lora_id, f"/adapters/{lora_id}", pinned)


def test_slots_reuse_least_recently_used_unpinned_and_respect_users():
    t = AdapterSlots(max_loaded=5, max_per_batch=2)
    for name in "abc":
        t.register(adapter(name))
    a, b = t.acquire("a"), t.acquire("b")
    assert {a, b} == {1, 2} and t.take_changes() == [(a, "a"), (b, "b")]
    assert t.acquire("c") == 0 and not t.can_acquire("c")  # both slots in use
    assert t.acquire("a") == a  # the same slot, one more user
    t.release(b)
    assert t.acquire("c") == b and t.take_changes() == [(b, "c")]  # b's slot, now free
    t.release(a)
    t.release(a)
    t.release(b)
    t.acquire("b")  # the least recently used free slot is a's
    assert t.take_changes() == [(a, "b")]
    t.check_integrity([("r", "b", a)])


def test_pinned_adapter_keeps_its_slot_and_one_slot_stays_free():
    t = AdapterSlots(max_loaded=4, max_per_batch=2)
    t.register(adapter("p", pinned=True))
    with pytest.raises(AdapterError, match="at most 1 adapters can be pinned"):
        t.register(adapter("q", pinned=True))
    t.register(adapter("x"))
    t.register(adapter("y"))
    p = t.acquire("p")
    t.release(p)
    x = t.acquire("x")
    t.release(x)
    assert t.acquire("y") == x  # p's slot is never taken though unused
    assert t.slot_of("p") == p


def test_register_limits_and_unregister():
    t = AdapterSlots(max_loaded=2, max_per_batch=2)
    t.register(adapter("a"))
    with pytest.raises(AdapterError, match="already loaded"):
        t.register(adapter("a"))
    with pytest.raises(AdapterError, match="named 'a'"):
        t.register(Adapter("other-id", "a", "/x"))
    t.register(adapter("b"))
    with pytest.raises(AdapterError, match="--max-loaded-loras"):
        t.register(adapter("c"))
    k = t.acquire("a")
    with pytest.raises(AdapterError, match="in use"):
        t.unregister("a")
    t.release(k)
    t.unregister("a")
    assert t.slot_of("a") == 0 and "a" not in t.loaded
    with pytest.raises(AdapterError, match="no adapter"):
        t.acquire("a")
    with pytest.raises(AdapterError, match="released but not held"):
        t.release(k)


def test_integrity_catches_a_leaked_slot():
    t = AdapterSlots(max_loaded=2, max_per_batch=2)
    t.register(adapter("a"))
    k = t.acquire("a")
    with pytest.raises(AssertionError, match="users"):
        t.check_integrity([])  # nobody holds what the table counts
    with pytest.raises(AssertionError, match="holds slot"):
        t.check_integrity([("r", "b", k)])


def test_unknown_adapter_is_refused_at_submission():
    config = SchedulerConfig(page_size=1, vocab_size=VOCAB)
    sched, _ = make_pair(config, 64, VOCAB)
    with pytest.raises(InvalidRequestError, match="names no loaded LoRA adapter"):
        sched.add_request(Request("r", [1, 2, 3], adapter="nope"))
    assert not len(sched.table)


@st.composite
def lora_scenarios(draw):
    page_size = draw(st.sampled_from([1, 16]))
    per_batch = draw(st.integers(1, 3))
    names = [f"a{i}" for i in range(draw(st.integers(1, 5)))]
    pinned = set(draw(st.lists(st.sampled_from(names), max_size=per_batch - 1, unique=True)))
    prefixes = [
        draw(st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=2 * page_size + 5))
        for _ in range(3)
    ]
    arrivals, aborts, aborted = [], {}, set()
    for i in range(draw(st.integers(1, 24))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20))
        max_new = draw(st.integers(0, 24))
        rid = f"r{i}"
        req = Request(
            rid,
            prefix + suffix,
            SamplingParams(max_new_tokens=max_new, ignore_eos=draw(st.booleans())),
            adapter=draw(st.sampled_from([None, *names])),
            extra_key=draw(st.sampled_from([None, None, "salt"])),
        )
        arrival = draw(st.integers(0, 20))
        arrivals.append((arrival, req))
        if draw(st.integers(0, 9)) == 0:
            at = arrival + draw(st.integers(0, 20))
            aborts.setdefault(at, []).append(rid)
            aborted.add(rid)
    need = max(
        -(-(len(r.prompt_ids) + r.sampling.max_new_tokens + 1) // page_size) for _, r in arrivals
    )
    config = SchedulerConfig(
        page_size=page_size,
        max_running_requests=draw(st.integers(1, 8)),
        max_prefill_tokens=draw(st.sampled_from([16, 64, 256])),
        chunked_prefill_size=draw(st.sampled_from([None, 16, 32])),
        enable_mixed_chunk=draw(st.booleans()),
        eos_token_ids=frozenset({EOS}),
        vocab_size=VOCAB,
        init_new_token_ratio=draw(st.sampled_from([0.7, 0.01])),
        max_loras_per_batch=per_batch,
        max_loaded_loras=len(names),
    )
    num_pages = need + draw(st.integers(0, 2 * need))
    return config, num_pages, names, pinned, arrivals, aborts, aborted


@settings(max_examples=EXAMPLES)
@given(lora_scenarios(), st.sampled_from([0, 1, 2]))
def test_random_adapter_workloads(scenario, overlap):
    config, num_pages, names, pinned, arrivals, aborts, aborted = scenario
    sched, worker = make_pair(config, num_pages, VOCAB)
    for name in names:
        sched.adapters.register(adapter(name, pinned=name in pinned))
    log = drive(sched, worker, arrivals, aborts, overlap=overlap)
    check_outputs([r for _, r in arrivals], config, VOCAB, log, allow_abort=aborted)
    check_drained(sched, worker)
    assert worker.adapters_seen_in_a_step <= config.max_loras_per_batch
    assert sched.stats.oom_aborts == 0


def test_adapters_change_outputs_and_never_share_cache():
    """The same prompt under two adapters and the base model: three different
    outputs, each the oracle's, and no KV read across namespaces."""
    config = SchedulerConfig(page_size=1, vocab_size=VOCAB, max_loras_per_batch=1)
    sched, worker = make_pair(config, 256, VOCAB)
    sched.adapters.register(adapter("x"))
    sched.adapters.register(adapter("y"))
    prompt = list(range(1, 30))
    reqs = [
        Request(f"r{i}-{a}", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), adapter=a)
        for i in range(2)
        for a in (None, "x", "y")
    ]
    log = drive(sched, worker, [(0, r) for r in reqs])
    check_outputs(reqs, config, VOCAB, log)
    outs = {r.adapter: tuple(r.output_ids) for r in reqs}
    assert len(set(outs.values())) == 3
    check_drained(sched, worker)
    assert worker.adapters_seen_in_a_step == 1  # one slot: x and y never ran together
