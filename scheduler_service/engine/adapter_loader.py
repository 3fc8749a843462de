"""LoRA adapters on the worker group, for the core loop.

Loading reads an adapter from disk on every rank (its own shard), which can
take a while, so it never blocks a step: ``start_load`` sends the ranks
their LoadAdapter calls as gRPC futures and ``poll`` (once per loop
iteration) registers the adapter in the Scheduler's table once every rank
answered. Any rank's refusal unloads it from the ranks that took it, so
nothing is half-loaded. Unloading is refused while a request (waiting or
running) uses the adapter; the worker keeps a slot's adapter until a plan
reassigns the slot, so an unload never races a plan in flight.

At most MAX_LOADS_IN_FLIGHT loads run on the ranks at once, the worker's
own bound on LoadAdapter calls (past it a worker refuses the call: it bounds
a stranger's slow reads); more wait here in order. Eight concurrent
LoadLoRAAdapter calls, --max-loaded-loras' default, used to see four refused
as "worker unreachable" (issue 27, second hardening round).

After a worker loss the group that comes back has no adapter: ``reload_all``
loads every registered adapter on it before the first plan, so re-prefilled
requests run with theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import structlog

from scheduler_service import ipc
from scheduler_service.core.adapters import Adapter, AdapterError
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.worker_group import WorkerError, WorkerGroup

logger = structlog.get_logger(__name__)

LOAD_TIMEOUT_S = 300.0
# worker_service/call_budget.py ADAPTER_LOADS (a test keeps the two equal)
MAX_LOADS_IN_FLIGHT = 4
# Words of a worker's refusal that mean the directory or a file is missing.
_MISSING = ("no such", "not found", "does not exist", "missing")


@dataclass
class _Loading:
    msg: ipc.LoadAdapter
    futures: list
    started: float


def _code_of(error: str) -> str:
    return "NOT_FOUND" if any(w in error.lower() for w in _MISSING) else "INVALID_ARGUMENT"


class AdapterLoader:
    def __init__(self, sched: Scheduler, group: WorkerGroup, max_rank: int) -> None:
        self.sched = sched
        self.group = group
        self.max_rank = max_rank
        self._loading: list[_Loading] = []
        self._queued: list[ipc.LoadAdapter] = []  # waiting for a load to end

    @property
    def busy(self) -> bool:
        return bool(self._loading or self._queued)

    def snapshot(self) -> list[ipc.AdapterInfo]:
        return [
            ipc.AdapterInfo(a.lora_id, a.name, a.path, a.pinned)
            for a in self.sched.loaded_adapters()
        ]

    def _done(self, token: int) -> ipc.AdapterReply:
        """The load or unload of ``token`` succeeded."""
        return ipc.AdapterReply(token, ok=True, message="", adapters=self.snapshot())

    def _refused(self, token: int, message: str, code: str) -> ipc.AdapterReply:
        """It failed: ``code`` is the gRPC status the API answers with."""
        return ipc.AdapterReply(
            token, ok=False, message=message, adapters=self.snapshot(), code=code
        )

    # ------------------------------------------------------------------ load
    def preload(self, entries: list[tuple[str, str]]) -> None:
        """--lora-paths at start (lora_id = name); WorkerError if one fails."""
        for name, path in entries:
            adapter = Adapter(name, name, path)
            try:
                self.sched.check_adapter(adapter)
            except AdapterError as e:
                raise WorkerError(f"--lora-paths {name}={path}: {e}") from None
            error = self._load_now(name, path)
            if error:
                raise WorkerError(f"--lora-paths {name}={path}: {error}")
            self.sched.register_adapter(adapter)
            logger.info("LoRA adapter loaded", lora_id=name, path=path)

    def start_load(self, msg: ipc.LoadAdapter) -> ipc.AdapterReply | None:
        """Begin loading; an answer now if it is refused at once."""
        adapter = Adapter(msg.lora_id, msg.name or msg.lora_id, msg.path, msg.pinned)
        busy = [w.msg for w in self._loading] + self._queued
        if any(m.lora_id == msg.lora_id or m.name == adapter.name for m in busy):
            return self._refused(
                msg.token, f"adapter {msg.lora_id!r} is being loaded", "ALREADY_EXISTS"
            )
        try:
            self.sched.check_adapter(adapter, loading=len(busy))
        except AdapterError as e:
            return self._refused(msg.token, str(e), e.code)
        if len(self._loading) >= MAX_LOADS_IN_FLIGHT:
            self._queued.append(msg)
        else:
            self._send(msg)
        return None

    def _send(self, msg: ipc.LoadAdapter) -> None:
        futures = self.group.load_adapter(msg.lora_id, msg.path, self.max_rank, LOAD_TIMEOUT_S)
        self._loading.append(_Loading(msg, futures, time.monotonic()))

    def poll(self) -> list[ipc.AdapterReply]:
        """Answers for the loads every rank has finished."""
        if not self._loading:
            return []
        replies, still = [], []
        for job in self._loading:
            if all(f.done() for f in job.futures):
                replies.append(self._finish(job))
            else:
                still.append(job)
        self._loading = still
        while self._queued and len(self._loading) < MAX_LOADS_IN_FLIGHT:
            self._send(self._queued.pop(0))
        return replies

    def _finish(self, job: _Loading) -> ipc.AdapterReply:
        msg = job.msg
        error, code = self._first_error(job.futures)
        if error:
            self.group.unload_adapter(msg.lora_id)  # from the ranks that took it
            return self._refused(msg.token, error, code or _code_of(error))
        adapter = Adapter(msg.lora_id, msg.name or msg.lora_id, msg.path, msg.pinned)
        try:
            self.sched.register_adapter(adapter)
        except AdapterError as e:  # e.g. a same-named one loaded meanwhile
            self.group.unload_adapter(msg.lora_id)
            return self._refused(msg.token, str(e), e.code)
        logger.info(
            "LoRA adapter loaded",
            lora_id=msg.lora_id,
            name=adapter.name,
            path=msg.path,
            pinned=msg.pinned,
            ms=round((time.monotonic() - job.started) * 1e3),
        )
        return self._done(msg.token)

    @staticmethod
    def _first_error(futures: list) -> tuple[str, str]:
        """The ranks' LoadAdapter answers (waited for): the first refusal ('' if
        none), and its code when the call itself failed: RESOURCE_EXHAUSTED (the
        worker's loads are all taken: strangers' on a worker without a token),
        else UNAVAILABLE ('' for the adapter's own refusal)."""
        for f in futures:
            try:
                response = f.result()
            except grpc.RpcError as e:
                details = e.details() if hasattr(e, "details") else str(e)
                if hasattr(e, "code") and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    return f"the worker is busy: {details}", "RESOURCE_EXHAUSTED"
                return f"worker unreachable: {details}", "UNAVAILABLE"
            if response.error:
                return response.error, ""
        return "", ""

    def _load_now(self, name: str, path: str) -> str:
        """Load on every rank and wait; the first refusal ('' if none)."""
        futures = self.group.load_adapter(name, path, self.max_rank, LOAD_TIMEOUT_S)
        error, code = self._first_error(futures)
        if code:  # not the adapter's fault: the caller retries (a reconnect) or stops
            raise WorkerError(f"loading adapter {name!r}: {error}")
        if error:
            self.group.unload_adapter(name)
        return error

    # ---------------------------------------------------------------- unload
    def unload(self, msg: ipc.UnloadAdapter) -> ipc.AdapterReply:
        loaded = {a.lora_id: a for a in self.sched.loaded_adapters()}
        lora_id = msg.lora_id
        if not lora_id:
            lora_id = next((a.lora_id for a in loaded.values() if a.name == msg.name), "")
        adapter = loaded.get(lora_id)
        if adapter is None or (msg.name and adapter.name != msg.name):
            which = f"lora_id {msg.lora_id!r}" if msg.lora_id else f"name {msg.name!r}"
            return self._refused(msg.token, f"no adapter with {which} is loaded", "NOT_FOUND")
        users = self.sched.requests_of_adapter(lora_id)
        if users:
            return self._refused(
                msg.token,
                f"adapter {lora_id!r} is used by {users} waiting or running requests; "
                "unload it once they finish",
                "FAILED_PRECONDITION",
            )
        self.sched.unregister_adapter(lora_id)
        self.group.unload_adapter(lora_id)
        logger.info("LoRA adapter unloaded", lora_id=lora_id, name=adapter.name)
        return self._done(msg.token)

    # ----------------------------------------------------------- worker loss
    def fail_loading(self, why: str) -> list[ipc.AdapterReply]:
        """The group was lost while adapters were loading: refuse them."""
        waiting = [job.msg for job in self._loading] + self._queued
        replies = [
            self._refused(msg.token, f"the worker group was lost: {why}", "UNAVAILABLE")
            for msg in waiting
        ]
        self._loading, self._queued = [], []
        return replies

    def reload_all(self) -> list[str]:
        """Load every registered adapter on the group that came back (before
        its first plan). Returns the lora_ids that failed (the caller ends
        their requests and they are unregistered); WorkerError if a rank is
        unreachable (the reconnect is retried)."""
        failed = []
        for adapter in self.sched.loaded_adapters():
            error = self._load_now(adapter.lora_id, adapter.path)
            if error:
                logger.error(
                    "LoRA adapter could not be reloaded after a worker loss",
                    lora_id=adapter.lora_id,
                    error=error,
                )
                failed.append(adapter.lora_id)
        return failed
