"""The effect checks of the conformance table (public_field_table.py): each
sets one public field on a request to a running server and fails unless the
answer shows the field's meaning. On the simulated worker the expected tokens
come from its rule (common/simulated_model.py); on the default model the
checks compare requests with each other (greedy, seeded, biased)."""

from __future__ import annotations

import functools
import math
import re
import time
import urllib.request

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from common.simulated_model import expected_output
from tests.support.public_fields import Server

VOCAB = 32000  # the simulated model's
PROMPT = [101, 202, 303, 404, 505]
TEXT = "Here is a list of fruits: apple, banana, cherry,"
REPEAT = "one two one two one two one two one two one two one two"
TIMEOUT_S = 60


@functools.cache
def stub(address: str) -> pb_grpc.SglangSchedulerStub:
    return pb_grpc.SglangSchedulerStub(grpc.insecure_channel(address))


def request(
    prompt: list[int] | str = PROMPT, max_new: int = 4, *, stream: bool = False, **sampling
) -> pb.GenerateRequest:
    tokenized = (
        pb.TokenizedInput(original_text=prompt)
        if isinstance(prompt, str)
        else pb.TokenizedInput(input_ids=prompt)
    )
    sp = pb.SamplingParams(max_new_tokens=max_new, **sampling)
    return pb.GenerateRequest(tokenized=tokenized, sampling_params=sp, stream=stream)


def call(server: Server, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    return list(stub(server.address).Generate(req, timeout=TIMEOUT_S))


def complete(server: Server, req: pb.GenerateRequest) -> pb.GenerateComplete:
    return call(server, req)[-1].complete


def tokens(server: Server, req: pb.GenerateRequest) -> list[int]:
    return list(complete(server, req).output_ids)


def refused(fn, code: grpc.StatusCode, needle: str) -> None:
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, (e.code(), e.details())
        assert needle in e.details(), e.details()
        return
    raise AssertionError(f"not refused: expected {code.name} ({needle})")


def oracle(n: int, **kw) -> list[int]:
    return expected_output(PROMPT, n, VOCAB, **kw)


# ------------------------------------------------------ simulated worker
def request_id(server: Server) -> None:
    req = request()
    req.request_id = "conformance-rid"
    assert {r.request_id for r in call(server, req)} == {"conformance-rid"}
    assert all(r.request_id for r in call(server, request()))  # a generated one


def input_ids(server: Server) -> None:
    assert tokens(server, request(PROMPT, 5)) == oracle(5)
    assert tokens(server, request(PROMPT[:3], 5)) == expected_output(PROMPT[:3], 5, VOCAB)


def max_new_tokens(server: Server) -> None:
    for n in (1, 6):
        c = complete(server, request(max_new=n))
        assert list(c.output_ids) == oracle(n) and c.finish_reason == "length"


def _a_stop_token() -> tuple[int, int]:
    """An output position whose token did not appear before it."""
    out = oracle(12)
    i = next(i for i in range(2, 12) if out[i] not in out[:i])
    return i, out[i]


def stop_token_ids(server: Server) -> None:
    i, stop = _a_stop_token()
    c = complete(server, request(max_new=12, stop_token_ids=[stop]))
    assert list(c.output_ids) == oracle(i + 1) and c.finish_reason == "stop"
    assert c.matched_token_id == stop


def min_new_tokens(server: Server) -> None:
    first = oracle(1)[0]
    req = request(max_new=10, stop_token_ids=[first], min_new_tokens=3)
    want = oracle(10, stop_ids=frozenset({first}), min_new_tokens=3)
    assert tokens(server, req) == want and len(want) > 1


def ignore_eos(server: Server) -> None:
    # The simulated model has no EOS: ignore_eos shows on stop ids, which
    # SGLang also skips under it.
    _, stop = _a_stop_token()
    c = complete(server, request(max_new=12, stop_token_ids=[stop], ignore_eos=True))
    assert list(c.output_ids) == oracle(12) and c.finish_reason == "length"


def n(server: Server) -> None:
    replies = call(server, request(max_new=3, n=3))
    assert sorted(r.complete.index for r in replies) == [0, 1, 2]
    assert all(list(r.complete.output_ids) == oracle(3) for r in replies)


def stream(server: Server) -> None:
    streamed = call(server, request(max_new=3, stream=True))
    assert [r.WhichOneof("response") for r in streamed][-1] == "complete"
    assert [t for r in streamed if r.HasField("chunk") for t in r.chunk.token_ids] == oracle(3)
    (whole,) = call(server, request(max_new=3))
    assert list(whole.complete.output_ids) == oracle(3)


def return_logprob(server: Server) -> None:
    req = request(max_new=3)
    req.return_logprob, req.logprob_start_len = True, -1
    assert len(complete(server, req).output_logprobs.token_logprobs) == 3
    assert len(complete(server, request(max_new=3)).output_logprobs.token_logprobs) == 0


def data_parallel_rank(server: Server) -> None:
    req = request()
    req.data_parallel_rank = 0
    assert tokens(server, req) == oracle(4)
    req.data_parallel_rank = 1
    refused(lambda: call(server, req), grpc.StatusCode.INVALID_ARGUMENT, "data_parallel_rank")


def _finished(server: Server) -> float:
    """radixserve_requests_total summed over finish reasons."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(r"^radixserve_requests_total\{.*\} (\S+)$", text, re.M))


def log_metrics(server: Server) -> None:
    # Counted either way: false is also proto3's unset (docs/design.md, section 2).
    for flag in (True, False):
        before = _finished(server)
        req = request(max_new=2)
        req.log_metrics = flag
        assert tokens(server, req) == oracle(2)
        deadline = time.monotonic() + 5
        while _finished(server) != before + 1:
            assert time.monotonic() < deadline, f"log_metrics={flag}: the call was not counted"
            time.sleep(0.05)


def abort_request_id(server: Server) -> None:
    req = request(max_new=100_000, stream=True, ignore_eos=True)
    req.request_id = "conformance-abort"
    responses = stub(server.address).Generate(req, timeout=TIMEOUT_S)
    assert next(responses).HasField("chunk")
    ack = stub(server.address).Abort(pb.AbortRequest(request_id="conformance-abort"))
    assert ack.success
    last = [r for r in responses][-1]
    assert last.complete.finish_reason == "abort"


def get_loads_dp_rank(server: Server) -> None:
    s = stub(server.address)
    assert [x.dp_rank for x in s.GetLoads(pb.GetLoadsRequest(dp_rank=0)).loads] == [0]
    refused(
        lambda: s.GetLoads(pb.GetLoadsRequest(dp_rank=1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "dp_rank",
    )


def get_loads_include(server: Server) -> None:
    tokens(server, request(max_new=1))  # the core has sent a load snapshot
    s = stub(server.address)
    (core,) = s.GetLoads(pb.GetLoadsRequest(include=["core"])).loads
    assert not any(core.HasField(x) for x in ("memory", "lora", "queues", "disaggregation"))
    (some,) = s.GetLoads(pb.GetLoadsRequest(include=["memory", "lora", "disagg"])).loads
    assert some.memory.token_capacity == core.max_total_num_tokens > 0
    assert some.lora.slots_total > 0 and some.disaggregation.mode == "null"
    assert not some.HasField("queues")
    refused(
        lambda: s.GetLoads(pb.GetLoadsRequest(include=["bogus"])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "bogus",
    )


def _first_batches(server: Server, asked: bool, wait_s: float) -> list[cpb.KvEventBatch]:
    req = cpb.SubscribeKvEventsRequest(load_records_before_first_batch=asked)
    got = []
    stream = stub(server.address).SubscribeKvEvents(req, timeout=wait_s)
    try:
        for batch in stream:
            got.append(batch)
            if asked:
                break
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    finally:
        stream.cancel()
    return got


def load_records_before_first_batch(server: Server) -> None:
    tokens(server, request(max_new=1))  # the core has sent a load snapshot
    (beat,) = _first_batches(server, asked=True, wait_s=5)
    assert beat.load.load_only and beat.sequence_number == 0 and not beat.events
    # Unasked (an older subscriber), the idle server sends no heartbeat
    # before the stream's first event batch.
    quiet = _first_batches(server, asked=False, wait_s=2.5)
    assert not [b for b in quiet if b.load.load_only and b.sequence_number == 0]


# ------------------------------------------------------ the default model
def _greedy(server: Server, prompt: str = TEXT, max_new: int = 8, **sampling) -> list[int]:
    return tokens(server, request(prompt, max_new, temperature=0.0, ignore_eos=True, **sampling))


def _seeded(server: Server, seed: int, **sampling) -> list[int]:
    req = request(TEXT, 8, ignore_eos=True, **sampling)
    req.sampling_params.custom_params.update({"seed": seed})
    return tokens(server, req)


def temperature(server: Server) -> None:
    greedy = _greedy(server)
    assert _greedy(server) == greedy
    sampled = [_seeded(server, seed, temperature=1.5) for seed in (1, 2, 3, 4)]
    assert any(s != greedy for s in sampled), "temperature 1.5 sampled the greedy tokens 4 times"


def top_k(server: Server) -> None:
    greedy = _greedy(server)
    assert all(_seeded(server, s, temperature=1.5, top_k=1) == greedy for s in (1, 2, 3))


def top_p(server: Server) -> None:
    greedy = _greedy(server)
    assert all(_seeded(server, s, temperature=1.5, top_p=1e-6) == greedy for s in (1, 2, 3))


def min_p(server: Server) -> None:
    greedy = _greedy(server)
    assert all(_seeded(server, s, temperature=1.5, min_p=1.0) == greedy for s in (1, 2, 3))


def _penalised(server: Server, **penalty) -> None:
    plain = _greedy(server, REPEAT, 12)
    assert _greedy(server, REPEAT, 12, **penalty) != plain, f"{penalty} changed nothing"


def frequency_penalty(server: Server) -> None:
    _penalised(server, frequency_penalty=2.0)


def presence_penalty(server: Server) -> None:
    _penalised(server, presence_penalty=2.0)


def repetition_penalty(server: Server) -> None:
    _penalised(server, repetition_penalty=2.0)


def logit_bias(server: Server) -> None:
    token = 13
    assert set(_greedy(server, logit_bias={str(token): 100.0})) == {token}
    assert set(_greedy(server, logit_bias={str(token): 0.0})) != {token}


def custom_params(server: Server) -> None:
    first = _seeded(server, 7, temperature=1.5)
    assert _seeded(server, 7, temperature=1.5) == first  # seed: reproducible
    others = [_seeded(server, seed, temperature=1.5) for seed in (8, 9, 10)]
    assert any(o != first for o in others)
    req = request(TEXT)
    params = Struct()
    params.update({"temprature": 0.5})
    req.sampling_params.custom_params.CopyFrom(params)
    refused(lambda: call(server, req), grpc.StatusCode.INVALID_ARGUMENT, "temprature")


def token_ids_logprob(server: Server) -> None:
    """The next-token row of prefill-only scoring equals the first row of a
    one-token generation from the same prompt."""
    ids = [13, 100, 2000]
    rows = []
    for max_new in (1, 0):
        req = request(TEXT, max_new, temperature=0.0, ignore_eos=True)
        req.return_logprob, req.logprob_start_len = True, -1
        req.token_ids_logprob.extend(ids)
        c = complete(server, req)
        assert len(c.output_ids) == max_new and c.finish_reason == "length"
        (row,) = c.output_logprobs.token_ids_logprobs
        assert list(row.token_ids) == ids
        rows.append(list(row.values))
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(*rows, strict=True)), rows


# ------------------------------------------------------ client-side text fields
def same_ids_whatever_it_says(field: str):
    """A field that shapes only the client's text (SGLang's gRPC path has no
    server-side effect for it either): the server's output ids, finish and
    matched stop are the same for either value."""

    def check(server: Server) -> None:
        answers = []
        for value in (True, False):
            c = complete(server, request(max_new=6, ignore_eos=True, **{field: value}))
            answers.append((list(c.output_ids), c.finish_reason, c.matched_stop_str))
        assert answers[0] == answers[1] and len(answers[0][0]) == 6, answers

    return check


# ------------------------------------------------------ Embed
def _embed(server: Server, prompt: list[int] = PROMPT, **fields) -> pb.EmbedResponse:
    req = pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=prompt), **fields)
    return stub(server.address).Embed(req, timeout=TIMEOUT_S)


def embed_input_ids(server: Server) -> None:
    a, again, other = _embed(server), _embed(server), _embed(server, PROMPT[:-1] + [999])
    assert a.embedding_dim == len(a.embedding) > 0 and a.prompt_tokens == len(PROMPT)
    assert list(a.embedding) == list(again.embedding) != list(other.embedding)


def embed_original_text(server: Server) -> None:
    refused(
        lambda: stub(server.address).Embed(
            pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text="hello")),
            timeout=TIMEOUT_S,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tokenizer",  # the simulated model has none; tests/e2e/test_embeddings_real.py has one
    )


def embed_request_id(server: Server) -> None:
    """The id names the request: a live call's id is refused to an Embed, and
    free for it once that call ends."""
    s = stub(server.address)
    live = request(max_new=100_000, stream=True, ignore_eos=True)
    live.request_id = "conformance-embed-id"
    responses = s.Generate(live, timeout=TIMEOUT_S)
    assert next(responses).HasField("chunk")
    try:
        refused(
            lambda: _embed(server, request_id="conformance-embed-id"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "already in use",
        )
    finally:
        responses.cancel()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _embed(server, request_id="conformance-embed-id").embedding_dim > 0
            return
        except grpc.RpcError as e:
            assert time.monotonic() < deadline, e.details()
            time.sleep(0.1)


def embed_sampling_params(server: Server) -> None:
    """Read by nothing, as SGLang (the proto calls it a dummy for
    compatibility; the gateway sends it): the vector is the same."""
    plain = _embed(server)
    odd = _embed(
        server, sampling_params=pb.SamplingParams(temperature=1.5, max_new_tokens=9, top_k=3, n=2)
    )
    assert list(plain.embedding) == list(odd.embedding)
