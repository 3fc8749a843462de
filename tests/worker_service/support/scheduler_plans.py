"""The real Scheduler driving a real ModelRunner in process: plans encoded to
the wire and decoded by the worker, results back the same way, the runner's
page tables checked after every step. Greedy requests; what each generated
(tokens and their logprobs) comes back in submission order, with how often
the plans gave a sliding page that another slot had held before, and how
many null sliding entries they carried."""

from __future__ import annotations

from dataclasses import dataclass

from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.sampling import LogprobOptions
from scheduler_service.engine.worker_codec import WorkerCodec
from worker_service.execution.convert import plan_from_proto, result_to_proto
from worker_service.execution.model_runner import ModelRunner


@dataclass
class SlidingStats:
    reused: int = 0
    null_entries: int = 0


def serve_with_scheduler(
    runner: ModelRunner,
    arrivals: list[tuple[int, list[int]]],
    *,
    new_tokens: int,
    chunk: int,
) -> tuple[list[tuple[list[int], list[float]]], SlidingStats]:
    """``arrivals``: (step at which it is submitted, prompt). The scheduler
    gets the runner's pools (two when it has a sliding one)."""
    sched = Scheduler(
        SchedulerConfig(
            vocab_size=runner.vocab_size,
            page_size=runner.page_size,
            chunked_prefill_size=chunk,
            speculative_ngram=False,
        ),
        runner.num_pages,
        num_swa_pages=runner.num_swa_pages,
        swa_window=runner.swa_window,
    )
    codec = WorkerCodec(sliding=runner.num_swa_pages > 0)
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    logprobs = LogprobOptions(return_logprob=True)
    reqs = [Request(f"r{i}", p, sampling, logprobs) for i, (_, p) in enumerate(arrivals)]
    got: dict[str, tuple[list[int], list[float]]] = {r.rid: ([], []) for r in reqs}
    pending = sorted(zip((a for a, _ in arrivals), reqs, strict=True), key=lambda x: x[0])
    stats, owner = SlidingStats(), {}
    step = 0
    while pending or not sched.is_idle():
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        step += 1
        plan = sched.step()
        if plan is None:
            continue
        msg = codec.encode(plan)
        given = [(e.slot, p) for e in msg.extends for p in e.new_swa_pages]
        if codec.sliding:
            decoded = zip(msg.decode_slots, msg.decode_new_swa_pages, strict=True)
            given += [(slot, p - 1) for slot, p in decoded if p]
        for slot, page in given:
            stats.null_entries += page == 0
            stats.reused += owner.get(page, slot) != slot
            owner[page] = slot
        result = runner.execute(plan_from_proto(msg))
        assert not result.error, result.error
        runner.check_integrity()
        wire = pb.StepResult.FromString(result_to_proto(result).SerializeToString())
        sched.update(codec.decode(wire, plan))
        for delta in sched.drain():
            tokens, lps = got[delta.req.rid]
            tokens += delta.new_token_ids
            lps += [lp.logprob for lp in delta.logprobs if lp is not None]
        assert step < 10_000
    return [got[r.rid] for r in reqs], stats
