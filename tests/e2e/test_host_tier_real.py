"""The host KV tier end to end on the default model: a multi-turn chat load
(conversations whose turns append to their whole history) on a device pool
that holds two of the four conversations, so each turn finds its history
evicted from the device (round-robin turns: the least recently used is the
next). With --enable-hierarchical-cache the history is loaded back from
host memory instead of recomputed: greedy tokens and their logprobs are
exactly those of a server whose pool never evicted them; the same small
server without the tier gives the same greedy tokens (its logprobs differ
in float rounding: it recomputes the histories in prefills of other
lengths); the metrics show the loads (host hits on the scheduler, bytes
on the worker)."""

from __future__ import annotations

import random

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.metrics import scrape
from tests.e2e.support.system import free_port, greedy, separate, stub

pytestmark = pytest.mark.slow

PAGE = 16
# 512 tokens: two conversations' histories (one held by the request before
# while its last plans are in flight, room to load the next), not four.
NUM_PAGES = 32
CONVERSATIONS = 4
TURNS = 3
NEW_TOKENS = 8


def _turns() -> list[tuple[int, list[int]]]:
    """(conversation, prompt) in the order sent: round-robin over the
    conversations, each prompt the conversation's whole history plus a new
    question (the history's answers are fixed tokens, not the model's, so
    both servers get the same prompts)."""
    rng = random.Random(11)
    histories = [
        [1 + c] + [rng.randrange(100, 40000) for _ in range(150)] for c in range(CONVERSATIONS)
    ]
    out = []
    for _ in range(TURNS):
        for c in range(CONVERSATIONS):
            histories[c] += [rng.randrange(100, 40000) for _ in range(20)]
            out.append((c, list(histories[c])))
            histories[c] += [rng.randrange(100, 40000) for _ in range(NEW_TOKENS)]
    return out


def _run(
    tmp_path, name: str, pages: int, tier: list[str]
) -> tuple[list[tuple[list[int], list[float]]], dict]:
    sched_metrics, worker_metrics = free_port(), free_port()
    worker = ["--model", "default", "--dequantize", "--num-pages", str(pages)]
    worker += ["--page-size", str(PAGE), "--threads", "1", "--log-level", "warning"]
    worker += ["--metrics-port", str(worker_metrics), *tier]
    scheduler = ["--metrics-port", str(sched_metrics), "--log-level", "warning"]
    scheduler += ["--no-speculative-ngram"]
    outputs = []
    workdir = tmp_path / name
    workdir.mkdir()
    with separate(workdir, worker, scheduler, env={"RADIXSERVE_CHECK_INTEGRITY": "1"}) as address:
        s = stub(address)
        for i, (c, prompt) in enumerate(_turns()):
            req = pb.GenerateRequest(
                request_id=f"{name}-{i}-c{c}",
                tokenized=pb.TokenizedInput(input_ids=prompt),
                sampling_params=greedy(NEW_TOKENS, ignore_eos=True),
                return_logprob=True,
                logprob_start_len=-1,  # output logprobs only (0 would score the whole prompt)
            )
            (resp,) = list(s.Generate(req, timeout=600))
            done = resp.complete
            outputs.append((list(done.output_ids), list(done.output_logprobs.token_logprobs)))
        metrics = scrape(sched_metrics) | scrape(worker_metrics)
    return outputs, metrics


def test_a_multi_turn_load_reads_its_evicted_histories_from_host_memory(tmp_path):
    roomy, _ = _run(tmp_path, "roomy", 8 * NUM_PAGES, [])
    tier = ["--enable-hierarchical-cache", "--hicache-ratio", "4"]
    on, on_metrics = _run(tmp_path, "on", NUM_PAGES, tier)
    off, off_metrics = _run(tmp_path, "off", NUM_PAGES, [])
    # Loaded pages are the bytes the first turn computed: the same tokens and
    # logprobs, exactly, as a pool so large that nothing left the device.
    assert on == roomy
    # Without the tier the histories are recomputed: the same greedy tokens;
    # the logprobs differ in float rounding only (a prefill of another length
    # rounds the recomputed KV differently), never in the host tier's copies.
    assert [tokens for tokens, _ in off] == [tokens for tokens, _ in on]
    for (_, lp_off), (_, lp_on) in zip(off, on, strict=True):
        assert max(abs(a - b) for a, b in zip(lp_off, lp_on, strict=True)) < 1e-4
    # Later turns found their history on the host and loaded it.
    loaded = on_metrics["radixserve_hicache_loaded_tokens_total"]
    assert loaded >= PAGE * 8, {k: v for k, v in on_metrics.items() if "cache" in k}
    assert on_metrics["radixserve_hicache_written_tokens_total"] > 0
    assert on_metrics["radixserve_worker_hicache_loaded_bytes_total"] > 0
    assert on_metrics["radixserve_worker_hicache_written_bytes_total"] > 0
    assert on_metrics["radixserve_worker_hicache_transfer_duration_seconds_count"] > 0
    assert on_metrics["radixserve_worker_hicache_host_pages_total"] == 4 * NUM_PAGES
    # ... so it computed fewer prompt tokens than the server that recomputed them.
    assert on_metrics["radixserve_cached_tokens_total"] >= loaded
    assert off_metrics["radixserve_cached_tokens_total"] < loaded
    assert off_metrics["radixserve_hicache_loaded_tokens_total"] == 0
