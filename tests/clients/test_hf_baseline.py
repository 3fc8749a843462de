"""The HF baseline runs the benchmark's requests through transformers generate
and records them like the server driver does."""

from __future__ import annotations

import random

import pytest

from clients.bench.hf_baseline import BaselineRun, load_hf_model, run_hf_baseline
from clients.bench.records import BenchRequest
from tests.support.hf_reference import hf_greedy

VOCAB = 49152


@pytest.fixture(scope="module")
def loaded():
    return load_hf_model("default")


@pytest.fixture(scope="module")
def requests() -> list[BenchRequest]:
    rng = random.Random(7)
    return [
        BenchRequest(i, [rng.randrange(VOCAB) for _ in range(n)], out)
        for i, (n, out) in enumerate([(5, 4), (9, 3), (12, 5)])
    ]


@pytest.fixture(scope="module")
def run(loaded, requests) -> BaselineRun:
    return run_hf_baseline(requests, batch_size=2, progress=False, loaded=loaded)


@pytest.mark.slow  # loads the default model in transformers
def test_records_have_each_request_length_and_ordered_times(run, requests):
    assert (run.batch_size, run.device, run.dtype) == (2, "cpu", "float32")
    assert [r.index for r in run.records] == [0, 1, 2]
    for rec, req in zip(run.records, requests, strict=True):
        assert rec.ok
        assert rec.output_tokens == req.output_len == len(rec.output_ids)
        assert rec.prompt_tokens == len(req.prompt_ids)
        assert rec.cached_tokens == 0
        assert rec.token_times[0] > rec.start_s
        assert all(b > a for a, b in zip(rec.token_times, rec.token_times[1:], strict=False))
    first, second, third = run.records
    assert 0.0 <= first.start_s == second.start_s < first.token_times[0]
    # the second batch starts when the first is done (its longest row: 4 steps)
    assert third.start_s >= first.token_times[-1] >= second.token_times[-1]
    # rows of a batch share the batch's step clock
    assert second.token_times == first.token_times[:3]
    assert run.duration_s >= third.token_times[-1]


@pytest.mark.slow  # loads the default model in transformers
def test_batched_greedy_matches_unbatched(run, requests, loaded):
    model, _ = loaded
    for rec, req in zip(run.records, requests, strict=True):
        expected, _ = hf_greedy(model, req.prompt_ids, req.output_len)
        assert rec.output_ids == expected


@pytest.mark.slow  # loads the default model in transformers
def test_out_of_vocab_prompt_is_refused(loaded):
    bad = [BenchRequest(0, [1, 2, VOCAB], 2)]
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        run_hf_baseline(bad, progress=False, loaded=loaded)


def test_random_model_is_refused():
    with pytest.raises(ValueError, match="random weights"):
        load_hf_model("random:llama-1b")
