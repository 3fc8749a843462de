"""A core process SIGKILLed under `radixserve serve`: the streams in flight
end UNAVAILABLE with a message that names the core (not the workers), a new
call meanwhile waits for the successor and is served (it used to end
UNAVAILABLE at once, which behind a gateway opened its circuit breaker:
test_core_restart_gateway.py), readiness is NOT_SERVING until a new core
serves (liveness SERVING throughout), and the same requests then give the
same tokens, LoRA adapters included (one preloaded with --lora-paths, one
loaded through the API). The worker process is the same throughout."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc

from tests.e2e.support.simulated_lora import adapter_dir, ask, load, tokens_of
from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import free_port, serve_process, stub, wait_until
from tests.e2e.support.units import NOT_SERVING, SERVING, health_status
from tests.support.process_tree import Proc, descendants

DIED = "the scheduler's core process died (killed by signal 9, SIGKILL); restarting it"


def _one(tree: list[Proc], marker: str) -> Proc:
    (p,) = [p for p in tree if marker in p.cmdline]
    return p


class HealthWatch:
    """Polls readiness and liveness every 20 ms on a thread: what was seen, in order."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ready: list[int] = []
        self.live: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            ready = health_status(self.address)
            if not self.ready or self.ready[-1] != ready:
                self.ready.append(ready)
            self.live.add(health_status(self.address, "liveness"))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _generate(s, rid: str, lora_id: str = "") -> list[int]:
    return tokens_of(s.Generate(ask(rid, [5, 6, 7, 8], 12, lora_id), timeout=60))


def test_a_killed_core_is_restarted_and_serves_the_same_again(tmp_path):
    health_port = free_port()
    args = ["--model", "simulated", "--log-level", "info", "--health-port", str(health_port)]
    args += ["--lora-paths", f"pre={adapter_dir(tmp_path, 'pre')}"]
    env = {"RADIXSERVE_WORKER_SIMULATED_STEP_MS": "20"}  # streams that last
    with serve_process(tmp_path, *args, env=env) as (proc, address):
        s = stub(address)
        assert load(s, "x", adapter_dir(tmp_path, "x")).success
        before = {rid: _generate(s, f"b-{rid}", rid) for rid in ("", "pre", "x")}
        tree = descendants(proc.pid)
        core, worker = _one(tree, "multiprocessing.spawn"), _one(tree, "-m worker_service")
        watch = HealthWatch(f"127.0.0.1:{health_port}")
        seen: dict = {}

        async def kill_the_core(progress: list[int]) -> None:
            await wait_for_progress(progress, 4, tokens=3)
            os.kill(core.pid, signal.SIGKILL)
            seen["killed_at"] = time.monotonic()
            await asyncio.to_thread(wait_until, lambda: NOT_SERVING in watch.ready, 5, "down")
            t0 = time.monotonic()
            try:
                tokens = await asyncio.to_thread(_generate, s, "meanwhile")
                seen["meanwhile"] = (tokens, time.monotonic() - t0)
            except grpc.RpcError as e:
                seen["meanwhile"] = (e.code(), e.details(), time.monotonic() - t0)

        streams = [ask(f"long-{i}", [i + 1, 2, 3], 2000) for i in range(4)]
        results = asyncio.run(run_streams(address, streams, kill_the_core))

        served_at = None
        deadline = seen["killed_at"] + 30
        while served_at is None and time.monotonic() < deadline:
            try:
                again = {rid: _generate(s, f"a-{rid}", rid) for rid in ("", "pre", "x")}
                served_at = time.monotonic()
            except grpc.RpcError:
                time.sleep(0.1)
        wait_until(lambda: watch.ready[-1] == SERVING, 5, "ready again")
        watch.stop()
        after = descendants(proc.pid)
        log = (tmp_path / "serve.log").read_text()

    for tokens, err in results:
        assert isinstance(err, grpc.aio.AioRpcError), err
        assert err.code() == grpc.StatusCode.UNAVAILABLE and err.details() == DIED
        assert 0 < len(tokens) < 2000
    tokens, waited = seen["meanwhile"]
    assert tokens == before[""], seen["meanwhile"]  # held, then served by the successor
    assert waited > 0.5  # the restart's backoff alone is 1 s
    print(f"the call sent meanwhile waited {waited:.2f} s")
    assert served_at is not None, log[-3000:]
    print(f"served again {served_at - seen['killed_at']:.2f} s after the kill")
    assert served_at - seen["killed_at"] < 10.0
    assert again == before  # the base model and both adapters
    assert watch.ready[:3] == [SERVING, NOT_SERVING, SERVING], watch.ready
    assert watch.live == {SERVING}
    new_core = _one(after, "multiprocessing.spawn")
    assert new_core.pid != core.pid
    assert _one(after, "-m worker_service") == worker  # the same worker process
    assert "core process restarted" in log
    assert "LoRA adapter loaded again after a core restart" in log
