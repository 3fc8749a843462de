"""The default model, SmolLM2-135M-Instruct from its GGUF, against transformers
loading the same file: greedy tokens and logprobs, and the tokenizer the
worker serves over gRPC."""

from __future__ import annotations

import hashlib
import io
import zipfile

import grpc
import pytest
from transformers import AutoTokenizer

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.support.hf_reference import chat_ids, default_model_reference, hf_greedy
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from worker_service.config import WorkerConfig
from worker_service.rpc.server import serve
from worker_service.worker import build_worker

# Out of make test-fast: the default model against transformers.
pytestmark = pytest.mark.slow

STEPS = 32
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
    "Describe the city of Paris to someone who has never been there.",
]


@pytest.fixture(scope="module")
def hf():
    return default_model_reference()


@pytest.fixture(scope="module")
def worker():
    # The float path: compared with transformers to 1e-4.
    return build_worker(WorkerConfig(model="default", page_size=16, num_pages=256, dequantize=True))


def test_greedy_tokens_and_logprobs_match_transformers(hf, worker):
    tok, model = hf
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    reqs = [
        DriverRequest(prompts[0], STEPS, arrive=0),
        DriverRequest(prompts[1], STEPS, arrive=2, share_from=0),  # shared system prompt
        DriverRequest(prompts[2], STEPS, arrive=5, share_from=0),
    ]
    PlanDriver(worker.runner, 16, chunk=24).run(reqs)
    for r in reqs:
        tokens, logprobs = hf_greedy(model, r.prompt, STEPS)
        assert r.outputs == tokens, (tok.decode(r.outputs), tok.decode(tokens))
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < 1e-4
    assert "Paris" in tok.decode(reqs[2].outputs)


def test_tokenizer_served_over_grpc_matches_the_gguf_tokenizer(hf, worker, tmp_path):
    tok, _ = hf
    server, port = serve(worker)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        chunks = list(worker_pb2_grpc.WorkerStub(channel).GetTokenizer(pb.GetTokenizerRequest()))
        channel.close()
    finally:
        server.stop(0)
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp_path)
    served = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["Hello, world!", "naïve café 日本語 🤖", "def f(x):\n    return x ** 2"]:
        assert served.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "Hi there"}]
    assert served.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(
        messages, tokenize=False
    )
    assert served.eos_token_id == 2
