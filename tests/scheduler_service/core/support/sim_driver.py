"""Drives a Scheduler against the SimulatedWorker and checks it as it goes.

Used by the core's unit and property tests: integrity after every step and
every update, outputs against the simulated worker's oracle at the end, and
the pool back to "free or cached-unlocked" once everything is done.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core import (
    FinishAbort,
    FinishLength,
    FinishStop,
    Request,
    Scheduler,
    SchedulerConfig,
    StopCheck,
    check_stop_text,
)
from scheduler_service.core.plan import StepPlan, StepResult
from scheduler_service.testing.simulated_files import SimulatedFiles
from scheduler_service.testing.simulated_worker import SimulatedWorker, expected_output


@dataclass
class DriveLog:
    steps: int = 0
    plans: int = 0
    deltas: dict[str, list[int]] = field(default_factory=dict)
    finished_deltas: dict[str, int] = field(default_factory=dict)
    plans_by_mode: dict[str, int] = field(default_factory=dict)


def make_pair(
    config: SchedulerConfig,
    num_pages: int,
    vocab_size: int,
    *,
    num_swa_pages: int = 0,
    swa_window: int = 0,
    files: SimulatedFiles | None = None,
    **sched_kwargs,
) -> tuple[Scheduler, SimulatedWorker]:
    """A scheduler and its simulated worker; ``num_swa_pages``/``swa_window``:
    both shaped like a model with sliding-window layers."""
    sched_kwargs.setdefault("stop_strings", toy_stop_strings)
    sched = Scheduler(
        config, num_pages, num_swa_pages=num_swa_pages, swa_window=swa_window, **sched_kwargs
    )
    worker = SimulatedWorker(
        num_pages,
        config.page_size,
        vocab_size,
        adapter_slots=config.max_loras_per_batch,
        num_swa_pages=num_swa_pages,
        swa_window=swa_window,
        num_host_pages=config.hicache_host_pages,
        files=files if files is not None or not config.hicache_storage_pages else SimulatedFiles(),
    )
    return sched, worker


def drive(
    sched: Scheduler,
    worker: SimulatedWorker,
    arrivals: list[tuple[int, Request]],
    aborts: dict[int, list[str]] | None = None,
    overlap: bool | int = False,
    max_steps: int = 50_000,
    check: bool = True,
    columns: bool = False,
) -> DriveLog:
    """Run until every request is done and the worker holds nothing.

    ``overlap`` is how many plans may be in flight beyond the one just made
    (True is 1: plan N+1 is made before result N is applied). ``columns``:
    results go to the scheduler in the token column form where it fits
    (``as_token_column``), as the worker codec hands over a real worker's.
    """
    lag = int(overlap)
    aborts = aborts or {}
    todo = deque(sorted(arrivals, key=lambda a: a[0]))
    inflight: deque = deque()
    log = DriveLog()

    def collect() -> None:
        for d in sched.drain():
            if d.req.rid in log.finished_deltas:
                raise AssertionError(f"{d.req.rid} got a delta after finishing")
            log.deltas.setdefault(d.req.rid, []).extend(d.new_token_ids)
            if d.finished:
                log.finished_deltas[d.req.rid] = 1

    t = 0
    while True:
        while todo and todo[0][0] <= t:
            sched.add_request(todo.popleft()[1])
        for rid in aborts.get(t, ()):
            sched.abort(rid, "test abort")
        collect()
        plan = sched.step()
        if check:
            sched.check_integrity()
        if plan is not None:
            log.plans += 1
            log.plans_by_mode[plan.mode.value] = log.plans_by_mode.get(plan.mode.value, 0) + 1
            inflight.append(plan)
        # Without overlap the plan just made runs now; with overlap the one
        # before it does, so step N+1 was planned before result N arrived.
        while inflight and (len(inflight) > lag or plan is None):
            done = inflight.popleft()
            result = worker.execute(done)
            sched.update(as_token_column(result, done) if columns else result)
            if check:
                sched.check_integrity()
        collect()
        t += 1
        if not todo and not inflight and sched.is_idle():
            break
        if t >= max_steps:
            raise AssertionError(f"not done after {max_steps} steps")
    log.steps = t
    return log


def as_token_column(result: StepResult, plan: StepPlan) -> StepResult:
    """``result`` as ``StepResult.tokens`` where that form fits (as the
    worker codec decodes a plain result): every output a sampled token and
    nothing else, and no sampling request asking for logprobs (the
    simulated worker attaches a logprob to every token, asked or not)."""
    outs = result.outputs
    sampling = [e for e in plan.extends if e.sample] + plan.decodes
    if (
        plan.drafted
        or len(outs) != len(sampling)
        or any(e.req.logprobs.return_logprob for e in sampling)
        or any(
            o.token_id is None
            or o.prompt_logprobs
            or o.more_tokens
            or o.embedding is not None
            or o.grammar_ended
            for o in outs
        )
    ):
        return result
    tokens = [o.token_id for o in outs]
    return StepResult(
        result.step_id,
        [],
        result.forward_ms,
        result.idle_ms,
        tokens=tokens,
        storage_done=result.storage_done,
    )


def toy_text(tokens: list[int]) -> str:
    """A stand-in detokenizer: token t reads "<t>"."""
    return "".join(f"<{t}>" for t in tokens)


def toy_stop_strings(req: Request) -> StopCheck:
    """StopStringChecker over toy_text (whole-text search, fine for tests)."""
    return check_stop_text(toy_text(req.output_ids), req.sampling.stop_strs)


def stop_ids(req: Request, config: SchedulerConfig) -> frozenset[int]:
    if req.sampling.ignore_eos:
        return frozenset()
    return req.sampling.stop_token_ids | config.eos_token_ids


def check_outputs(
    reqs: list[Request],
    config: SchedulerConfig,
    vocab_size: int,
    log: DriveLog,
    allow_abort: set[str] = frozenset(),
) -> None:
    """Every request's output is the oracle's (a prefix of it if aborted)."""
    for req in reqs:
        strs = req.sampling.stop_strs
        exp = expected_output(
            req.prompt_ids,
            req.sampling.max_new_tokens,
            vocab_size,
            stop_ids(req, config),
            min_new_tokens=req.sampling.min_new_tokens,
            stops=(lambda out, strs=strs: any(s in toy_text(out) for s in strs)) if strs else None,
            adapter=req.adapter,
        )
        reason = req.finish_reason
        assert req.finished, f"{req.rid} did not finish"
        assert log.deltas.get(req.rid, []) == req.output_ids, f"{req.rid}: deltas != output"
        assert log.finished_deltas.get(req.rid) == 1, f"{req.rid}: no finished delta"
        if isinstance(reason, FinishAbort):
            assert req.rid in allow_abort, f"{req.rid} aborted unexpectedly: {reason.message}"
            assert req.output_ids == exp[: len(req.output_ids)], f"{req.rid}: wrong tokens"
            continue
        assert req.output_ids == exp, f"{req.rid}: {req.output_ids} != {exp}"
        if isinstance(reason, FinishStop) and isinstance(reason.matched, str):
            assert reason.matched in strs and reason.matched in toy_text(exp)
        elif isinstance(reason, FinishStop):
            assert reason.matched == exp[-1] and exp[-1] in stop_ids(req, config)
        else:
            assert isinstance(reason, FinishLength)
            assert len(exp) == req.sampling.max_new_tokens


def check_drained(sched: Scheduler, worker: SimulatedWorker) -> None:
    """Nothing held: every page free or cached-unlocked, worker state empty."""
    sched.check_integrity()
    assert sched.cache.protected_pages == 0
    assert sched.pool.num_free + sched.cache.evictable_pages == sched.pool.num_pages
    sliding = sched.sliding
    if sliding is not None:  # every sliding page free or cached alone (page 0 is the null page)
        assert sliding.num_free + sliding.tree_only == sliding.num_pages - 1
        assert sliding.tree_only == sliding.tree_held
    tier = sched.hicache
    if tier is not None:  # no copy in flight or planned, nothing held for one
        assert not tier.transfers.pending and tier.transfer_locks == 0
        assert tier.transfers.held() == ({}, 0)
        storage = tier.storage
        if storage is not None:  # every prefetch reported, its pages given back
            assert not storage.pending and not storage.outstanding and not storage.by_rid
    assert not worker.reqs, f"worker still holds {sorted(worker.reqs)[:5]}"
    assert not any(sched.adapters.users), f"adapter slots still used: {sched.adapters.users}"
    assert not sched.in_flight()
