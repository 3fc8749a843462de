"""Rerank through a real `radixserve serve` of a sequence classifier: a tiny
random-init LlamaForSequenceClassification (one label, its config declaring
a sigmoid for cross-encoder scores: tests/support/tiny_classifier.py) built
and saved here, scored over gRPC against transformers'
AutoModelForSequenceClassification on the same checkpoint.

What this proves: the wiring and the arithmetic. A rerank request
(``is_cross_encoder``) scores its [query, document] pair through the
tokenizer's pair template (``texts``) or as the client tokenized it, equal to
sigmoid(transformers' logit) within 1e-4, batched, chunked and from a cached
prefix; a plain Embed gets the raw logit (SGLang's classifier output); the
model says it is no generator and refuses to generate. What it does not:
anything about a trained reranker's rankings (this one is random).

The SMG gateway (1.13) answers POST /v1/rerank itself with 501 "Rerank not
implemented" for gRPC workers (its gRPC router has no rerank route, so it
never calls Embed); its POST /v1/embeddings reaches the classifier.
"""

from __future__ import annotations

import json
import time
import types
import urllib.error
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.openai_http import post
from tests.e2e.support.smg_gateway import start_gateway
from tests.e2e.support.system import serve, stub
from tests.support.tiny_classifier import (
    SIGMOID,
    build_classifier,
    hf_logits,
    save_tokenizer,
    sigmoid,
)

QUERY = "what is the capital of france"
DOCUMENTS = [
    "paris",
    "berlin is a city in germany",
    "rome is a city in italy and the river is blue",
    "fish swim in the river seine in paris in france",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rerank")
    hf = build_classifier(tmp / "model", activation=SIGMOID)
    tok = save_tokenizer(tmp / "model")
    args = ["--model", str(tmp / "model"), "--served-model-name", "rr", "--worker-threads", "1"]
    args += ["--chunked-prefill-size", "8", "--page-size", "4", "--log-level", "warning"]
    with serve(tmp, *args) as address:
        yield types.SimpleNamespace(tmp=tmp, hf=hf, tok=tok, address=address)


def rerank(s, document: str) -> pb.EmbedResponse:
    return s.Embed(pb.EmbedRequest(is_cross_encoder=True, texts=[QUERY, document]))


def test_rerank_scores_equal_transformers(served):
    s = stub(served.address)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda d: rerank(s, d), DOCUMENTS))
    wanted = []
    for document, r in zip(DOCUMENTS, got, strict=True):
        ids = served.tok(QUERY, document)["input_ids"]  # SGLang's tokenizer(query, document)
        (logit,) = hf_logits(served.hf, ids)
        wanted.append(sigmoid(logit))
        assert (r.embedding_dim, r.prompt_tokens) == (1, len(ids))
        assert abs(r.embedding[0] - sigmoid(logit)) < 1e-4, (document, r.embedding[0], logit)
        tokenized = pb.EmbedRequest(
            is_cross_encoder=True, tokenized=pb.TokenizedInput(input_ids=ids)
        )
        # The same pair tokenized by the client (its prefix now cached): the same score.
        assert abs(s.Embed(tokenized).embedding[0] - r.embedding[0]) < 1e-5
        # A plain embedding of a classifier is its raw logit (SGLang's score_and_pool).
        plain = s.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids)))
        assert abs(plain.embedding[0] - logit) < 1e-4
    assert max(wanted) - min(wanted) > 0.05  # the scores differ: the document matters


def test_a_classifier_says_what_it_is_and_does_not_generate(served):
    s = stub(served.address)
    info = s.GetModelInfo(pb.GetModelInfoRequest())
    assert not info.is_generation and info.num_labels == 1
    assert json.loads(info.id2label_json) == {"0": "LABEL_0"}
    assert info.architectures == ["LlamaForSequenceClassification"]
    assert s.HealthCheck(pb.HealthCheckRequest()).healthy
    request = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[1, 4, 5]),
        sampling_params=pb.SamplingParams(max_new_tokens=2),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(s.Generate(request))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence classifier" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        s.Embed(pb.EmbedRequest(is_cross_encoder=True, texts=[QUERY, "paris", "rome"]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "one pair" in e.value.details()


def test_through_the_gateway_embeddings_reach_it_and_rerank_is_the_gateways_501(served):
    proc, base = start_gateway(served.tmp, [served], probe_chat=False)
    try:
        ids = served.tok(QUERY)["input_ids"]
        deadline = time.monotonic() + 60
        while True:  # the gateway fetches the tokenizer after it lists the model
            try:
                out = post(base + "/v1/embeddings", {"model": "rr", "input": QUERY})
                break
            except urllib.error.HTTPError:
                assert time.monotonic() < deadline, (served.tmp / "smg.log").read_text()
                time.sleep(0.3)
        assert out["usage"]["prompt_tokens"] == len(ids)
        assert abs(out["data"][0]["embedding"][0] - hf_logits(served.hf, ids)[0]) < 1e-4
        with pytest.raises(urllib.error.HTTPError) as e:
            post(base + "/v1/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS})
        # If this starts to pass through, the gateway forwards rerank: test it end to end.
        assert e.value.code == 501 and b"Rerank not implemented" in e.value.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
