"""radixserve-bench against running servers: the simulated-worker system
(fast: every dataset, arrival mode and output; the real-text datasets through
`radixserve serve --model simulated` with the default model's tokenizer), the
real default model with the Hugging Face baseline in the same invocation, and
the SMG gateway's OpenAI API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clients.bench.text_workloads import QUESTIONS
from tests.e2e.support.sim_server import VOCAB, simulated_server
from tests.e2e.support.system import serve_process

BENCH = [sys.executable, "-m", "clients.bench.cli"]
PNG = b"\x89PNG\r\n\x1a\n"


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*BENCH, "--no-progress", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def sim_address(tmp_path_factory):
    with simulated_server(tmp_path_factory.mktemp("sim"), num_pages=512, page_size=4) as addr:
        yield addr


def test_shared_prefix_report_json_and_plots(sim_address, tmp_path):
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    r = bench(
        "--address", sim_address, "--dataset", "generated-shared-prefix",
        "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
        "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "6",
        "--max-concurrency", "1", "--output-json", str(out), "--plots-dir", str(plots),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "output tokens/s" in r.stdout and "TTFT p99 (ms)" in r.stdout
    report = json.loads(out.read_text())
    s = report["results"]["radixserve"]
    assert (s["completed"], s["failed"]) == (12, 0)
    assert s["output_tokens"] == 12 * 6 and s["input_tokens"] == 12 * 72
    # One at a time: each group's later prompts find its 64-token system
    # prompt cached (whole pages of 4), the first ones find nothing.
    assert s["cached_tokens"] >= 3 * 3 * 64
    assert s["cache_hit_rate"] == pytest.approx(s["cached_tokens"] / s["input_tokens"])
    assert s["mean_concurrency"] <= 1.01
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], key
    assert s["e2e_ms"]["p50"] > s["ttft_ms"]["p50"]
    for name in ("latency_cdf.png", "throughput.png"):
        assert (plots / name).read_bytes()[:8] == PNG
        assert (plots / name).stat().st_size > 10_000
    assert json.loads(r.stdout.strip().splitlines()[-1])["results"]["radixserve"]["completed"] == 12


def test_random_dataset_at_a_poisson_rate_then_replayed_from_its_trace(sim_address, tmp_path):
    trace = tmp_path / "trace.jsonl"
    out = tmp_path / "a.json"
    r = bench(
        "--address", sim_address, "--dataset", "random", "--num-prompts", "30",
        "--random-input-len", "40", "--random-output-len", "10", "--random-range-ratio", "0.5",
        "--request-rate", "40", "--save-trace", str(trace), "--output-json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert len(lines) == 30 and all(0 <= t < VOCAB for x in lines for t in x["prompt_ids"])
    expected_out = sum(x["output_len"] for x in lines)
    assert json.loads(out.read_text())["results"]["radixserve"]["output_tokens"] == expected_out
    # 30 requests at 40/s take about 0.75 s to arrive: the run cannot be shorter.
    assert json.loads(out.read_text())["results"]["radixserve"]["duration_s"] > 0.3

    # Replay with timestamps 0.2 s apart: the replay lasts at least 29 * 0.2 s.
    stamped = tmp_path / "stamped.jsonl"
    stamped.write_text(
        "".join(json.dumps({**x, "timestamp": 0.2 * i}) + "\n" for i, x in enumerate(lines))
    )
    out2 = tmp_path / "b.json"
    r = bench("--address", sim_address, "--trace", str(stamped), "--output-json", str(out2))
    assert r.returncode == 0, r.stderr
    s = json.loads(out2.read_text())["results"]["radixserve"]
    assert s["completed"] == 30 and s["output_tokens"] == expected_out
    assert s["duration_s"] >= 29 * 0.2
    assert s["mean_concurrency"] < 3  # sent one by one, not all at once


def test_compare_speculative_alternates_with_drafts_off_and_flushes_the_cache(
    sim_address, tmp_path
):
    def run(*extra: str) -> dict:
        out = tmp_path / "spec.json"
        r = bench(
            "--address", sim_address, "--dataset", "random", "--num-prompts", "6",
            "--random-input-len", "20", "--random-output-len", "24", "--random-range-ratio", "1",
            "--max-concurrency", "2", "--compare-speculative", "--repeats", "2",
            "--output-json", str(out), *extra,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "speculative decoding off" in r.stdout
        return json.loads(out.read_text())

    report = run("--flush-cache")
    ours, off = report["repeats"]["radixserve"], report["repeats"]["peer"]
    assert [s["completed"] for s in ours + off] == [6] * 4
    assert all(s["spec_draft_tokens"] == 0 for s in off)
    # Flushed: the simulated model's text never repeats, so drafts rarely land.
    assert all(s["spec_accepted_tokens"] < 0.5 * s["output_tokens"] for s in ours)
    # Not flushed: the second repeat runs after the drafts-off side answered the
    # same prompts, and drafts those cached answers.
    report = run()
    second = report["repeats"]["radixserve"][1]
    assert second["spec_accepted_tokens"] >= 0.5 * second["output_tokens"], second


def test_bad_traces_and_unreachable_servers_give_clear_errors(sim_address, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2], "output_len": 2}\n{"prompt_ids": [99999999]}\n')
    r = bench("--address", sim_address, "--trace", str(bad))
    assert r.returncode == 2
    assert f"{bad}:2: prompt_ids must lie in [0, {VOCAB})" in r.stderr
    r = bench("--address", sim_address, "--trace", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "missing.jsonl" in r.stderr


@pytest.fixture(scope="module")
def sim_text_address(tmp_path_factory, tokenizer_dir):
    """`radixserve serve --model simulated` that serves the default model's
    tokenizer (every simulated token has a text)."""
    env = {"RADIXSERVE_WORKER_SIMULATED_VOCAB": "49152"}
    args = ("--model", "simulated", "--tokenizer", str(tokenizer_dir), "--log-level", "warning")
    with serve_process(tmp_path_factory.mktemp("serve"), *args, env=env) as (_, address):
        yield address


def test_sampled_real_text_then_the_same_prompts_as_vllm_custom_jsonl(sim_text_address, tmp_path):
    saved, out = tmp_path / "prompts.jsonl", tmp_path / "text.json"
    r = bench(
        "--address", sim_text_address, "--dataset", "text", "--num-prompts", "8",
        "--text-input-len", "160", "--text-output-len", "12", "--temperature", "0.8",
        "--top-p", "0.95", "--max-concurrency", "4", "--seed", "3",
        "--save-prompts", str(saved), "--output-json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "workload: text: prose of pydoc_data/topics.py" in r.stdout
    assert "sampled (temperature 0.8, top_p 0.95, a seed per request), EOS honoured" in r.stdout
    s = json.loads(out.read_text())["results"]["radixserve"]
    assert (s["completed"], s["failed"]) == (8, 0), s["errors"]
    assert 8 <= s["output_tokens"] <= 8 * 12
    # The server's own count of the prompts: within the budget, and real
    # prose (each at least half of its drawn budget, the budgets >= 80).
    assert 8 * 40 <= s["input_tokens"] <= 8 * 160
    lines = [json.loads(x) for x in saved.read_text().splitlines()]
    assert len(lines) == 8 and {x["output_tokens"] for x in lines} == {12}
    assert all(x["prompt"].rpartition("\n\n")[2] in QUESTIONS for x in lines)

    # The saved prompts as a jsonl dataset (vLLM's custom shape), EOS ignored:
    # the same prompts, so the same prompt tokens, and every output token.
    out2 = tmp_path / "jsonl.json"
    r = bench(
        "--address", sim_text_address, "--dataset", "jsonl", "--dataset-path", str(saved),
        "--temperature", "0.8", "--ignore-eos", "--max-concurrency", "4",
        "--output-json", str(out2),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    s2 = json.loads(out2.read_text())["results"]["radixserve"]
    assert (s2["completed"], s2["output_tokens"]) == (8, 8 * 12)
    assert s2["input_tokens"] == s["input_tokens"]


def test_smollm2_with_the_hf_baseline_in_the_same_run(smollm2_address, tmp_path):
    out = tmp_path / "report.json"
    r = bench(
        "--address", smollm2_address,
        "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
        "--gsp-system-prompt-len", "96", "--gsp-question-len", "8", "--gsp-output-len", "6",
        "--max-concurrency", "3", "--baseline", "hf", "--output-json", str(out),
        "--plots-dir", str(tmp_path / "plots"),
        timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    header = r.stdout.splitlines()[0].split()
    assert header == ["figure", "radixserve", "hf", "ratio"]
    report = json.loads(out.read_text())
    ours, hf = report["results"]["radixserve"], report["results"]["hf"]
    assert ours["completed"] == hf["completed"] == 6
    assert ours["output_tokens"] == hf["output_tokens"] == 36
    assert hf["cache_hit_rate"] == 0 and ours["cached_tokens"] > 0
    assert report["baseline"]["batch_size"] == 3
    assert report["ratios"]["output_tokens_per_s"] == pytest.approx(
        ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
    )
    # Both greedy on the same weights in fp32: the same tokens.
    assert report["agreement"]["compared"] == 6
    assert report["agreement"]["same_first_token"] == 1.0
    assert report["agreement"]["identical"] >= 5 / 6
    assert "greedy outputs identical to the baseline's" in r.stdout
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:8] == PNG


def test_multiturn_chat_on_the_default_model_reads_each_history_from_the_cache(
    smollm2_address, tmp_path
):
    """Two conversations of three turns on the real model: every turn after
    the first finds its history (the earlier prompts and the model's own
    answers, as token ids) in the prefix cache, the pool being far larger."""
    out = tmp_path / "mt.json"
    r = bench(
        "--address", smollm2_address, "--dataset", "multiturn",
        "--mt-conversations", "2", "--mt-turns", "3", "--mt-question-len", "48",
        "--mt-output-len", "6", "--mt-system-prompt-len", "64", "--mt-think-time-s", "0.05",
        "--ignore-eos", "--flush-cache", "--output-json", str(out),
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "turns completed 6/6, conversations completed 2/2" in r.stdout
    s = json.loads(out.read_text())["results"]["radixserve"]
    assert (s["completed"], s["output_tokens"]) == (6, 36)
    # Turn t reads turn t - 1's prompt and answer (all but a partial page):
    # well over half of all prompt tokens are cached.
    assert s["cache_hit_rate"] > 0.5, s
    assert s["prefill_tokens"] == s["input_tokens"] - s["cached_tokens"]
    assert s["device_pool_tokens"] > s["working_set_tokens"] > s["input_tokens"] / 3
    assert s["working_set_over_pool"] == pytest.approx(
        s["working_set_tokens"] / s["device_pool_tokens"]
    )


def test_openai_backend_through_the_gateway(gateway, tmp_path):
    base, model = gateway
    out = tmp_path / "report.json"
    r = bench(
        "--backend", "openai", "--base-url", base, "--dataset", "random",
        "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "5",
        "--random-range-ratio", "1", "--max-concurrency", "3", "--output-json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].split() == ["figure", "openai"]  # no log lines on stdout
    s = json.loads(out.read_text())["results"]["openai"]
    assert s["completed"] == 6 and s["output_tokens"] == 30  # from the usage blocks
    assert s["input_tokens"] > 0 and s["ttft_ms"]["p50"] > 0
    assert json.loads(out.read_text())["config"]["model"] is None  # found via /v1/models
    assert model


def test_module_runs_as_the_console_script():
    script = Path(sys.executable).parent / "radixserve-bench"
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--baseline" in r.stdout


def test_mixed_streams_and_long_prompts(sim_text_address, tmp_path):
    out = tmp_path / "mixed.json"
    r = bench(
        "--address", sim_text_address, "--dataset", "mixed", "--mixed-streams", "2",
        "--mixed-stream-output", "24", "--mixed-long-len", "200", "--mixed-long-output", "4",
        "--mixed-long-rate", "3", "--mixed-duration", "3", "--seed", "5",
        "--output-json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "workload: mixed: 2 streams of 24 tokens" in r.stdout
    assert "streams: ITL p50" in r.stdout
    s = json.loads(out.read_text())["results"]["radixserve"]
    m = s["mixed"]
    assert m["errors"] == 0 and s["failed"] == 0
    assert m["streams_completed"] >= 2 and m["long_prompts_completed"] >= 1
    # Every stream gives all its tokens (EOS ignored), every long prompt its 4.
    assert s["output_tokens"] == 24 * m["streams_completed"] + 4 * m["long_prompts_completed"]
    assert m["long_ttft_p50_ms"] > 0 and m["stream_itl_p50_ms"] > 0
