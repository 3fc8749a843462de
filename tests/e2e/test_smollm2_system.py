"""`radixserve serve` with the default model (SmolLM2-135M-Instruct, CPU),
driven over gRPC with smg-grpc-proto's stubs and checked against
transformers on the same GGUF."""

from __future__ import annotations

import io
import threading
import zipfile

import grpc
import pytest
import torch
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import greedy, stub, used_tokens, wait_until
from tests.support.hf_reference import chat_ids, default_model_reference, greedy_with_logprobs

QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Name three colours of the rainbow.",
]


@pytest.fixture(scope="module")
def hf():
    return default_model_reference()


@pytest.fixture(scope="module")
def server(smollm2_address):
    return stub(smollm2_address)


def generate(s, ids, sampling, stream=False, rid="", **kw):
    req = pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=sampling,
        stream=stream,
        **kw,
    )
    return list(s.Generate(req, timeout=120))


def test_streamed_and_unstreamed_greedy_match_transformers(hf, server):
    tok, model = hf
    for q in QUESTIONS:
        ids = chat_ids(tok, q)
        ref, _ = greedy_with_logprobs(model, ids, 24)
        streamed = generate(server, ids, greedy(24), stream=True)
        tokens = [t for r in streamed if r.HasField("chunk") for t in r.chunk.token_ids]
        done = streamed[-1].complete
        (whole,) = generate(server, ids, greedy(24))
        assert list(whole.complete.output_ids) == tokens
        assert tokens == ref[: len(tokens)]
        if done.finish_reason == "stop":
            assert done.matched_token_id == 2 and tokens[-1] == 2
        else:
            assert done.finish_reason == "length" and len(tokens) == 24
        assert done.prompt_tokens == len(ids) and done.completion_tokens == len(tokens)
    assert "Paris" in tok.decode(
        generate(server, chat_ids(tok, QUESTIONS[0]), greedy(16))[0].complete.output_ids
    )


def test_output_and_prompt_logprobs_match_transformers(hf, server):
    tok, model = hf
    ids = chat_ids(tok, QUESTIONS[1])
    ref, ref_lps = greedy_with_logprobs(model, ids, 8)
    with torch.no_grad():
        prompt_lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    (resp,) = generate(
        server,
        ids,
        greedy(8, ignore_eos=True),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
    )
    c = resp.complete
    assert list(c.output_ids) == ref
    out = c.output_logprobs
    for i, (t, lp) in enumerate(zip(out.token_ids, out.token_logprobs, strict=True)):
        assert abs(lp - ref_lps[i][t].item()) < 1e-4
        assert list(out.top_logprobs[i].token_ids) == ref_lps[i].topk(3).indices.tolist()
    inp = c.input_logprobs
    assert list(inp.token_ids) == ids and not inp.token_logprobs[0].HasField("value")
    for pos in range(1, len(ids)):
        assert abs(inp.token_logprobs[pos].value - prompt_lps[pos - 1, ids[pos]].item()) < 1e-4


def test_stop_tokens_and_stop_strings(hf, server):
    tok, model = hf
    ids = chat_ids(tok, QUESTIONS[1])
    ref, _ = greedy_with_logprobs(model, ids, 20)
    (by_token,) = generate(server, ids, greedy(20, stop_token_ids=[ref[3]]))
    assert list(by_token.complete.output_ids) == ref[: ref.index(ref[3]) + 1]
    assert by_token.complete.matched_token_id == ref[3]
    text = tok.decode(ref[:12], skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    (by_str,) = generate(server, ids, greedy(20, stop=[stop]))
    c = by_str.complete
    assert c.finish_reason == "stop" and c.matched_stop_str == stop
    out = list(c.output_ids)
    assert out == ref[: len(out)] and stop in tok.decode(out) and stop not in tok.decode(out[:-1])


def test_max_new_tokens_and_n_samples_sharing_the_prompt(hf, server):
    tok, model = hf
    ids = chat_ids(tok, QUESTIONS[2])
    ref, _ = greedy_with_logprobs(model, ids, 5)
    (one,) = generate(server, ids, greedy(5, ignore_eos=True))
    assert list(one.complete.output_ids) == ref and one.complete.finish_reason == "length"
    three = generate(server, ids, greedy(5, ignore_eos=True, n=3), rid="n3")
    assert sorted(r.complete.index for r in three) == [0, 1, 2]
    assert all(list(r.complete.output_ids) == ref for r in three)
    cached = sorted(r.complete.cached_tokens for r in three)
    assert cached[-1] >= 16  # the samples read the prompt's KV from the cache


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_with_prompt_logprobs_prefill_the_prompt_once(hf, server, stream):
    """The prompt's logprobs are the same for every sample: the first sample
    computes them, the others read the prompt's KV from the cache (a sample
    that wants prompt logprobs cannot) and answer with the first's."""
    tok, model = hf
    ids = chat_ids(tok, QUESTIONS[1])
    with torch.no_grad():
        prompt_lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    got = generate(
        server,
        ids,
        greedy(4, ignore_eos=True, n=4),
        stream=stream,
        rid=f"nlp-{stream}",
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    done = sorted((r.complete for r in got if r.HasField("complete")), key=lambda c: c.index)
    assert [c.index for c in done] == [0, 1, 2, 3]
    if stream:  # the prompt's logprobs come once per sample, in its first chunk
        firsts = {}
        for r in got:
            if r.HasField("chunk") and r.chunk.index not in firsts:
                firsts[r.chunk.index] = r.chunk.input_logprobs
        inputs = [firsts[i] for i in range(4)]
    else:
        inputs = [c.input_logprobs for c in done]
    for inp in inputs:
        assert list(inp.token_ids) == ids and not inp.token_logprobs[0].HasField("value")
        assert inp == inputs[0] and len(inp.top_logprobs) == len(ids) - 1
        for pos in range(1, len(ids)):
            assert abs(inp.token_logprobs[pos].value - prompt_lps[pos - 1, ids[pos]].item()) < 1e-4
    # One prefill of the prompt: every sibling read it from the cache.
    assert all(c.cached_tokens >= (len(ids) - 1) // 16 * 16 > 0 for c in done[1:]), [
        (c.index, c.cached_tokens, len(ids)) for c in done
    ]


def test_abort_and_disconnect_free_pages(hf, server):
    tok, _ = hf
    ids = chat_ids(tok, QUESTIONS[0])
    wait_until(lambda: used_tokens(server) == 0, what="an idle pool")
    req = pb.GenerateRequest(
        request_id="to-abort",
        tokenized=pb.TokenizedInput(input_ids=ids),
        sampling_params=greedy(400, ignore_eos=True),
        stream=True,
    )
    responses = server.Generate(req, timeout=120)
    next(responses)
    assert used_tokens(server) > 0
    ack = server.Abort(pb.AbortRequest(request_id="to-abort", reason="test"))
    assert ack.success
    rest = list(responses)
    assert rest[-1].complete.finish_reason == "abort"
    wait_until(lambda: used_tokens(server) == 0, what="pages freed after abort")

    req.request_id = "to-drop"
    responses = server.Generate(req, timeout=120)
    next(responses)
    responses.cancel()
    wait_until(lambda: used_tokens(server) == 0, what="pages freed after disconnect")


def test_info_tokenizer_health_flush_and_kv_events(hf, server):
    tok, _ = hf
    assert server.HealthCheck(pb.HealthCheckRequest()).healthy
    info = server.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architectures == ["LlamaForCausalLM"] and info.vocab_size == 49152
    assert info.eos_token_ids == [2] and info.max_context_length > 1000 and info.is_generation
    # the tokenizer's BOS and pad (tokenizer.ggml.*: pad is EOS's id in this file);
    # the GGUF declares no sampling defaults (no general.sampling.* keys)
    assert (info.bos_token_id, info.pad_token_id) == (tok.bos_token_id, 2) == (1, 2)
    assert info.default_sampling_params_json == ""
    chunks = list(server.GetTokenizer(cpb.GetTokenizerRequest()))
    files = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks))).namelist()
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    flushed = server.FlushCache(cpb.FlushCacheRequest())
    assert flushed.success, flushed.message  # so the whole prompt is stored anew
    events = server.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
    batches = []
    reader = threading.Thread(target=lambda: batches.extend(_first_stored(events)))
    reader.start()
    ids = chat_ids(tok, "Tell me about radix trees.")
    generate(server, ids, greedy(4))
    reader.join(30)
    events.cancel()
    stored = [b for e in batches for b in e.stored.blocks]
    assert stored and stored[0].token_ids == ids[:16] and stored[0].block_size == 16


def _first_stored(stream):
    for batch in stream:
        stored = [e for e in batch.events if e.HasField("stored")]
        if stored:
            return stored
    return []


def test_bad_requests_are_refused_and_serving_goes_on(server):
    cases = [
        (pb.GenerateRequest(tokenized=pb.TokenizedInput()), "empty"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[49152])), "vocabulary"),
        (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1] * 9000)), "context"),
    ]
    for req, needle in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(server.Generate(req))
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
        )
    (ok,) = generate(server, [1, 2, 3], greedy(2))
    assert ok.complete.completion_tokens >= 1
