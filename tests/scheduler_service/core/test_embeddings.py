"""Embedding requests in the core: prefill-only requests batched with
generation, chunked, reading the cache for last-token pooling and never for
mean pooling, each finishing with the simulated model's vector."""

from __future__ import annotations

import pytest

from common.simulated_model import simulated_embedding
from scheduler_service.core import (
    FinishLength,
    InvalidRequestError,
    ProtocolError,
    Request,
    SamplingParams,
    SchedulerConfig,
)
from scheduler_service.core.embedding import EmbedOptions
from tests.scheduler_service.core.support.sim_driver import (
    check_drained,
    check_outputs,
    drive,
    make_pair,
)

V = 64


def embed_req(rid: str, prompt: list[int], pooling: str, *, normalize: bool = True) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_new_tokens=0),
        embed=EmbedOptions(pooling, normalize),
    )


def embeddings_of(sched, worker, arrivals, overlap=0) -> dict[str, list[list[float]]]:
    """Drive to the end; every embedding delta per rid."""
    got: dict[str, list[list[float]]] = {}
    drain = sched.drain

    def collecting():
        out = drain()
        for d in out:
            if d.embedding is not None:
                got.setdefault(d.req.rid, []).append(d.embedding)
        return out

    sched.drain = collecting
    drive(sched, worker, arrivals, overlap=overlap)
    return got


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("lag", [0, 2])
def test_embeddings_batch_with_generation_chunked_and_match_the_model(pooling, lag):
    config = SchedulerConfig(vocab_size=V, page_size=4, chunked_prefill_size=8)
    sched, worker = make_pair(config, 128, V)
    gen = Request("gen", list(range(1, 20)), SamplingParams(max_new_tokens=12))
    embeds = [embed_req(f"e{i}", [i + 2, *range(3, 25 + i)], pooling) for i in range(3)]
    raw = embed_req("raw", list(range(5, 30)), pooling, normalize=False)
    arrivals = [(0, gen), (1, embeds[0]), (2, embeds[1]), (2, raw), (6, embeds[2])]
    got = embeddings_of(sched, worker, arrivals, overlap=lag)
    for r in [*embeds, raw]:
        want = simulated_embedding(r.prompt_ids, pooling, normalize=r.embed.normalize)
        assert got[r.rid] == [want], r.rid  # exactly one vector, the model's
        assert r.output_ids == [] and r.finish_reason == FinishLength(0)
    assert sum(x * x for x in got["e0"][0]) == pytest.approx(1.0)
    assert sum(x * x for x in got["raw"][0]) != pytest.approx(1.0)
    check_outputs([gen], config, V, _log_of(gen))
    check_drained(sched, worker)


def _log_of(req: Request):
    from tests.scheduler_service.core.support.sim_driver import DriveLog

    log = DriveLog()
    log.deltas[req.rid] = list(req.output_ids)
    log.finished_deltas[req.rid] = 1
    return log


def test_last_token_pooling_reads_the_cache_and_mean_pooling_computes_the_prompt():
    config = SchedulerConfig(vocab_size=V, page_size=4)
    prompt = list(range(1, 34))
    sched, worker = make_pair(config, 64, V)
    drive(sched, worker, [(0, Request("warm", prompt, SamplingParams(max_new_tokens=1)))])
    last, mean = embed_req("last", prompt, "last"), embed_req("mean", prompt, "mean")
    got = {}
    for r in (last, mean):
        sched.add_request(r)
        plan = sched.step()
        (join,) = plan.joins
        got[r.rid] = len(join.prefix_ids)
        sched.update(worker.execute(plan))
        assert r.finished
    assert got == {"last": 32, "mean": 0}
    assert last.cached_tokens == 32 and mean.cached_tokens == 0
    drive(sched, worker, [])  # the leaves
    check_drained(sched, worker)


def test_an_embedding_request_generates_nothing_and_must_get_its_vector():
    config = SchedulerConfig(vocab_size=V)
    sched, worker = make_pair(config, 64, V)
    bad = Request("bad", [1, 2], SamplingParams(max_new_tokens=3), embed=EmbedOptions())
    with pytest.raises(InvalidRequestError, match="generates nothing"):
        sched.add_request(bad)
    r = embed_req("e", [1, 2, 3], "last")
    sched.add_request(r)
    plan = sched.step()
    result = worker.execute(plan)
    result.outputs[0].embedding = None  # a worker that forgot it
    with pytest.raises(ProtocolError, match="no embedding"):
        sched.update(result)
