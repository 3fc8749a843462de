"""The core's outputs carry the status and message of an abort the service
decided (ipc.Finish.code / message), so the API process can end the call
with them, as SGLang's servicer ends a stream its scheduler aborted: here the
requests of an adapter that no longer loads after a worker loss."""

from __future__ import annotations

import pickle

from scheduler_service import ipc
from scheduler_service.core import Request, SamplingParams
from scheduler_service.engine import recovery
from scheduler_service.engine.adapter_loader import AdapterLoader
from scheduler_service.engine.loop import Engine
from tests.scheduler_service.engine.support.sim_group import run_steps, scheduler_and_group

V = 64


class _Pipe:
    """The core's end of the pipe: what it sends, as the pipe carries it."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(pickle.loads(pickle.dumps(msg)))

    def finishes(self) -> dict[str, ipc.Finish]:
        return {
            d.rid: d.finish
            for m in self.sent
            if isinstance(m, ipc.Outputs)
            for d in m.items()
            if d.finish is not None
        }


def test_requests_of_an_adapter_lost_with_the_workers_finish_with_unavailable_and_why(
    monkeypatch,
):
    clock = type("Clock", (), {"now": 0.0, "monotonic": lambda self: self.now})()
    monkeypatch.setattr(recovery, "time", clock)
    sched, group = scheduler_and_group(vocab_size=V)
    loader = AdapterLoader(sched, group, max_rank=16)
    loader.preload([("chat", "/adapters/chat")])
    pipe = _Pipe()
    engine = Engine(sched, group, pipe, overlap_depth=0, recovery_timeout_s=30, adapters=loader)
    chat = Request("c", [2, 7, 1, 8], SamplingParams(max_new_tokens=10), adapter="chat")
    base = Request("b", [1, 6, 1, 8], SamplingParams(max_new_tokens=10))
    for r in (chat, base):
        sched.add_request(r)
    run_steps(sched, group.worker, {}, steps=3)
    engine.recovery.lost("stream broke")
    group.restart()
    group.ranks[1].refuse["/adapters/chat"] = "no such directory: /adapters/chat"
    clock.now += engine.recovery.wait_s()
    assert engine.recovery.try_reconnect()
    sched.check_integrity()
    engine._publish()
    assert pipe.finishes() == {
        "c": ipc.Finish(
            "abort",
            message="LoRA adapter 'chat' could not be loaded again after a worker loss",
            code="UNAVAILABLE",
        )
    }
    assert sched.find("b") is not None  # the base model's request runs on
