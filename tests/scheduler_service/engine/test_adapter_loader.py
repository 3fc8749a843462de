"""AdapterLoader (engine/adapter_loader.py) through its public methods, with
a real Scheduler and a stand-in group of two ranks: a load is registered
only once every rank has answered and never half-loaded, refusals carry the
status the API answers with, an adapter in use is not unloaded, and after a
worker loss every adapter is loaded again (the requests of one that no
longer loads are reported) before the requests finish with their adapter."""

from __future__ import annotations

import pytest

from scheduler_service import ipc
from scheduler_service.core import Request, SamplingParams
from scheduler_service.engine import recovery
from scheduler_service.engine.adapter_loader import AdapterLoader
from scheduler_service.engine.worker_group import WorkerError
from tests.scheduler_service.engine.support.sim_group import (
    UNREACHABLE,
    oracle,
    run_steps,
    scheduler_and_group,
)

V = 64


def _loader(**config):
    sched, group = scheduler_and_group(vocab_size=V, **config)
    return sched, group, AdapterLoader(sched, group, max_rank=16)


def _load(lora_id: str, token: int = 1, path: str | None = None, name: str = "") -> ipc.LoadAdapter:
    return ipc.LoadAdapter(token, lora_id, name, path or f"/adapters/{lora_id}", pinned=False)


def test_an_adapter_is_registered_once_every_rank_has_loaded_it():
    sched, group, loader = _loader()
    group.hold_loads = True
    assert loader.start_load(_load("sql", token=7, name="SQL")) is None
    assert loader.busy and "sql" not in sched.adapters.loaded
    group.release_loads(1)  # rank 0 answered, rank 1 not yet
    assert loader.poll() == [] and "sql" not in sched.adapters.loaded
    group.release_loads()
    (reply,) = loader.poll()
    assert (reply.token, reply.ok, reply.code) == (7, True, "OK")
    assert reply.adapters == [ipc.AdapterInfo("sql", "SQL", "/adapters/sql", False)]
    assert "sql" in sched.adapters.loaded and group.loaded_on_every_rank() == {"sql"}
    assert not loader.busy


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("no such directory: /adapters/sql", "NOT_FOUND"),
        ("adapter rank 64 is above --max-lora-rank 16", "INVALID_ARGUMENT"),
    ],
)
def test_one_rank_refusing_unloads_it_from_the_others_with_the_status_of_the_refusal(error, code):
    sched, group, loader = _loader()
    group.ranks[1].refuse["/adapters/sql"] = error
    assert loader.start_load(_load("sql")) is None
    (reply,) = loader.poll()
    assert (reply.ok, reply.message, reply.code) == (False, error, code)
    assert "sql" not in sched.adapters.loaded
    assert not any(r.adapters for r in group.ranks)  # rank 0's copy is gone too


def test_an_unreachable_rank_is_unavailable():
    _, group, loader = _loader()
    group.ranks[0].reachable = False
    loader.start_load(_load("sql"))
    (reply,) = loader.poll()
    assert not reply.ok and reply.code == "UNAVAILABLE" and UNREACHABLE in reply.message


def test_loads_refused_at_once_while_one_of_the_same_is_loading_or_past_the_limit():
    _, group, loader = _loader(max_loaded_loras=1, max_loras_per_batch=1)
    group.hold_loads = True
    assert loader.start_load(_load("a", token=1)) is None
    busy = loader.start_load(_load("a", token=2))
    assert (busy.ok, busy.code) == (False, "ALREADY_EXISTS")
    assert "being loaded" in busy.message
    full = loader.start_load(_load("b", token=3))  # "a" counts while it loads
    assert (full.ok, full.token) == (False, 3) and "--max-loaded-loras" in full.message
    group.release_loads()
    assert [r.ok for r in loader.poll()] == [True]


def test_unload_is_refused_while_a_request_uses_the_adapter():
    sched, group, loader = _loader()
    loader.start_load(_load("sql", name="SQL"))
    loader.poll()
    req = Request("q", [1, 2, 3], SamplingParams(max_new_tokens=4), adapter="sql")
    sched.add_request(req)
    refused = loader.unload(ipc.UnloadAdapter(5, "sql", ""))
    assert (refused.ok, refused.code) == (False, "FAILED_PRECONDITION")
    assert "used by 1 waiting or running requests" in refused.message
    assert group.loaded_on_every_rank() == {"sql"}
    sched.abort("q")
    missing = loader.unload(ipc.UnloadAdapter(6, "", "nope"))
    assert (missing.ok, missing.code) == (False, "NOT_FOUND")
    done = loader.unload(ipc.UnloadAdapter(7, "", "SQL"))  # by name
    assert done.ok and done.adapters == [] and "sql" not in sched.adapters.loaded
    assert not any(r.adapters for r in group.ranks)


def test_loads_in_progress_when_the_group_is_lost_are_refused_unavailable():
    _, group, loader = _loader()
    group.hold_loads = True
    loader.start_load(_load("a", token=1))
    loader.start_load(_load("b", token=2))
    replies = loader.fail_loading("stream broke")
    assert [(r.token, r.ok, r.code) for r in replies] == [
        (1, False, "UNAVAILABLE"),
        (2, False, "UNAVAILABLE"),
    ]
    assert replies[0].message == "the worker group was lost: stream broke"
    assert not loader.busy


def test_preload_loads_lora_paths_or_stops_the_start():
    sched, group, loader = _loader()
    loader.preload([("sql", "/adapters/sql")])
    assert "sql" in sched.adapters.loaded and group.loaded_on_every_rank() == {"sql"}
    group.ranks[0].refuse["/adapters/bad"] = "not a LoRA adapter"
    with pytest.raises(WorkerError, match="--lora-paths bad=/adapters/bad: not a LoRA adapter"):
        loader.preload([("bad", "/adapters/bad")])
    assert "bad" not in sched.adapters.loaded


def test_after_a_worker_loss_every_adapter_is_loaded_again_before_the_first_plan(monkeypatch):
    clock = type("Clock", (), {"now": 0.0, "monotonic": lambda self: self.now})()
    monkeypatch.setattr(recovery, "time", clock)
    sched, group, loader = _loader()
    loader.preload([("sql", "/adapters/sql"), ("chat", "/adapters/chat")])
    reloaded: list[str] = []

    def reload() -> None:
        reloaded.extend(loader.reload_all())

    rec = recovery.WorkerRecovery(sched, group, timeout_s=30, before_open=reload)
    reqs = [
        Request("s", [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=10), adapter="sql"),
        Request("c", [2, 7, 1, 8], SamplingParams(max_new_tokens=10), adapter="chat"),
        Request("b", [1, 6, 1, 8], SamplingParams(max_new_tokens=10)),
    ]
    for r in reqs:
        sched.add_request(r)
    got: dict[str, list[int]] = {}
    run_steps(sched, group.worker, got, steps=3)
    rec.lost("stream broke")
    group.restart()  # the workers came back without adapters...
    group.ranks[1].refuse["/adapters/chat"] = "no such directory: /adapters/chat"
    clock.now += rec.wait_s()
    assert rec.try_reconnect()
    assert reloaded == ["chat"]  # ...and one of them no longer loads
    assert group.loaded_on_every_rank() == {"sql"}
    sched.abort("c")  # what the engine does with that adapter's requests
    run_steps(sched, group.worker, got)
    for r in (reqs[0], reqs[2]):
        assert got[r.rid] == oracle(r, V), r.rid


def test_reload_with_an_unreachable_rank_fails_the_reconnect_attempt():
    _, group, loader = _loader()
    loader.preload([("sql", "/adapters/sql")])
    group.ranks[1].reachable = False
    with pytest.raises(WorkerError, match="loading adapter 'sql': worker unreachable"):
        loader.reload_all()
