"""Embeddings of the default model (SmolLM2-135M-Instruct, float32 on the
CPU) through `radixserve serve`, equal to transformers' final hidden states
(``hidden_states[-1]``: the final norm's output) within 1e-4: last-token
pooling, normalized (the default for a model without a sentence-transformers
config, SGLang's), while a generation streams beside it, and through the SMG
gateway's POST /v1/embeddings; mean pooling, raw, over prompts split into
chunks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.openai_http import post
from tests.e2e.support.system import serve, stub
from tests.support.hf_reference import default_model_reference

pytestmark = pytest.mark.slow  # the default model and transformers

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors; similar texts land close together.",
    "Paris is the capital of France, and Berlin is the capital of Germany, which "
    "borders France to the east.",
]


def hf_hidden(ids: list[int]) -> torch.Tensor:
    _, model = default_model_reference()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()


def last_normalized(ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.normalize(hf_hidden(ids)[-1], dim=0)


def embed(s, ids: list[int]) -> torch.Tensor:
    r = s.Embed(pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=ids)))
    assert r.embedding_dim == 576 and r.prompt_tokens == len(ids)
    return torch.tensor(list(r.embedding))


def test_last_token_embeddings_beside_generation_equal_transformers(smollm2_address):
    tok, _ = default_model_reference()
    s = stub(smollm2_address)
    ids = [tok.encode(t) for t in TEXTS]
    gen = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=ids[2]),
        sampling_params=pb.SamplingParams(max_new_tokens=48, ignore_eos=True),
        stream=True,
    )
    with ThreadPoolExecutor(4) as pool:
        streaming = pool.submit(lambda: list(s.Generate(gen)))
        got = list(pool.map(lambda i: embed(s, i), ids))
        assert streaming.result()[-1].complete.completion_tokens == 48
    for i, vec in zip(ids, got, strict=True):
        assert (vec - last_normalized(i)).abs().max().item() < 1e-4
    again = embed(s, ids[2])  # its prefix is now cached: the last position is computed
    assert (again - got[2]).abs().max().item() < 1e-4


def test_post_v1_embeddings_through_the_gateway(gateway):
    base, model = gateway
    tok, _ = default_model_reference()
    out = post(base + "/v1/embeddings", {"model": model, "input": TEXTS[1]})
    (item,) = out["data"]
    vec = torch.tensor(item["embedding"])
    ids = tok.encode(TEXTS[1])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert (vec - last_normalized(ids)).abs().max().item() < 1e-4


def test_mean_pooling_over_chunked_prompts_equals_transformers(tmp_path):
    tok, _ = default_model_reference()
    args = ["--pooling", "mean", "--embed-normalize", "off", "--chunked-prefill-size", "16"]
    args += ["--dequantize"]  # compared with transformers' float weights
    with serve(tmp_path, *args, "--log-level", "warning") as address:
        s = stub(address)
        ids = [tok.encode(t) for t in TEXTS]
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda i: embed(s, i), ids))
        first = embed(s, ids[2])  # the same prompt again: computed whole, never from the cache
    for i, vec in zip(ids, got, strict=True):
        assert (vec - hf_hidden(i).mean(dim=0)).abs().max().item() < 1e-4
    assert (first - got[2]).abs().max().item() < 1e-4
