"""radixserve-bench's sampled mode on the wire: the temperature, top_p, top_k,
EOS handling and each request's seed reach the gRPC GenerateRequest
(custom_params seed) and the OpenAI JSON body, and --compare-openai sends
both sides the same prompts (as text to the peer, chat template included)
and seeds, fresh every repeat. Real servers on loopback ports that record
what they receive (tests/clients/support/bench_peers.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from clients.bench import cli
from tests.clients.support.bench_peers import (
    OUTPUT,
    RecordingScheduler,
    recording_openai,
    recording_scheduler,
    small_tokenizer,
)

SAMPLED = ("--temperature", "0.7", "--top-p", "0.9", "--top-k", "20")
TEXT = ("--dataset", "text", "--num-prompts", "4", "--text-input-len", "120")


@pytest.fixture
def scheduler():
    with recording_scheduler() as (address, servicer):
        yield address, servicer


@pytest.fixture
def peer(monkeypatch):
    # The peer's tokenizer would be the served model's, opened from disk; here
    # it is the recording scheduler's, as if both served the same model.
    monkeypatch.setattr(cli, "local_tokenizer", lambda model: small_tokenizer())
    with recording_openai() as (url, bodies):
        yield url, bodies


def _bench(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["--no-progress", "--warmup-requests", "1", *argv])
    got = capsys.readouterr()
    return code, got.out + got.err


def _measured(servicer) -> list:
    """The workload's requests (the warm-up's ids are bench--1, ...)."""
    return [r for r in servicer.requests if not r.request_id.startswith("bench--")]


def test_sampled_text_run_reaches_the_grpc_request(scheduler, capsys, tmp_path):
    address, servicer = scheduler
    saved = tmp_path / "prompts.jsonl"
    code, out = _bench(capsys, "--address", address, *TEXT, *SAMPLED, "--save-prompts", str(saved))
    assert code == 0, out
    assert "workload: text: prose of pydoc_data/topics.py" in out
    assert "sampled (temperature 0.7, top_p 0.9, top_k 20, a seed per request), EOS honoured" in out
    reqs = _measured(servicer)
    assert len(reqs) == 4
    seeds = []
    tok = small_tokenizer()
    lines = [json.loads(x) for x in saved.read_text().splitlines()]
    for r in reqs:
        sp = r.sampling_params
        assert sp.temperature == pytest.approx(0.7) and sp.top_p == pytest.approx(0.9)
        assert sp.top_k == 20 and sp.ignore_eos is False and sp.max_new_tokens == 128
        seeds.append(sp.custom_params["seed"])
        # The ids are the saved message through the chat template.
        text = tok.decode(list(r.tokenized.input_ids), skip_special_tokens=False)
        assert any(text == f"<|im_start|>user\n{x['prompt']}<|im_end|>\n<|im_start|>assistant\n"
                   for x in lines)  # fmt: skip
    assert len(set(seeds)) == 4 and all(s == int(s) and s >= 0 for s in seeds)
    # The same flags and seed: the same prompts and seeds again.
    first = {(tuple(r.tokenized.input_ids), r.sampling_params.custom_params["seed"]) for r in reqs}
    servicer.requests.clear()
    assert _bench(capsys, "--address", address, *TEXT, *SAMPLED)[0] == 0
    again = _measured(servicer)
    assert {(tuple(r.tokenized.input_ids), r.sampling_params.custom_params["seed"])
            for r in again} == first  # fmt: skip
    # Greedy (the old default) sends no seed.
    servicer.requests.clear()
    assert _bench(capsys, "--address", address, *TEXT, "--temperature", "0")[0] == 0
    for r in _measured(servicer):
        assert r.sampling_params.temperature == 0 and "seed" not in r.sampling_params.custom_params


def test_compare_openai_sends_the_peer_the_same_prompts_and_sampling(
    scheduler, peer, capsys, tmp_path
):
    address, servicer = scheduler
    url, bodies = peer
    report_path = tmp_path / "report.json"
    code, out = _bench(
        capsys, "--address", address, "--compare-openai", url, "--repeats", "2",
        "--num-prompts", "3", "--text-input-len", "160", "--text-output-len", "16",
        "--top-p", "0.95", "--seed", "40", "--output-json", str(report_path),
    )  # fmt: skip
    assert code == 0, out
    report = json.loads(report_path.read_text())
    assert report["seeds"] == [40, 41]
    assert report["workload"].startswith("text: prose of pydoc_data")
    assert "sampled (temperature 1, top_p 0.95, a seed per request), EOS honoured" in out
    assert report["results"]["peer"]["output_tokens"] == 3 * len(OUTPUT)
    tok = small_tokenizer()
    ours = _measured(servicer)
    theirs = [b for b in bodies if b.get("seed") is not None]  # the warm-up is unseeded
    assert len(ours) == len(theirs) == 6
    for b in bodies:
        assert b["model"] == "peer-model" and b["stream"] is True
    for b in theirs:
        assert b["temperature"] == 1.0 and b["top_p"] == 0.95 and b["ignore_eos"] is False
        assert b["max_tokens"] == 16 and "top_k" not in b
        assert b["prompt"].startswith("<|im_start|>user\n")
        assert b["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n")
    sent_ours = {
        (tok.decode(list(r.tokenized.input_ids), skip_special_tokens=False),
         int(r.sampling_params.custom_params["seed"]))
        for r in ours
    }  # fmt: skip
    sent_theirs = {(b["prompt"], b["seed"]) for b in theirs}
    assert sent_ours == sent_theirs
    # Fresh prompts every repeat: six different prompts, not three twice.
    assert len({p for p, _ in sent_theirs}) == 6
    for r in ours:
        sp = r.sampling_params
        assert sp.temperature == 1.0 and sp.top_p == pytest.approx(0.95)
        assert sp.top_k == -1 and not sp.ignore_eos and sp.max_new_tokens == 16


def test_prompts_only_writes_what_a_run_sends_and_sends_nothing(peer, capsys, tmp_path):
    url, bodies = peer
    common = ("--dataset", "text", "--num-prompts", "3", "--text-input-len", "160", "--seed", "9")
    saved = tmp_path / "chat.jsonl"
    code, out = _bench(
        capsys, "--backend", "openai", "--base-url", "http://127.0.0.1:9", *common,
        "--prompts-only", "--save-prompts", str(saved),
    )  # fmt: skip
    assert code == 0, out
    assert out.startswith("3 prompts, ")
    lines = [json.loads(x) for x in saved.read_text().splitlines()]
    assert len(lines) == 3 and {x["output_tokens"] for x in lines} == {128}
    # A run of the same flags sends exactly these messages (through the template).
    assert _bench(capsys, "--backend", "openai", "--base-url", url, *common)[0] == 0
    sent = {b["prompt"] for b in bodies if b["max_tokens"] == 128}
    assert sent == {
        f"<|im_start|>user\n{x['prompt']}<|im_end|>\n<|im_start|>assistant\n" for x in lines
    }
    with pytest.raises(SystemExit) as e:
        _bench(capsys, "--prompts-only", "--dataset", "text")
    assert e.value.code == 2
    assert "--prompts-only writes --save-prompts or --save-trace" in capsys.readouterr().err


def test_a_server_without_a_tokenizer_is_a_clear_error_for_text(capsys):
    class NoTokenizer(RecordingScheduler):
        def GetTokenizer(self, request, context):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the simulated model has none")

    with recording_scheduler(NoTokenizer()) as (address, servicer):
        code, out = _bench(capsys, "--address", address, *TEXT)
    assert code == 2
    assert (
        "the server sends no tokenizer (FAILED_PRECONDITION: the simulated model has none)" in out
    )
    assert not servicer.requests
