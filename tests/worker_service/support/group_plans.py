"""Greedy requests driven step by step over the Execute streams of a
tensor-parallel worker group, as the scheduler would: every rank gets every
plan; a request joins at a given step; after a failed step a new session
re-prefills the survivors (prompt + tokens so far) and decoding goes on.
Every wait for a result is bounded, so a hung rank fails the test instead
of hanging it."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from protos import worker_pb2 as pb
from tests.worker_service.support.worker_process import PlanStream

GREEDY = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)


@dataclass
class GroupRequest:
    prompt: list[int]
    max_new: int
    join_at: int = 0  # the step at which it joins
    adapter: str | None = None  # a LoRA adapter's name (put in adapter slot 1)
    outputs: list[int] = field(default_factory=list)
    # per session, filled while running
    slot: int = -1
    kv: int = 0
    pages: list[int] = field(default_factory=list)


class BoundedStreams:
    """Execute streams to every rank, read by threads so that a wait for a
    result can give up."""

    def __init__(self, addresses: list[str]) -> None:
        self.streams = [PlanStream(a) for a in addresses]
        self._results: list[queue.Queue] = [queue.Queue() for _ in addresses]
        for s, q in zip(self.streams, self._results, strict=True):
            threading.Thread(target=_pump, args=(s, q), daemon=True).start()

    def run(self, plan: pb.StepPlan, timeout_s: float) -> list[pb.StepResult]:
        """Every rank's result for ``plan``; TimeoutError naming the ranks
        that did not answer within ``timeout_s``."""
        for s in self.streams:  # every rank must have the plan before any can finish it
            s.send(plan)
        results: list[pb.StepResult | None] = []
        for q in self._results:
            try:
                results.append(q.get(timeout=timeout_s))
            except queue.Empty:
                results.append(None)
        missing = [rank for rank, r in enumerate(results) if r is None]
        if missing:
            raise TimeoutError(f"ranks {missing} did not answer step {plan.step_id}")
        return results

    def close(self) -> None:
        for s in self.streams:
            s.close()


def _pump(stream: PlanStream, results: queue.Queue) -> None:
    try:
        while True:
            results.put(stream.receive())
    except Exception:  # the stream ended (closed, or the worker stopped)
        return


class GroupDriver:
    """One session's plans: joins prefill prompt + outputs so far in one
    extend, the others decode; results are rank 0's tokens."""

    def __init__(self, streams: BoundedStreams, page_size: int, first_step_id: int) -> None:
        self.streams = streams
        self.page_size = page_size
        self.next_page = 0
        self.step_id = first_step_id

    def run(
        self, reqs: list[GroupRequest], timeout_s: float, start_step: int = 0
    ) -> tuple[int, list[pb.StepResult] | None]:
        """Steps until every request has its tokens; stops at the first step
        a rank answers with an error: (that step's index, every rank's result).
        (steps run, None) when none failed."""
        for slot, r in enumerate(reqs):
            r.slot, r.kv, r.pages = slot, 0, []
        joined: list[GroupRequest] = []
        step = start_step
        while any(len(r.outputs) < r.max_new for r in reqs):
            plan = pb.StepPlan(step_id=self.step_id, mode=pb.FORWARD_MODE_MIXED)
            self.step_id += 1
            for r in reqs:
                if r.join_at == step and r not in joined:
                    self._join(plan, r)
                    joined.append(r)
                elif r in joined and len(r.outputs) < r.max_new:
                    self._decode(plan, r)
            step += 1
            if not plan.extends and not plan.decode_slots:
                continue
            results = self.streams.run(plan, timeout_s)
            if any(res.error for res in results):
                return step - 1, results
            for slot, token in zip(results[0].slots, results[0].token_ids, strict=True):
                reqs[slot].outputs.append(token)
        return step, None

    def _pages_to(self, r: GroupRequest, kv_len: int) -> list[int]:
        need = -(-kv_len // self.page_size) - len(r.pages)
        new = list(range(self.next_page, self.next_page + need))
        self.next_page += need
        r.pages += new
        return new

    def _join(self, plan: pb.StepPlan, r: GroupRequest) -> None:
        tokens = r.prompt + r.outputs
        join = plan.joins.add(slot=r.slot, rid=f"r{r.slot}", sampling=GREEDY)
        join.prompt_len = len(tokens)
        if r.adapter is not None:
            plan.adapter_slots.add(slot=1, name=r.adapter)
            join.adapter_slot = 1
        pages = self._pages_to(r, len(tokens))
        plan.extends.add(slot=r.slot, start_pos=0, input_ids=tokens, new_pages=pages, sample=True)
        r.kv = len(tokens)

    def _decode(self, plan: pb.StepPlan, r: GroupRequest) -> None:
        plan.decode_slots.append(r.slot)
        plan.decode_positions.append(r.kv)
        new = self._pages_to(r, r.kv + 1)
        plan.decode_new_pages.append(new[0] + 1 if new else 0)
        r.kv += 1
