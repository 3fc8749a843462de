"""Embedding requests over the real wire encoding, in process: the Scheduler's
plans through the worker codec and protobuf to the worker's ModelRunner with
the simulated model (``--model simulated``), its results back the same way.
Both simulated workers give the same vectors, mean joins carry no cached
prefix, and a generation request beside them is unaffected."""

from __future__ import annotations

import numpy

from common.simulated_model import expected_output, simulated_embedding
from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.engine.worker_codec import WorkerCodec
from worker_service.execution.convert import plan_from_proto, result_to_proto
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.simulated_compute import SimulatedCompute

V, PAGE, PAGES = 500, 4, 128
POOLINGS = {"gen": pb.POOLING_NONE, "last": pb.POOLING_LAST, "mean": pb.POOLING_MEAN}


def test_embeddings_cross_the_wire_to_the_simulated_worker_and_back():
    sched = Scheduler(SchedulerConfig(vocab_size=V, page_size=PAGE, chunked_prefill_size=8), PAGES)
    runner = ModelRunner(
        SimulatedCompute(vocab_size=V), num_pages=PAGES, page_size=PAGE, vocab_size=V
    )
    codec = WorkerCodec()
    shared = list(range(10, 34))
    gen = Request("gen", shared + [1], SamplingParams(max_new_tokens=10, ignore_eos=True))
    reqs = [gen]
    for pooling, normalize in [("last", True), ("mean", False)]:
        for i in range(2):
            opts = EmbedOptions(pooling, normalize=normalize)
            prompt = shared + [2, i]
            reqs.append(
                Request(f"{pooling}{i}", prompt, SamplingParams(max_new_tokens=0), embed=opts)
            )
    vectors: dict[str, list[float]] = {}
    joins: dict[str, int] = {}
    for r in reqs:
        sched.add_request(r)
    for _ in range(200):
        plan = sched.step()
        if plan is None:
            if sched.is_idle():
                break
            continue
        msg = codec.encode(plan)
        for j in msg.joins:
            joins[j.rid] = len(j.prefix_ids)
            assert (
                j.pooling
                == {"": 0, "l": pb.POOLING_LAST, "m": pb.POOLING_MEAN}[
                    j.rid[:1] if j.rid != "gen" else ""
                ]
            )
        wire_result = result_to_proto(runner.execute(plan_from_proto(msg)))
        sched.update(codec.decode(pb.StepResult.FromString(wire_result.SerializeToString()), plan))
        for d in sched.drain():
            if d.embedding is not None:
                vectors.setdefault(d.req.rid, []).append(d.embedding)
    assert sched.is_idle()
    for r in reqs[1:]:
        want = simulated_embedding(r.prompt_ids, r.embed.pooling, normalize=r.embed.normalize)
        (got,) = vectors[r.rid]  # once
        assert got == numpy.float32(want).tolist(), r.rid  # float32 on the wire
    # last-token pooling read the shared prefix from the cache; mean pooling never
    assert joins == {"gen": 0, "last0": 24, "last1": 24, "mean0": 0, "mean1": 0}
    assert gen.output_ids == expected_output(gen.prompt_ids, 10, V)
