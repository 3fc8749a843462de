"""Speculative decoding end to end on the real default model: outputs with
drafts are exactly those without (greedy, seeded sampling, logprobs), through
the public API, with cache hits, chunked prefill and a worker SIGKILL; the
quoting prompts make the drafts land (spec_accepted_tokens > 0)."""

from __future__ import annotations

import asyncio
import math

import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from clients.bench.passages import PASSAGES
from tests.e2e.support.streams import run_streams, wait_for_progress
from tests.e2e.support.system import BIN, free_port, greedy, process, stub, worker_on_port
from tests.support.hf_reference import chat_ids, default_model_reference, greedy_with_logprobs


def quote(tok, i: int) -> list[int]:
    return chat_ids(tok, f"Repeat the following passage exactly, word for word:\n\n{PASSAGES[i]}")


def with_speculation(sampling: pb.SamplingParams, on: bool) -> pb.SamplingParams:
    if not on:
        params = Struct()
        params.update({**dict(sampling.custom_params), "speculative": False})
        sampling.custom_params.CopyFrom(params)
    return sampling


def run(s, ids, sampling, rid: str, **kw) -> pb.GenerateComplete:
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sampling, **kw
    )
    (r,) = list(s.Generate(req, timeout=180))
    return r.complete


@pytest.fixture(scope="module")
def hf():
    return default_model_reference()


def test_greedy_quotes_are_identical_with_and_without_drafts_and_match_transformers(
    hf, smollm2_address
):
    tok, model = hf
    s = stub(smollm2_address)
    accepted = 0
    for i in (0, 3):
        ids = quote(tok, i)
        off = run(s, ids, with_speculation(greedy(48, ignore_eos=True), False), f"off{i}")
        on = run(s, ids, greedy(48, ignore_eos=True), f"on{i}")
        assert (off.spec_draft_tokens, off.spec_accepted_tokens) == (0, 0)
        assert list(on.output_ids) == list(off.output_ids)
        ref, _ = greedy_with_logprobs(model, ids, 48)
        assert list(on.output_ids) == ref
        assert 0 <= on.spec_accepted_tokens <= on.spec_draft_tokens
        accepted += on.spec_accepted_tokens
    assert accepted > 0, "no draft was accepted on a quoting prompt"


def test_a_repeated_prompt_is_drafted_from_the_cached_answer(hf, smollm2_address):
    tok, _ = hf
    s = stub(smollm2_address)
    ids = quote(tok, 5)
    first = run(s, ids, greedy(40, ignore_eos=True), "rep-a")
    second = run(s, ids, greedy(40, ignore_eos=True), "rep-b")
    assert list(second.output_ids) == list(first.output_ids)
    assert second.cached_tokens > 0
    # The first answer is in the radix cache as far as its full pages reach
    # (page size 16 on CPU: 155 tokens, 144 cached, 29 of them the answer's):
    # those are the drafts, and they are right.
    drafted, accepted = second.spec_draft_tokens, second.spec_accepted_tokens
    assert accepted >= 24 and accepted >= 0.8 * drafted, (drafted, accepted)


def test_seeded_sampling_and_logprobs_are_identical_with_and_without_drafts(hf, smollm2_address):
    tok, _ = hf
    s = stub(smollm2_address)
    ids = quote(tok, 1)
    for seed in (3, 11):
        params = Struct()
        params.update({"seed": seed})
        outs = []
        for on in (False, True):
            sampling = pb.SamplingParams(
                temperature=0.8, top_p=0.95, max_new_tokens=32, ignore_eos=True,
                custom_params=params, frequency_penalty=0.3,
            )  # fmt: skip
            outs.append(
                run(
                    s,
                    ids,
                    with_speculation(sampling, on),
                    f"seed{seed}{on}",
                    return_logprob=True,
                    top_logprobs_num=3,
                )
            )
        off, on = outs
        assert list(on.output_ids) == list(off.output_ids)
        a, b = off.output_logprobs, on.output_logprobs
        assert list(a.token_ids) == list(b.token_ids)
        for x, y in zip(a.token_logprobs, b.token_logprobs, strict=True):
            assert math.isclose(x, y, abs_tol=2e-3), (x, y)
        for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert list(x.token_ids) == list(y.token_ids)


@pytest.mark.slow
def test_chunked_prompts_and_a_worker_sigkill_keep_outputs_identical(hf, tmp_path):
    """Small prefill chunks, and the worker killed while drafted streams decode:
    the resumed streams equal an undisturbed run without drafts."""
    tok, _ = hf
    port = free_port()
    worker_args = ["--model", "default", "--log-level", "warning", "--dequantize"]
    sched = [str(BIN / "radixserve-scheduler"), "--worker", f"grpc://127.0.0.1:{port}"]
    sched += ["--log-level", "info", "--worker-recovery-timeout", "120"]
    sched += ["--chunked-prefill-size", "32"]

    def reqs(prefix: str, on: bool) -> list[pb.GenerateRequest]:
        return [
            pb.GenerateRequest(
                request_id=f"{prefix}{i}",
                tokenized=pb.TokenizedInput(input_ids=quote(tok, i)),
                sampling_params=with_speculation(greedy(64, ignore_eos=True), on),
                stream=True,
            )
            for i in range(4)
        ]

    holder: dict = {}
    with worker_on_port(tmp_path, port, worker_args, "worker") as proc:
        holder["proc"] = proc
        with process(tmp_path, "scheduler", sched) as sport:
            address = f"127.0.0.1:{sport}"
            baseline = asyncio.run(run_streams(address, reqs("base", False)))

            async def kill_and_restart(progress: list[int]) -> None:
                await wait_for_progress(progress, 4, tokens=8)
                holder["proc"].kill()
                holder["proc"].wait()
                holder["at_kill"] = list(progress)
                holder["restart"] = worker_on_port(tmp_path, port, worker_args, "worker2")
                await asyncio.to_thread(holder["restart"].__enter__)

            try:
                results = asyncio.run(run_streams(address, reqs("spec", True), kill_and_restart))
            finally:
                if "restart" in holder:
                    holder["restart"].__exit__(None, None, None)
    assert any(n < 64 for n in holder["at_kill"]), holder["at_kill"]
    for (tokens, reason), (base, base_reason) in zip(results, baseline, strict=True):
        assert (reason, base_reason) == ("length", "length")
        assert tokens == base
    log = (tmp_path / "scheduler.log").read_text()
    assert "worker group lost" in log and "worker group back" in log
