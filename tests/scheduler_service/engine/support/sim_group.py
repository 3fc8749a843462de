"""A stand-in WorkerGroup for the engine's collaborators (recovery.py,
adapter_loader.py): the group's methods they call, over an in-process
SimulatedWorker per session, and ranks that each keep the adapters loaded on
them. The test decides what the group does: away or back, another model
shape, a refused session, a rank that refuses or cannot be reached, loads
held until released.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc

from protos import worker_pb2 as pb
from scheduler_service.core import Request, Scheduler, SchedulerConfig
from scheduler_service.engine.worker_group import WorkerError
from scheduler_service.testing.simulated_worker import SimulatedWorker, expected_output

UNREACHABLE = "failed to connect to all addresses"


class Unreachable(grpc.RpcError):
    """What a rank's LoadAdapter future raises when the rank is gone."""

    def details(self) -> str:
        return UNREACHABLE


@dataclass
class _Info:
    """The part of pb.WorkerInfo the collaborators read."""

    page_size: int
    num_pages: int
    model: pb.ModelInfo
    num_swa_pages: int = 0  # one pool
    num_host_pages: int = 0  # no host tier
    num_storage_pages: int = 0  # no file tier


@dataclass
class _Rank:
    adapters: dict[str, str] = field(default_factory=dict)  # name -> path
    refuse: dict[str, str] = field(default_factory=dict)  # path -> its LoadAdapter error
    reachable: bool = True


class SimGroup:
    def __init__(
        self, num_pages: int, page_size: int, vocab_size: int, ranks: int = 2, slots: int = 4
    ) -> None:
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
        self.slots = slots
        self.ranks = [_Rank() for _ in range(ranks)]
        self.reachable = True  # GetInfo answers
        self.refuse_open = ""  # a session refusal (a newer scheduler holds the group)
        self.worker: SimulatedWorker | None = None  # the open session's
        self.connects = 0  # GetInfo attempts
        self.stored_hashes: list[int] = []  # the file tier's blocks (none)
        self.opened = 0
        self.dropped = 0
        self.hold_loads = False  # LoadAdapter answers wait for release_loads()
        self._held: deque[tuple[Future, pb.LoadAdapterResponse]] = deque()

    # ------------------------------------------ what the collaborators call
    def try_connect(self, timeout_s: float = 2.0) -> _Info:
        self.connects += 1
        if not self.reachable:
            raise WorkerError(f"worker 127.0.0.1:1: {UNREACHABLE}")
        return _Info(self.page_size, self.num_pages, pb.ModelInfo(vocab_size=self.vocab_size))

    def open(self) -> None:
        if self.refuse_open:
            raise WorkerError(self.refuse_open)
        # A new session starts from no request state (worker_service/rpc/session.py).
        self.worker = SimulatedWorker(
            self.num_pages, self.page_size, self.vocab_size, adapter_slots=self.slots
        )
        self.opened += 1

    def drop_streams(self) -> None:
        self.worker = None
        self.dropped += 1

    def load_adapter(self, name: str, path: str, max_rank: int, timeout_s: float) -> list:
        futures = []
        for i, rank in enumerate(self.ranks):
            f: Future = Future()
            if not rank.reachable:
                f.set_exception(Unreachable())
            else:
                error = rank.refuse.get(path, "")
                if not error:
                    rank.adapters[name] = path
                response = pb.LoadAdapterResponse(error=error, rank=i)
                if self.hold_loads:
                    self._held.append((f, response))
                else:
                    f.set_result(response)
            futures.append(f)
        return futures

    def unload_adapter(self, name: str, timeout_s: float = 10.0) -> None:
        for rank in self.ranks:
            rank.adapters.pop(name, None)

    # ------------------------------------------------------- for the test
    def release_loads(self, n: int | None = None) -> None:
        """Answer ``n`` held LoadAdapter calls (all if None), oldest first."""
        for _ in range(len(self._held) if n is None else n):
            f, response = self._held.popleft()
            f.set_result(response)

    def restart(self) -> None:
        """The worker processes restarted: no adapter is loaded on them."""
        for rank in self.ranks:
            rank.adapters.clear()

    def loaded_on_every_rank(self) -> set[str]:
        return set.intersection(*(set(r.adapters) for r in self.ranks))


def scheduler_and_group(
    num_pages: int = 64, page_size: int = 4, vocab_size: int = 64, **config
) -> tuple[Scheduler, SimGroup]:
    """A real Scheduler and a group of its shape, its first session open."""
    cfg = SchedulerConfig(page_size=page_size, vocab_size=vocab_size, **config)
    group = SimGroup(num_pages, page_size, vocab_size, slots=cfg.max_loras_per_batch)
    group.open()
    return Scheduler(cfg, num_pages), group


def run_steps(
    sched: Scheduler, worker: SimulatedWorker, got: dict[str, list[int]], steps: int = 10_000
) -> None:
    """Plan, execute and apply up to ``steps`` steps (until idle), checking
    integrity after each; the tokens delivered go to ``got``."""
    for _ in range(steps):
        plan = sched.step()
        sched.check_integrity()
        if plan is not None:
            sched.update(worker.execute(plan))
            sched.check_integrity()
        for d in sched.drain():
            got.setdefault(d.req.rid, []).extend(d.new_token_ids)
        if sched.is_idle():
            return


def oracle(req: Request, vocab_size: int) -> list[int]:
    """The simulated model's output for ``req`` (no stop tokens or strings)."""
    return expected_output(
        req.prompt_ids, req.sampling.max_new_tokens, vocab_size, frozenset(), adapter=req.adapter
    )
