"""radixserve-bench's parts without a server: workloads, arrivals, figures,
the report, and the runner's concurrency cap (with an in-process driver)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import statistics

import numpy as np
import pytest

from clients.bench.cli import build_parser, check_args
from clients.bench.metrics import agreement, percentile, summarize, throughput_over_time
from clients.bench.records import BenchRequest, RequestRecord
from clients.bench.report import ratios, table
from clients.bench.runner import arrival_times, run_workload
from clients.bench.workloads import (
    WorkloadError,
    random_workload,
    read_trace,
    shared_prefix_workload,
    write_trace,
)


def test_shared_prefix_workload_groups_share_their_system_prompt():
    def workload(seed):
        return shared_prefix_workload(
            1000, seed, num_groups=3, prompts_per_group=4, system_prompt_len=20,
            question_len=5, output_len=7,
        )  # fmt: skip

    reqs = workload(3)
    assert len(reqs) == 12
    assert [r.index for r in reqs] == list(range(12))
    assert all(len(r.prompt_ids) == 25 and r.output_len == 7 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt_ids)
    for g in range(3):
        members = [r for r in reqs if r.group == g]
        assert len(members) == 4
        assert len({tuple(r.prompt_ids[:20]) for r in members}) == 1
        assert len({tuple(r.prompt_ids[20:]) for r in members}) == 4
    assert [r.prompt_ids for r in workload(3)] == [r.prompt_ids for r in reqs]
    assert [r.prompt_ids for r in workload(4)] != [r.prompt_ids for r in reqs]


def test_random_workload_lengths_lie_in_the_range():
    reqs = random_workload(500, 200, input_len=40, output_len=10, range_ratio=0.5, seed=2)
    ins = [len(r.prompt_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 20 and max(ins) <= 40 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 10
    fixed = random_workload(500, 10, input_len=8, output_len=3, range_ratio=1.0)
    assert {len(r.prompt_ids) for r in fixed} == {8} and {r.output_len for r in fixed} == {3}
    with pytest.raises(WorkloadError, match="range-ratio"):
        random_workload(500, 1, 8, 3, range_ratio=1.5)


def test_trace_round_trip_and_errors(tmp_path):
    reqs = random_workload(100, 5, 6, 4, 0.5, seed=1)
    for i, r in enumerate(reqs):
        r.arrival_s = 0.5 * i
    path = tmp_path / "t.jsonl"
    write_trace(path, reqs)
    back = read_trace(path, vocab=100)
    assert [(r.prompt_ids, r.output_len, r.arrival_s) for r in back] == [
        (r.prompt_ids, r.output_len, r.arrival_s) for r in reqs
    ]
    with pytest.raises(WorkloadError, match=r"t.jsonl:1: prompt_ids must lie in \[0, 50\)"):
        read_trace(path, vocab=50)
    bad = tmp_path / "bad.jsonl"
    cases = {
        "{not json": "2: not JSON",
        '{"prompt_ids": [], "output_len": 3}': "2: prompt_ids must be a non-empty list",
        '{"prompt_ids": [1, "a"], "output_len": 3}': "2: prompt_ids must be a non-empty list",
        '{"prompt_ids": [1], "output_len": 0}': "2: output_len must be a positive",
        '{"prompt_ids": [1], "output_len": 2, "timestamp": -1}': "2: timestamp must be",
        "[1, 2]": "2: a line must be a JSON object",
    }
    first = '{"prompt_ids": [1, 2], "output_len": 2}\n'
    for line, message in cases.items():
        bad.write_text(first + line + "\n")
        with pytest.raises(WorkloadError, match=message):
            read_trace(bad)
    bad.write_text(first + '{"prompt_ids": [1], "output_len": 2, "timestamp": 1.0}\n')
    with pytest.raises(WorkloadError, match="either every line has a timestamp or none"):
        read_trace(bad)
    bad.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_trace(bad)


def test_arrivals_poisson_all_at_once_and_replayed():
    reqs = [BenchRequest(i, [1], 1) for i in range(4000)]
    times = arrival_times(reqs, rate=20.0, seed=5, replay=False)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: sd = mean
    assert arrival_times(reqs[:3], math.inf, 0, False) == [0.0, 0.0, 0.0]
    stamped = [BenchRequest(i, [1], 1, arrival_s=s) for i, s in enumerate([3.0, 3.5, 5.0])]
    assert arrival_times(stamped, math.inf, 0, True) == [0.0, 0.5, 2.0]


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def record(index, start, times, prompt=10, cached=0, error=None, ids=()):
    return RequestRecord(index, prompt, start, list(times), cached, list(ids), error)


def test_summarize_figures():
    recs = [
        record(0, 0.0, [1.0, 1.5, 2.0], prompt=10, cached=0),
        record(1, 0.5, [2.5, 2.5, 3.5, 4.5], prompt=30, cached=20),  # 2 tokens in 1 message
        record(2, 0.0, [], prompt=50, cached=50, error="UNAVAILABLE: gone"),
    ]
    s = summarize(recs, duration_s=5.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_tokens"] == 7 and s["input_tokens"] == 40
    assert s["output_tokens_per_s"] == pytest.approx(7 / 5)
    assert s["request_throughput"] == pytest.approx(2 / 5)
    assert s["cache_hit_rate"] == pytest.approx(20 / 40)  # failed requests do not count
    assert s["ttft_ms"]["mean"] == pytest.approx(1500.0)  # 1.0 and 2.0 s
    assert s["ttft_ms"]["p50"] == pytest.approx(1500.0)
    assert s["e2e_ms"]["mean"] == pytest.approx((2.0 + 4.0) / 2 * 1e3)
    assert s["tpot_ms"]["mean"] == pytest.approx((0.5 + 2.0 / 3) / 2 * 1e3)
    assert s["itl_ms"]["p50"] == pytest.approx(750.0)  # gaps 0.5, 0.5, 1.0, 1.0
    assert s["errors"] == ["UNAVAILABLE: gone"]
    assert s["mean_concurrency"] == pytest.approx((2.0 + 4.0) / 5.0)


def test_throughput_over_time_keeps_every_token():
    recs = [record(0, 0.0, [0.1, 0.2, 0.9]), record(1, 0.0, [1.95, 2.0])]
    ends, rates = throughput_over_time(recs, 2.0, bins=4)
    assert ends == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert [r * 0.5 for r in rates] == pytest.approx([2, 1, 0, 2])


def test_agreement_and_ratios_and_table():
    a = [record(0, 0, [1, 2], ids=[5, 6]), record(1, 0, [1, 2], ids=[7, 8])]
    b = [record(0, 0, [1, 2], ids=[5, 6]), record(1, 0, [1, 2], ids=[7, 9])]
    assert agreement(a, b) == {"compared": 2, "identical": 0.5, "same_first_token": 1.0}
    fast = summarize([record(0, 0.0, [0.5, 1.0, 1.5, 2.0])], 2.0)
    slow = summarize([record(0, 0.0, [1.0, 2.0, 3.0, 4.0])], 4.0)
    r = ratios(fast, slow)
    assert r["output_tokens_per_s"] == pytest.approx(2.0)
    assert r["ttft_p50"] == pytest.approx(0.5)
    text = table({"radixserve": fast, "hf": slow}, r)
    lines = text.splitlines()
    assert lines[0].split() == ["figure", "radixserve", "hf", "ratio"]
    row = next(line for line in lines if line.startswith("output tokens/s"))
    assert row.split()[-3:] == ["2.0", "1.0", "2.00x"]
    assert "ratio" not in table({"radixserve": fast}).splitlines()[0]
    json.dumps(fast)  # the summary is plain JSON


class CountingDriver:
    """An in-process driver (no server): answers after a delay, counts how many
    requests are in flight, fails the requests whose prompt starts with 0."""

    name = "counting"

    def __init__(self) -> None:
        self.in_flight = 0
        self.most = 0

    async def send(self, req, rec, t0):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(0.01)
            if req.prompt_ids[0] == 0:
                raise RuntimeError("refused")
            rec.token_times.extend([0.0] * req.output_len)
        finally:
            self.in_flight -= 1


def test_runner_caps_concurrency_and_records_errors():
    reqs = [BenchRequest(i, [i % 5], 3) for i in range(40)]
    driver = CountingDriver()
    run = asyncio.run(run_workload(driver, reqs, max_concurrency=4, progress=False))
    assert driver.most == 4
    failed = [r for r in run.records if r.error]
    assert [r.index for r in failed] == [i for i in range(40) if i % 5 == 0]
    assert all(r.error == "RuntimeError: refused" for r in failed)
    assert all(r.output_tokens == 3 for r in run.records if not r.error)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "trace"], "--dataset trace needs --trace"),
        (["--request-rate", "0"], "--request-rate must be > 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--gsp-num-groups", "0"], "--gsp-num-groups must be at least 1"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    p = build_parser()
    with pytest.raises(SystemExit) as e:
        check_args(p, p.parse_args(argv))
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_json_report_is_strict_json():
    from clients.bench.cli import strict_json

    text = strict_json({"rate": math.inf, "hit": math.nan, "xs": [1.5, -math.inf], "n": 3})
    assert json.loads(text) == {"rate": None, "hit": None, "xs": [1.5, None], "n": 3}
    assert "Infinity" not in text and "NaN" not in text


def test_compare_medians_and_peer_arguments():
    import argparse
    import math

    from clients.bench.compare import median_summary, peer_args, ratio_ranges

    runs = [
        {"output_tokens_per_s": 10.0, "tpot_ms": {"p50": 5.0}, "errors": ["a"]},
        {"output_tokens_per_s": 30.0, "tpot_ms": {"p50": math.nan}, "errors": []},
        {"output_tokens_per_s": 20.0, "tpot_ms": {"p50": 7.0}, "errors": ["b"]},
    ]
    m = median_summary(runs)
    assert m == {"output_tokens_per_s": 20.0, "tpot_ms": {"p50": 6.0}, "errors": ["a", "b"]}
    args = argparse.Namespace(
        backend="radixserve",
        base_url=None,
        model=None,
        tokenizer=None,
        api_key="secret",
        save_trace="t.jsonl",
        compare_openai="http://127.0.0.1:8100",
        compare_model="m",
        compare_tokenizer=None,
    )
    peer = peer_args(args)
    assert (peer.backend, peer.base_url, peer.model, peer.tokenizer) == (
        "openai",
        "http://127.0.0.1:8100",
        "m",
        "default",
    )
    assert peer.api_key is None and peer.save_trace is None and args.backend == "radixserve"
    keys = ("output_tokens_per_s", "request_throughput", "ttft_p50", "tpot_p50", "e2e_p50")
    r = ratio_ranges([dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 2.0)])
    assert r["tpot_p50"] == [1.0, 2.0]


@pytest.mark.slow  # the default model's tokenizer
def test_quote_workload_asks_to_repeat_each_passage_in_chat_form():
    from clients.bench.cli import local_tokenizer
    from clients.bench.passages import PASSAGES
    from clients.bench.workloads import quote_workload

    tok = local_tokenizer("default")
    reqs = quote_workload(tok, 40, output_len=48, seed=5)
    assert [r.index for r in reqs] == list(range(40)) and {r.output_len for r in reqs} == {48}
    texts = [tok.decode(r.prompt_ids) for r in reqs]
    # Every passage appears, whole, in some prompt; the order follows the seed.
    assert all(any(p in t for t in texts) for p in PASSAGES)
    assert all(t.rstrip().endswith("assistant") for t in texts), texts[0][-40:]
    again = quote_workload(tok, 40, output_len=48, seed=5)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in reqs]
    other = quote_workload(tok, 40, output_len=48, seed=6)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in reqs]
    with pytest.raises(WorkloadError, match="quote-output-len"):
        quote_workload(tok, 1, output_len=0)


def test_summary_quotes_the_draft_acceptance_rate():
    recs = [
        RequestRecord(0, 10, 0.0, [0.1, 0.2], spec_draft_tokens=8, spec_accepted_tokens=6),
        RequestRecord(1, 10, 0.0, [0.1, 0.3], spec_draft_tokens=2, spec_accepted_tokens=0),
    ]
    s = summarize(recs, 1.0)
    assert (s["spec_draft_tokens"], s["spec_accepted_tokens"]) == (10, 6)
    assert s["spec_acceptance_rate"] == pytest.approx(0.6)
    assert math.isnan(summarize([RequestRecord(0, 1, 0.0, [0.1])], 1.0)["spec_acceptance_rate"])
    assert "draft acceptance rate" in table({"radixserve": s})


def test_compare_speculative_runs_alone_against_radixserve():
    p = build_parser()
    args = p.parse_args(["--compare-speculative", "--dataset", "quote"])
    check_args(p, args)
    from clients.bench.compare import speculation_off_args

    off = speculation_off_args(args)
    assert off.speculative is False and not hasattr(args, "speculative")
    for extra in (["--baseline", "hf"], ["--backend", "openai"], ["--compare-openai", "x"]):
        with pytest.raises(SystemExit):
            check_args(p, p.parse_args(["--compare-speculative", *extra]))
