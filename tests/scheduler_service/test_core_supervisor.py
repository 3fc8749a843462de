"""CoreSupervisor's restart policy with stand-in core processes (the test
speaks for them: Ready, Failed, a death): what calls in flight and new calls
meet when the core dies or stops on an internal error, the successor that
serves again, the adapters it gets back, a successor that finds another
model. The real thing (a SIGKILLed core under `radixserve serve`):
tests/e2e/test_core_restart.py."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest

from common.restart_backoff import RestartBackoff
from scheduler_service import ipc
from scheduler_service.api.core_client import CoreBroken, CoreClient, CoreRestarting, QueueFull
from scheduler_service.api.core_supervisor import CoreSupervisor
from scheduler_service.api.readiness import Readiness
from scheduler_service.api.servicer import _core_failure
from scheduler_service.config import ServiceConfig
from scheduler_service.core.intake import Submission
from scheduler_service.core.kv.events import AllBlocksCleared
from scheduler_service.core.sampling import SamplingParams

KILLED = "killed by signal 9, SIGKILL"


class FakeCore:
    """A core process stand-in: records what it is sent."""

    pids = itertools.count(1000)

    def __init__(self, on_message, on_exit) -> None:
        self.on_message, self.on_exit = on_message, on_exit
        self.sent: list[object] = []
        self.pid = next(self.pids)
        self.started_at = 0.0
        self.stopped = False

    def start(self, loop) -> None:
        self.started_at = time.monotonic()

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    async def gone(self, grace_s: float) -> None:
        self.stopped = True

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped = True

    def say(self, msg: object) -> None:
        self.on_message(self, msg)

    def die(self, how: str = KILLED) -> None:
        self.on_exit(self, how)


def _ready(model: str = "m", adapters: list[ipc.AdapterInfo] | None = None) -> ipc.Ready:
    return ipc.Ready(
        model_name=model,
        architecture="LlamaForCausalLM",
        vocab_size=100,
        eos_token_ids=[2],
        max_context_len=512,
        page_size=4,
        num_pages=64,
        tp_size=1,
        tokenizer_zip=b"",
        worker_info={},
        adapters=adapters or [],
    )


def _load() -> ipc.Load:
    return ipc.Load(3, 1, 40, 256, 0.5, 100, 50, 0.0, 0.0, 0.0, 8)


def _req(rid: str) -> Submission:
    return Submission(rid, [1, 2, 3], SamplingParams(max_new_tokens=2))


async def _until(pred, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


class Harness:
    def __init__(self) -> None:
        self.cores: list[FakeCore] = []
        self.client = CoreClient(ServiceConfig())
        self.supervisor = CoreSupervisor(
            self.client,
            ServiceConfig(),
            make_core=self._make,
            backoff=RestartBackoff(first_s=0.001, max_s=0.004),
        )

    def _make(self, on_message, on_exit) -> FakeCore:
        self.cores.append(FakeCore(on_message, on_exit))
        return self.cores[-1]

    async def start(self, ready: ipc.Ready | None = None) -> None:
        task = asyncio.create_task(self.supervisor.start(5))
        await _until(lambda: self.cores, "the first core")
        self.cores[0].say(ready or _ready())
        await task

    async def successor(self, n: int) -> FakeCore:
        await _until(lambda: len(self.cores) > n, f"core #{n}")
        return self.cores[n]

    async def serves(self, core: FakeCore) -> None:
        """``core`` says it is ready; the client takes work again."""
        core.say(_ready())
        await _until(lambda: self.client.failed is None, "the successor up")


def test_a_killed_core_ends_its_calls_naming_the_core_and_a_successor_serves():
    async def run() -> None:
        h = Harness()
        await h.start()
        client = h.client
        call = client.submit([_req("a")])
        h.cores[0].die()
        error = call.queue.get_nowait()
        message = f"the scheduler's core process died ({KILLED}); restarting it"
        assert isinstance(error, CoreRestarting) and str(error) == message
        assert _core_failure(error) == ("UNAVAILABLE", message)  # not "no worker can serve"
        with pytest.raises(CoreRestarting, match="core process died"):
            client.submit([_req("b")])
        successor = await h.successor(1)
        assert client.failed == message  # down until the successor is ready
        await h.serves(successor)
        assert client.restarts == 1
        client.submit([_req("c")])
        assert [type(m) for m in successor.sent] == [ipc.Submit]
        h.cores[0].die()  # the dead one's late news changes nothing
        assert client.failed is None and len(h.cores) == 2

    asyncio.run(run())


def test_an_internal_failure_ends_its_calls_internal_and_the_core_is_restarted():
    async def run() -> None:
        h = Harness()
        await h.start()
        call = h.client.submit([_req("a")])
        h.cores[0].say(ipc.Failed("scheduler integrity check failed after a step: x", "INTERNAL"))
        error = call.queue.get_nowait()
        assert isinstance(error, CoreBroken) and error.code == "INTERNAL"
        code, message = _core_failure(error)
        assert code == "INTERNAL" and "integrity check failed" in message
        # new calls: retry later, the core is coming back
        with pytest.raises(CoreRestarting, match="stopped on an internal error; restarting it"):
            h.client.submit([_req("b")])
        h.cores[0].die("exited")  # its exit after the Failed is the same death
        await h.serves(await h.successor(1))
        assert h.client.restarts == 1 and len(h.cores) == 2

    asyncio.run(run())


def test_a_successor_that_fails_is_followed_by_another_and_the_message_says_so():
    async def run() -> None:
        h = Harness()
        await h.start()
        h.cores[0].die()
        for n in (1, 2):
            (await h.successor(n)).say(ipc.Failed("worker w:1 did not answer"))
        third = await h.successor(3)
        assert "(failed attempts: 2, the last: worker w:1 did not answer)" in h.client.failed
        assert h.cores[1].stopped and h.cores[2].stopped
        await h.serves(third)
        assert h.client.restarts == 1

    asyncio.run(run())


def test_a_successor_that_dies_right_after_its_ready_does_not_count_as_up():
    async def run() -> None:
        h = Harness()
        await h.start()
        h.cores[0].die()
        successor = await h.successor(1)
        successor.say(_ready())
        successor.die()  # before the restart goes on past the Ready
        third = await h.successor(2)
        assert "the new core process stopped before it served" in h.client.failed
        await h.serves(third)
        h.client.submit([_req("a")])
        assert [type(m) for m in third.sent] == [ipc.Submit]

    asyncio.run(run())


def test_adapters_loaded_through_the_api_come_back_before_work_is_taken():
    async def run() -> None:
        pre = ipc.AdapterInfo("pre", "pre", "/a/pre", False)
        api = ipc.AdapterInfo("x", "name-x", "/a/x", True)
        h = Harness()
        await h.start(_ready(adapters=[pre]))
        h.cores[0].say(ipc.AdapterReply(7, True, "", [pre, api]))  # loaded through the API
        h.cores[0].die()
        successor = await h.successor(1)
        successor.say(_ready(adapters=[pre]))  # --lora-paths: preloaded by itself
        await _until(lambda: successor.sent, "the adapter's load")
        (load,) = successor.sent
        assert isinstance(load, ipc.LoadAdapter)
        assert (load.lora_id, load.name, load.path, load.pinned) == ("x", "name-x", "/a/x", True)
        assert h.client.failed is not None  # not before the adapter is back
        successor.say(ipc.AdapterReply(load.token, True, "", [pre, api]))
        await _until(lambda: h.client.failed is None, "the successor up")
        assert h.client.adapters == [pre, api]

    asyncio.run(run())


def test_a_successor_serving_another_model_is_refused_and_liveness_fails():
    async def run() -> None:
        h = Harness()
        await h.start()
        readiness = Readiness(_Health(), h.client, ("",))
        h.cores[0].die()
        (await h.successor(1)).say(_ready(model="other"))
        await h.successor(2)
        assert h.cores[1].stopped and isinstance(h.cores[1].sent[-1], ipc.Shutdown)
        assert "another model (model_name changed: other, was m)" in h.client.failed
        assert h.client.stuck and readiness.not_ready_reason() == h.client.failed
        await h.serves(h.cores[2])  # the workers serve the model again
        assert h.client.stuck is None
        assert readiness.not_ready_reason() is None

    asyncio.run(run())


def test_kv_event_subscribers_hear_the_cache_is_gone_and_no_stale_load_is_kept():
    async def run() -> None:
        h = Harness()
        await h.start()
        heard: list[tuple[list, ipc.Load]] = []
        h.client.on_events(lambda events, load: heard.append((events, load)))
        h.cores[0].say(ipc.Outputs([], _load()))
        assert h.client.load is not None
        h.cores[0].die()
        (events, load), *_ = [(e, ld) for e, ld in heard if e]
        assert events == [AllBlocksCleared()]
        assert (load.running, load.waiting, load.used_tokens) == (0, 0, 0)
        assert h.client.load is None

    asyncio.run(run())


def test_no_restart_once_stopping():
    async def run() -> None:
        h = Harness()
        await h.start()
        h.supervisor.stop()
        assert h.cores[0].stopped
        h.cores[0].die("exited")
        await asyncio.sleep(0.05)
        assert len(h.cores) == 1 and h.client.failed is None

    asyncio.run(run())


def test_a_core_that_fails_at_start_is_a_startup_error_not_restarted():
    async def run() -> None:
        h = Harness()
        task = asyncio.create_task(h.supervisor.start(5))
        await _until(lambda: h.cores, "the core")
        h.cores[0].say(ipc.Failed("worker w:1 refused this scheduler's token"))
        with pytest.raises(Exception, match="refused this scheduler's token"):
            await task
        await asyncio.sleep(0.05)
        assert len(h.cores) == 1

    asyncio.run(run())


class _Health:
    """Readiness needs a health servicer only to report to."""

    async def set(self, name: str, status: int) -> None:
        pass


def test_a_new_call_waits_for_the_restarting_core_and_is_served():
    """Not refused at once (a gateway's retries of that refusal opened its
    circuit breaker for a minute): held until the successor takes work."""

    async def run() -> None:
        h = Harness()
        await h.start()
        h.cores[0].die()
        waiting = asyncio.create_task(h.client.wait_restart(2))
        await asyncio.sleep(0.01)
        assert not waiting.done() and h.client.held == 2
        await h.serves(await h.successor(1))
        await asyncio.wait_for(waiting, 1)
        assert h.client.held == 0
        h.client.submit([_req("b")])
        assert [type(m) for m in h.cores[1].sent] == [ipc.Submit]

    asyncio.run(run())


def test_the_wait_for_a_restart_is_bounded_by_time_the_queue_limit_and_a_drain():
    async def run() -> None:
        h = Harness()
        config = ServiceConfig()
        h.client.config = dataclasses.replace(
            config,
            engine=dataclasses.replace(config.engine, worker_recovery_timeout_s=0.05),
            limits=dataclasses.replace(config.limits, max_queued_requests=2),
        )
        await h.start()
        h.supervisor.backoff = RestartBackoff(first_s=60, max_s=60)  # no successor yet
        h.cores[0].die()
        t0 = time.monotonic()
        await h.client.wait_restart(1)  # past --worker-recovery-timeout: the submit refuses
        assert 0.04 < time.monotonic() - t0 < 1.0
        with pytest.raises(CoreRestarting):
            h.client.submit([_req("a")])
        with pytest.raises(QueueFull, match="--max-queued-requests"):
            await h.client.wait_restart(3)
        h.client.config = config  # 60 s now: only the drain ends the wait
        waiting = asyncio.create_task(h.client.wait_restart(1))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        h.client.stop_holding()
        await asyncio.wait_for(waiting, 1)
        await h.client.wait_restart(1)  # draining: no waiting any more
        h.supervisor.stop()

    asyncio.run(run())


def test_a_call_does_not_wait_for_a_core_that_cannot_come_back_by_itself():
    async def run() -> None:
        h = Harness()
        await h.start(_ready("m"))
        h.cores[0].die()
        (await h.successor(1)).say(_ready("other"))  # the workers serve another model
        await _until(lambda: h.client.stuck, "the model change noticed")
        await asyncio.wait_for(h.client.wait_restart(1), 1)  # at once, not the timeout
        h.supervisor.stop()

    asyncio.run(run())
