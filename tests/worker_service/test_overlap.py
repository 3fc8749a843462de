"""The worker queues step N+1 before waiting for step N's tokens (overlap), and
what it computes does not change: driven by the real scheduler core at
overlap depth 2 through the real codecs and the servicer's executing thread,
a worker with overlap gives every request the same tokens and logprobs as one
without, penalties, seeded sampling, prompt logprobs, chunking and n > 1
siblings included. On the CPU the kernels run at once, so this checks the
bookkeeping (predicted state, PENDING inputs gathered on the device, result
order), not the speed."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from scheduler_service.core import (
    LogprobOptions,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler_service.engine.worker_codec import WorkerCodec
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.execution.model_runner import PENDING
from worker_service.rpc.servicer import WorkerServicer

LAG = 2  # the scheduler's default overlap depth


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(24)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    reqs = [
        Request("greedy", shared + rand(5), greedy),
        Request("cached", shared + rand(9), greedy),
        Request("long", rand(45), greedy),  # prefilled in chunks
        Request(
            "penalty",
            rand(11),
            SamplingParams(max_new_tokens=16, temperature=0.0, repetition_penalty=1.3),
        ),
        Request("seeded", rand(13), SamplingParams(max_new_tokens=18, temperature=0.9, seed=5)),
        Request(
            "logprobs",
            rand(17),
            greedy,
            logprobs=LogprobOptions(return_logprob=True, logprob_start_len=3, top_logprobs_num=2),
        ),
    ]
    siblings = [Request(f"n-{i}", rand(0) + shared, greedy) for i in range(3)]
    for s in siblings[1:]:
        s.waits_for = "n-0"
    return reqs + siblings


def serve(
    tmp_path, overlap: str, only: tuple[str, ...] = ()
) -> tuple[dict[str, Request], dict[str, list], list[str]]:
    """Run the workload; returns the finished requests, their delivered
    logprobs and the order in which the compute launched and finished steps."""
    worker = worker_for(tmp_path, page_size=4, num_pages=512, overlap=overlap)
    compute = worker.runner.compute
    events: list[str] = []
    launch, finish = compute.launch, compute.finish

    def recorded_launch(work, num_extends, previous):
        events.append("L" + ("p" if any(w.pending is not None for w in work) else ""))
        return launch(work, num_extends, previous)

    def recorded_finish(step):
        events.append("F")
        return finish(step)

    compute.launch, compute.finish = recorded_launch, recorded_finish
    servicer = WorkerServicer(worker)
    plans: queue.SimpleQueue = queue.SimpleQueue()
    results: queue.SimpleQueue = queue.SimpleQueue()
    thread = threading.Thread(
        target=servicer._run_plans, args=(plans, servicer._stream_gen, results), daemon=True
    )
    thread.start()
    config = SchedulerConfig(
        page_size=4, vocab_size=VOCAB, chunked_prefill_size=16, max_running_requests=8
    )
    sched = Scheduler(config, 512)
    codec = WorkerCodec()
    reqs = [r for r in requests() if not only or r.rid in only]
    for r in reqs:
        sched.add_request(r)
    logprobs: dict[str, list] = {r.rid: [] for r in reqs}
    inflight = sched.in_flight()  # the plans sent, oldest first (the scheduler's record)
    while not sched.is_idle() or inflight:
        plan = sched.step()
        sched.check_integrity()
        if plan is not None:
            plans.put(codec.encode(plan))
        if inflight and (len(inflight) > LAG or plan is None):
            msg = results.get(timeout=60)
            assert not msg.error, msg.error
            assert msg.step_id == inflight[0].step_id
            sched.update(codec.decode(msg, inflight[0]))
            sched.check_integrity()
        for d in sched.drain():
            logprobs[d.req.rid] += [lp.logprob if lp else None for lp in d.logprobs]
            if d.prompt_logprobs:
                logprobs[d.req.rid] += [p.logprob for p in d.prompt_logprobs]
    plans.put(None)
    assert results.get(timeout=60) is None
    thread.join(10)
    assert all(PENDING not in s.tokens for s in worker.runner.slots.values())
    return {r.rid: r for r in reqs}, logprobs, events


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model("llama3-rope-scaling", path)
    return path


def test_overlapped_steps_give_the_same_tokens_and_logprobs(model_dir):
    plain, plain_lp, plain_events = serve(model_dir, "off")
    lapped, lapped_lp, events = serve(model_dir, "on")
    for rid, r in plain.items():
        assert r.finished and lapped[rid].finished
        assert lapped[rid].output_ids == r.output_ids, rid
        assert lapped_lp[rid] == plain_lp[rid], rid
    # Without overlap every launch is finished before the next; with it, steps
    # were launched on inputs still being sampled ("Lp"), before the step
    # before them was finished ("F").
    assert "LL" not in "".join(plain_events) and "Lp" not in "".join(plain_events)
    joined = "".join(events)
    assert joined.count("LpF") >= 10, joined


def test_a_request_whose_sampling_reads_its_tokens_is_not_overlapped(model_dir):
    # Repetition penalties read the previous token's value: such a decode waits.
    _, _, events = serve(model_dir, "on", only=("penalty",))
    assert "LpF" not in "".join(events) and "LL" not in "".join(events)
