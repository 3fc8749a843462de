"""Embed through the real processes with the simulated model: vectors equal
the simulated model's (``simulated_embedding``) for last-token and mean
pooling, while Generate streams run beside them in the same steps; rerank and
the other fields we cannot honour are refused by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.simulated_model import SIMULATED_HIDDEN, simulated_embedding
from tests.e2e.support.sim_server import snapshot
from tests.e2e.support.system import separate, stub, wait_until

WORKER = ["--model", "simulated", "--simulated-step-ms", "2", "--page-size", "4"]
WORKER += ["--num-pages", "256", "--log-level", "warning"]
SCHEDULER = ["--log-level", "warning", "--chunked-prefill-size", "8"]


def embed(s, rid: str, prompt: list[int]) -> pb.EmbedResponse:
    return s.Embed(pb.EmbedRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=prompt)))


def generate(s, rid: str, prompt: list[int]) -> int:
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=pb.SamplingParams(max_new_tokens=40, ignore_eos=True),
        stream=True,
    )
    return sum(len(r.chunk.token_ids) for r in s.Generate(req) if r.HasField("chunk"))


@pytest.mark.parametrize(
    ("pooling", "normalize"), [("last", True), ("mean", False)], ids=["last", "mean-raw"]
)
def test_embeddings_beside_generation_are_the_models(tmp_path, pooling, normalize):
    flags = ["--pooling", pooling, "--embed-normalize", "on" if normalize else "off"]
    with separate(tmp_path, WORKER + flags, SCHEDULER) as addr:
        s = stub(addr)
        shared = list(range(100, 124))  # page-aligned: a cache hit for "last"
        prompts = [shared + [7, 8, i] for i in range(6)] + [[3] * 30, [9]]
        with ThreadPoolExecutor(12) as pool:
            gens = [pool.submit(generate, s, f"g{i}", shared + [i]) for i in range(3)]
            embeds = [pool.submit(embed, s, f"e{i}", p) for i, p in enumerate(prompts)]
            assert [g.result() for g in gens] == [40, 40, 40]
            got = [e.result() for e in embeds]
        for p, r in zip(prompts, got, strict=True):
            want = simulated_embedding(p, pooling, normalize=normalize)
            assert list(r.embedding) == pytest.approx(want, abs=1e-6)
            assert (r.embedding_dim, r.prompt_tokens) == (SIMULATED_HIDDEN, len(p))
        wait_until(lambda: snapshot(s).idle, what="the server holds nothing")


def test_rerank_and_unsupported_fields_are_refused_by_name(tmp_path):
    with separate(tmp_path, WORKER, SCHEDULER) as addr:
        s = stub(addr)
        ids = pb.TokenizedInput(input_ids=[1, 2, 3])
        cases = [
            (pb.EmbedRequest(tokenized=ids, is_cross_encoder=True, texts=["q", "d"]), "rerank"),
            (pb.EmbedRequest(tokenized=ids, token_type_ids=[0, 1, 1]), "token_type_ids"),
            (pb.EmbedRequest(tokenized=ids, data_parallel_rank=3), "data_parallel_rank"),
            (pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[40000])), "vocabulary"),
        ]
        for request, word in cases:
            with pytest.raises(grpc.RpcError) as e:
                s.Embed(request)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert word in e.value.details()
        assert embed(s, "ok", [1, 2, 3]).embedding_dim == SIMULATED_HIDDEN
