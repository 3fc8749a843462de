"""Property-based fuzzing of the public gRPC API: random, malformed and
extreme GenerateRequests (and Aborts, client cancels, duplicate ids, unknown
fields) against one simulated-worker server with a small page pool and
--check-integrity (the core checks pool and cache after every step and
update, and would fail every call with INTERNAL if they broke).

Every call must end with OK or a clear code within its deadline; after
every example the server answers HealthCheck and, once idle, holds no
request and no page beyond the cache.
"""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from hypothesis import event, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.e2e.support.sim_server import VOCAB, assert_idle_and_clean, simulated_server
from tests.e2e.support.system import stub

CONTEXT = 48 * 4  # --num-pages 48 --page-size 4
DEADLINE_S = 30.0
ALLOWED = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "CANCELLED"}
GENERATE = "/sglang.grpc.scheduler.SglangScheduler/Generate"


class Server:
    """The server, and one event loop + channel kept across examples."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sync = stub(address)
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._open())
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.raw_generate = self.channel.unary_stream(
            GENERATE,
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )

    async def _open(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address)

    def run(self, coro):
        return self.loop.run_until_complete(asyncio.wait_for(coro, DEADLINE_S + 10))

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ("--max-n", "4", "--max-queued-requests", "32", "--max-running-requests", "8")
    tmp = tmp_path_factory.mktemp("fuzz")
    with simulated_server(tmp, num_pages=48, page_size=4, step_ms=0, scheduler_args=args) as a:
        s = Server(a)
        yield s
        s.close()


# ------------------------------------------------------------- strategies
def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` 15 times in 16: with a dozen fields, about half the requests
    pass validation and run, the rest probe one or two bad fields."""
    return st.integers(0, 15).flatmap(lambda k: wild if k == 0 else valid)


f32 = st.floats(width=32)  # NaN, infinities, subnormals, huge values
token = st.one_of(st.integers(0, VOCAB - 1), st.integers(0, 2**32 - 1))
valid_token = st.integers(0, VOCAB - 1)
valid_ids = st.lists(valid_token, min_size=1, max_size=24)
any_ids = st.one_of(
    st.lists(token, max_size=40),
    st.integers(CONTEXT - 4, CONTEXT + 4).map(lambda n: [7] * n),
)
int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
rids = st.one_of(st.sampled_from(["", "dup", "dup-0", "dup-1", "x"]), st.text(max_size=12))


def _float(lo: float, hi: float, *special: float) -> st.SearchStrategy:
    valid = st.one_of(st.sampled_from(special or (lo,)), st.floats(lo, hi, width=32))
    return mostly(valid, f32)


@st.composite
def sampling(draw) -> pb.SamplingParams:
    m = pb.SamplingParams(
        temperature=draw(_float(0, 2, 0.0, 1.0)),
        top_p=draw(_float(0, 1, 0.0, 1.0)),
        top_k=draw(mostly(st.sampled_from([0, -1, 1, 5, 50]), int32)),
        min_p=draw(_float(0, 1, 0.0)),
        frequency_penalty=draw(_float(-2, 2, 0.0)),
        presence_penalty=draw(_float(-2, 2, 0.0)),
        repetition_penalty=draw(_float(0.5, 2, 0.0, 1.0)),
        min_new_tokens=draw(mostly(st.integers(0, 2), uint32)),
        n=draw(mostly(st.integers(0, 3), uint32)),
        ignore_eos=draw(st.booleans()),
        no_stop_trim=draw(st.booleans()),
        stop_token_ids=draw(mostly(st.lists(valid_token, max_size=3), st.lists(token))),
    )
    max_new = draw(mostly(st.one_of(st.integers(2, 12), st.just(None)), st.one_of(uint32)))
    if max_new is not None:
        m.max_new_tokens = max_new
    if draw(st.integers(0, 15)) == 0:  # the simulated model has no tokenizer: refused
        m.stop.extend(draw(st.lists(st.text(max_size=300), max_size=18)))
    if draw(st.integers(0, 3)) == 0:
        keys = mostly(valid_token.map(str), st.one_of(st.integers().map(str), st.text()))
        m.logit_bias.update(draw(st.dictionaries(keys, _float(-100, 100, 0.0), max_size=5)))
    if draw(st.integers(0, 3)) == 0:
        wild = st.one_of(st.integers(-5, 2**70), st.floats(), st.text(max_size=3))
        params = Struct()
        params.update({"seed": draw(mostly(st.integers(0, 2**53), wild))})
        m.custom_params.CopyFrom(params)
    if draw(st.integers(0, 31)) == 0:
        m.regex = "a+"
    return m


@st.composite
def generate_requests(draw, rid=rids) -> pb.GenerateRequest:
    ids = draw(mostly(valid_ids, any_ids))
    m = pb.GenerateRequest(
        request_id=draw(rid),
        sampling_params=draw(sampling()),
        stream=draw(st.booleans()),
        return_logprob=draw(st.booleans()),
        logprob_start_len=draw(
            mostly(st.one_of(st.just(-1), st.integers(0, max(len(ids) - 1, 0))), int32)
        ),
        top_logprobs_num=draw(mostly(st.integers(0, 3), int32)),
        token_ids_logprob=draw(mostly(st.lists(valid_token, max_size=3), st.lists(token))),
    )
    if draw(st.integers(0, 15)) == 0:
        m.tokenized.original_text = draw(st.text(max_size=20))  # no tokenizer: refused
    else:
        m.tokenized.input_ids.extend(ids)
    if draw(st.integers(0, 31)) == 0:
        m.input_embeds.extend([0.5])
    return m


# ---------------------------------------------------------------- calling
async def consume(
    server: Server, req: pb.GenerateRequest | bytes, action: str = "read", after: int = 0
) -> str:
    """One Generate call to its end; returns its status name. Actions:
    read (to the end), cancel (client side, after ``after`` responses),
    abort (the Abort RPC with the call's own id, then read on)."""
    if isinstance(req, bytes):
        call = server.raw_generate(req, timeout=DEADLINE_S)
    else:
        call = server.stub.Generate(req, timeout=DEADLINE_S)
    seen = 0
    try:
        if action != "read" and after == 0:
            await _act(server, call, req, action)
            if action == "cancel":
                return "CANCELLED"
        async for _ in call:
            seen += 1
            if action != "read" and seen == after:
                await _act(server, call, req, action)
                if action == "cancel":
                    return "CANCELLED"
    except grpc.aio.AioRpcError as e:
        return e.code().name
    except asyncio.CancelledError:
        return "CANCELLED"
    return (await call.code()).name


async def _act(server: Server, call, req, action: str) -> None:
    if action == "cancel":
        call.cancel()
    else:
        rid = req.request_id if isinstance(req, pb.GenerateRequest) else "?"
        ack = await server.stub.Abort(pb.AbortRequest(request_id=rid), timeout=DEADLINE_S)
        assert ack.success


def check_codes(codes: list[str]) -> None:
    for code in codes:
        event(code)  # --hypothesis-show-statistics: how many got through
    bad = [c for c in codes if c not in ALLOWED]
    assert not bad, f"calls ended with {bad} (all: {codes})"


# ------------------------------------------------------------------ tests
@settings(max_examples=300)
@given(req=generate_requests())
def test_any_single_request_ends_with_a_clear_status(server, req):
    check_codes([server.run(consume(server, req))])
    assert_idle_and_clean(server.sync)


actions = st.tuples(st.sampled_from(["read", "cancel", "abort"]), st.integers(0, 4))


@settings(max_examples=300)
@given(
    calls=st.lists(st.tuples(generate_requests(), actions), min_size=2, max_size=4),
    stray_aborts=st.lists(rids, max_size=2),
)
def test_concurrent_calls_cancels_aborts_and_duplicate_ids(server, calls, stray_aborts):
    async def go() -> list[str]:
        tasks = [consume(server, req, action, after) for req, (action, after) in calls]
        for rid in stray_aborts:  # random ids: known ones, unknown ones, prefixes
            tasks.append(_stray_abort(server, rid))
        return [c for c in await asyncio.gather(*tasks) if c is not None]

    check_codes(server.run(go()))
    assert_idle_and_clean(server.sync)


async def _stray_abort(server: Server, rid: str) -> None:
    ack = await server.stub.Abort(pb.AbortRequest(request_id=rid), timeout=DEADLINE_S)
    assert ack.success


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


unknown_field = st.tuples(
    st.integers(100, 2**29 - 1),  # field numbers the schema does not use
    st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=40)),
)


@settings(max_examples=200)
@given(
    req=generate_requests(rid=st.just("")),
    extra=st.lists(unknown_field, min_size=1, max_size=4),
)
def test_unknown_fields_change_nothing(server, req, extra):
    raw = req.SerializeToString()
    for number, value in extra:
        if isinstance(value, int):
            raw += _varint(number << 3) + _varint(value)
        else:
            raw += _varint(number << 3 | 2) + _varint(len(value)) + value

    async def both() -> list[str]:
        return await asyncio.gather(consume(server, req), consume(server, raw))

    plain, with_extra = server.run(both())
    check_codes([plain, with_extra])
    assert plain == with_extra or "RESOURCE_EXHAUSTED" in (plain, with_extra)
    assert_idle_and_clean(server.sync)


def test_nan_and_infinities_are_named(server):
    req = pb.GenerateRequest(
        tokenized=pb.TokenizedInput(input_ids=[1]),
        sampling_params=pb.SamplingParams(temperature=math.inf),
    )
    with pytest.raises(grpc.RpcError) as err:
        list(server.sync.Generate(req, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be a finite number" in err.value.details()
