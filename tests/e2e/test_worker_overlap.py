"""A worker that queues step N+1 before waiting for step N's tokens
(``--overlap on``; on by default on CUDA only) behind a real scheduler: the
default model's greedy outputs, with logprobs, for concurrent streams equal
transformers'."""

from __future__ import annotations

import threading

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import greedy, separate, stub
from tests.support.hf_reference import chat_ids, default_model_reference, greedy_with_logprobs

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours of the rainbow.",
    "Count from one to five.",
]
STEPS = 20


@pytest.mark.slow
def test_overlapped_worker_matches_transformers(tmp_path):
    tok, model = default_model_reference()
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    worker = ["--model", "default", "--overlap", "on", "--threads", "1", "--log-level", "warning"]
    worker += ["--dequantize"]  # compared with transformers' float weights
    with separate(tmp_path, worker, ["--log-level", "warning"]) as address:
        s = stub(address)
        outputs: dict[int, tuple[list[int], list[float]]] = {}

        def run(i: int) -> None:
            req = pb.GenerateRequest(
                request_id=f"q{i}",
                tokenized=pb.TokenizedInput(input_ids=prompts[i]),
                sampling_params=greedy(STEPS, ignore_eos=True),
                return_logprob=True,
                logprob_start_len=-1,
            )
            (done,) = list(s.Generate(req, timeout=300))
            lps = list(done.complete.output_logprobs.token_logprobs)
            outputs[i] = (list(done.complete.output_ids), lps)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    for i, ids in enumerate(prompts):
        ref_tokens, ref_logprobs = greedy_with_logprobs(model, ids, STEPS)
        tokens, logprobs = outputs[i]
        assert tokens == ref_tokens, QUESTIONS[i]
        for token, got, ref in zip(tokens, logprobs, ref_logprobs, strict=True):
            assert abs(got - ref[token].item()) < 1e-3
