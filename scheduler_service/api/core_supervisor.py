"""Keeps the scheduler's core process running, from the API process.

Spawns the core (the one place the API process reaches into ``engine/``),
hands its messages to the CoreClient and, when a core that has served dies
(killed, crashed, or stopped on an internal error), ends the calls in flight
through the client and spawns a successor with backoff
(common/restart_backoff.py: 1 s doubling to 30 s, from 1 s again after a
core that stayed up 60 s). Meanwhile new Generate calls wait for the
successor (CoreClient.wait_restart, at most --worker-recovery-timeout), other
new work is refused UNAVAILABLE with a message that names the core, and
readiness is NOT_SERVING (readiness.py).

A successor opens its worker sessions above its predecessor's epoch (it reads
the workers' highest; docs/design.md section 4), so it takes the group over
however the old one ended; the old one is gone for sure before the successor
starts. It preloads ``--lora-paths`` itself; the adapters loaded through the
API are loaded again here before work is taken. It must serve the model the
API process announced (validation, tokenizer, names come from the first
core's Ready); if the workers now serve another one, this process cannot
serve again by itself: liveness turns NOT_SERVING and restarts go on.

Both ``radixserve serve`` and ``radixserve-scheduler`` run this (the API
process owns the core's lifetime in both), so a lost core is never a
permanent outage, in Kubernetes or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from common.restart_backoff import RestartBackoff
from scheduler_service import ipc
from scheduler_service.api.core_client import (
    CoreBroken,
    CoreClient,
    CoreRestarting,
    CoreUnavailable,
)
from scheduler_service.api.core_process import CoreProcess
from scheduler_service.config import ServiceConfig

logger = structlog.get_logger(__name__)

START_TIMEOUT_S = 900.0  # a core (first or successor) reaches its workers by then
REAP_GRACE_S = 5.0  # a dead core's successor starts once it is gone for sure
# What a successor must report as its predecessor did.
SAME_MODEL = ("model_name", "architecture", "vocab_size", "eos_token_ids", "page_size")


class ModelChanged(CoreUnavailable):
    """A successor core found the workers serving another model."""


# (on_message, on_exit) -> a core process, not started yet
MakeCore = Callable[[Callable, Callable], CoreProcess]


class CoreSupervisor:
    def __init__(
        self,
        client: CoreClient,
        config: ServiceConfig,
        make_core: MakeCore | None = None,
        backoff: RestartBackoff | None = None,
    ) -> None:
        """``make_core``: what a core process is (default: ``core_main``
        spawned; tests drive the restart policy with stand-ins)."""
        self.client = client
        self.config = config
        self.make_core = make_core or self._core_main_process
        self.backoff = backoff or RestartBackoff()
        self._core: CoreProcess | None = None  # the current core
        self._starting: asyncio.Future | None = None  # its Ready, while awaited
        self._restarting: asyncio.Task | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._core.pid if self._core is not None else None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> ipc.Ready:
        """Spawn the first core and wait until it has reached the workers;
        CoreUnavailable if it cannot (a startup error: no restart)."""
        _, ready = await self._launch(timeout_s)
        self.client.up(ready)
        return ready

    def stop(self) -> None:
        self._stopping = True
        if self._restarting is not None:
            self._restarting.cancel()
        core = self._core
        self._abandon(core)
        if core is not None:
            # A serving core gets Shutdown and time to flush its spans; one
            # still starting has nothing to finish.
            core.stop(grace_s=1.0 if self.client.failed else 5.0)

    # -------------------------------------------------------------- spawn
    def _core_main_process(self, on_message: Callable, on_exit: Callable) -> CoreProcess:
        from scheduler_service.engine.main import core_main

        return CoreProcess(core_main, (self.config,), on_message, on_exit)

    async def _launch(self, timeout_s: float) -> tuple[CoreProcess, ipc.Ready]:
        """Spawn a core and wait for its Ready; CoreUnavailable (and the core
        gone) if it fails first or takes longer than ``timeout_s``."""
        loop = asyncio.get_running_loop()
        self._starting = starting = loop.create_future()
        core = self.make_core(self._on_message, self._on_exit)
        self._core = core
        core.start(loop)  # from the loop's thread: it lives as long as the core should
        self.client.attach(core)
        try:
            return core, await asyncio.wait_for(asyncio.shield(starting), timeout_s)
        except TimeoutError:
            self._abandon(core)
            await core.gone(0.0)
            raise CoreUnavailable("the core process did not reach its workers in time") from None
        except CoreUnavailable:
            self._abandon(core)
            await core.gone(REAP_GRACE_S)
            raise
        finally:
            self._starting = None

    def _abandon(self, core: CoreProcess | None) -> None:
        """Stop listening to ``core`` (its last words no longer matter)."""
        if core is not None and core is self._core:
            self._core = None
            self.client.attach(pipe=None)

    # ----------------------------------------------------------- messages
    def _on_message(self, core: CoreProcess, msg: object) -> None:
        if core is not self._core:
            return
        starting = self._starting
        if starting is not None and not starting.done():
            if isinstance(msg, ipc.Ready):
                starting.set_result(msg)
                return
            if isinstance(msg, ipc.Failed):
                starting.set_exception(CoreUnavailable(msg.message))
                return
        if isinstance(msg, ipc.Failed):
            self._died(msg.message, msg.code)
        else:
            self.client.dispatch(msg)

    def _on_exit(self, core: CoreProcess, how: str) -> None:
        if core is not self._core or self._stopping:
            return
        starting = self._starting
        if starting is not None and not starting.done():
            starting.set_exception(CoreUnavailable(f"the core process {how} while starting"))
            return
        self._died(f"the scheduler's core process died ({how})", "UNAVAILABLE")

    # ----------------------------------------------------------- restarts
    def _died(self, message: str, code: str) -> None:
        """The current core stopped (``code`` INTERNAL: on a bug of its own,
        e.g. --check-integrity; its calls end INTERNAL as they always did) or
        died (the calls end UNAVAILABLE naming the core)."""
        dead = self._core
        self._abandon(dead)
        client = self.client
        if self._restarting is not None and not self._restarting.done():
            # a successor died while being made ready: that attempt failed
            client.fail_pending(CoreUnavailable(message))
            return
        restart = client.ready is not None and not self._stopping
        logger.error("core process failed", error=message, code=code, restart=restart)
        down = message
        if code == "INTERNAL":
            client.down(message, CoreBroken)  # the calls in flight end INTERNAL, as always
            down = "the scheduler's core process stopped on an internal error"
        elif restart:
            client.down(f"{message}; restarting it", CoreRestarting)
        else:
            client.down(message)
        if restart:
            client.still_down(f"{down}; restarting it", CoreRestarting)
            up_for = time.monotonic() - dead.started_at if dead is not None else 0.0
            self._restarting = asyncio.get_running_loop().create_task(
                self._restart(dead, down, up_for), name="core-restart"
            )

    async def _restart(self, dead: CoreProcess | None, down: str, up_for: float) -> None:
        """Spawn successors with backoff until one serves (or we stop)."""
        if dead is not None:
            await dead.gone(REAP_GRACE_S)  # two cores never drive the workers at once
        known = list(self.client.adapters)
        attempts = 0
        while not self._stopping:
            delay = self.backoff.delay(up_for)
            up_for = 0.0
            logger.warning("restarting the core process", in_s=delay, after=down)
            await asyncio.sleep(delay)
            attempts += 1
            core = None
            try:
                core, ready = await self._launch(START_TIMEOUT_S)
                self._check_model(ready)
                adapters = await self._restore_adapters(known, ready)
                if self._core is not core:  # its Failed or exit came right after its Ready
                    raise CoreUnavailable("the new core process stopped before it served")
            except Exception as e:  # a supervisor that gives up is a permanent outage
                expected = isinstance(e, (CoreUnavailable, OSError))
                log = logger.error if expected else logger.exception
                log("the core process could not be restarted", error=str(e))
                if core is not None:
                    self._abandon(core)
                    with contextlib.suppress(OSError):
                        core.send(ipc.Shutdown())
                    await core.gone(1.0)
                self.client.still_down(
                    f"{down}; restarting it (failed attempts: {attempts}, the last: {e})",
                    CoreRestarting,
                    stuck=str(e) if isinstance(e, ModelChanged) else None,
                )
                continue
            self.client.up(ready, adapters)
            self.client.restarts += 1
            logger.warning(
                "core process restarted", restarts=self.client.restarts, pid=core.pid, after=down
            )
            return

    def _check_model(self, ready: ipc.Ready) -> None:
        first = self.client.ready
        changed = [k for k in SAME_MODEL if getattr(ready, k) != getattr(first, k)]
        if changed:
            raise ModelChanged(
                f"the workers now serve another model ({', '.join(changed)} changed: "
                f"{ready.model_name}, was {first.model_name}); restart this scheduler to serve it"
            )

    async def _restore_adapters(
        self, known: list[ipc.AdapterInfo], ready: ipc.Ready
    ) -> list[ipc.AdapterInfo]:
        """Load the adapters loaded through the API again (the successor
        preloaded --lora-paths itself); one that no longer loads is dropped.
        Returns the adapters loaded after it."""
        adapters = ready.adapters
        have = {a.lora_id for a in adapters}
        for a in known:
            if a.lora_id in have:
                continue
            reply = await self.client.adapter_op(
                lambda token, a=a: ipc.LoadAdapter(token, a.lora_id, a.name, a.path, a.pinned),
                while_down=True,
            )
            adapters = reply.adapters
            if reply.ok:
                logger.info("LoRA adapter loaded again after a core restart", lora_id=a.lora_id)
            else:
                logger.error(
                    "LoRA adapter could not be loaded again after a core restart",
                    lora_id=a.lora_id,
                    error=reply.message,
                )
        return adapters
