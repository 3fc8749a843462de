"""The public API's edges on one simulated server: bytes that do not parse as
the request message are refused with INVALID_ARGUMENT and a clear message
(not UNKNOWN with a Python class name), logged and counted; GetServerInfo
reports unset options as JSON null, never as the string "None"."""

from __future__ import annotations

import json

import grpc
import pytest
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.metrics import scrape
from tests.e2e.support.sim_server import assert_idle_and_clean, simulated_server
from tests.e2e.support.system import free_port, greedy, stub

SERVICE = "/sglang.grpc.scheduler.SglangScheduler/"
GARBAGE = b"\xff\xff\xff\xff\x0f\x00garbage"  # a truncated varint: no message parses from it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edges")
    port = free_port()
    with simulated_server(tmp, scheduler_args=("--metrics-port", str(port))) as address:
        yield address, port, tmp / "scheduler.log"


def _raw(channel: grpc.Channel, method: str, streaming: bool):
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(SERVICE + method, request_serializer=lambda b: b, response_deserializer=bytes)


@pytest.mark.parametrize(
    ("method", "streaming", "message"),
    [
        ("Generate", True, "sglang.grpc.scheduler.GenerateRequest"),
        ("Abort", False, "sglang.grpc.scheduler.AbortRequest"),
        ("GetLoads", False, "sglang.grpc.scheduler.GetLoadsRequest"),
        ("SubscribeKvEvents", True, "smg.grpc.common.SubscribeKvEventsRequest"),
    ],
)
def test_undecodable_request_is_invalid_argument(server, method, streaming, message):
    address, port, log = server
    before = scrape(port).get("radixserve_request_errors_total{code=INVALID_ARGUMENT}", 0)
    with grpc.insecure_channel(address) as ch:
        call = _raw(ch, method, streaming)
        with pytest.raises(grpc.RpcError) as e:
            result = call(GARBAGE, timeout=10)
            if streaming:
                list(result)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    details = e.value.details()
    assert f"does not parse as a {message} message" in details
    assert f"({len(GARBAGE)} bytes)" in details
    assert "class" not in details
    after = scrape(port)["radixserve_request_errors_total{code=INVALID_ARGUMENT}"]
    assert after == before + 1
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    refused = [x for x in lines if x.get("event") == "undecodable request refused"]
    assert refused and refused[-1]["method"] == SERVICE + method
    assert refused[-1]["bytes"] == len(GARBAGE)


def test_server_still_serves_after_garbage(server):
    address, _, _ = server
    s = stub(address)
    req = pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]))
    req.sampling_params.CopyFrom(greedy(4))
    (r,) = list(s.Generate(req, timeout=10))
    assert r.complete.completion_tokens == 4
    assert_idle_and_clean(s)


def test_server_info_reports_unset_options_as_null(server):
    address, _, _ = server
    info = stub(address).GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    args = MessageToDict(info.server_args)
    assert "None" not in args.values(), {k: v for k, v in args.items() if v == "None"}
    unset = [k for k, v in args.items() if v is None]
    # options left at an unset default (e.g. no API key file, no TLS files)
    assert {"api_key_file", "tls_cert"} <= set(unset), unset
    assert all(info.server_args.fields[k].WhichOneof("kind") == "null_value" for k in unset)
    # set options keep their types
    assert args["max_running_requests"] == pytest.approx(float(args["max_running_requests"]))
    assert isinstance(args["schedule_policy"], str)
    # sequences are lists, not their Python repr
    assert isinstance(args["workers"], list) and args["workers"][0].startswith("grpc://")
    assert args["lora_paths"] == []


def test_guarded_streaming_methods_still_serve(server):
    address, _, _ = server
    # the method itself answers through the guard (the simulated model has no
    # tokenizer files: its own clear refusal, not an error of the guard)
    with pytest.raises(grpc.RpcError) as e:
        list(stub(address).GetTokenizer(cpb.GetTokenizerRequest(), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
    assert e.value.details() == "this model has no tokenizer to serve"
