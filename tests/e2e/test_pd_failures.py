"""Prefill/decode disaggregation when things go wrong, with real processes:
a bootstrap room nobody claims, the decode worker killed mid-transfer, the
prefill worker killed mid-transfer. Each request ends with UNAVAILABLE
naming its room on both units, neither unit keeps a page, and both serve
the next disaggregated request once their worker is back.

"Mid-transfer": the decode worker is stopped (SIGSTOP) before the request
arrives, so the prefill unit's push to it stalls; the test waits until the
prefill unit reports the request in its send queue (GetLoads' disagg
section), then kills one of the two workers."""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.pd_units import pd_units
from tests.e2e.support.system import greedy, stub, used_tokens, wait_until
from tests.e2e.support.units import Unit

BOOTSTRAP_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def units(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pdfail")
    prefill, decode, bport = pd_units(
        tmp, ["--disaggregation-bootstrap-timeout", str(BOOTSTRAP_TIMEOUT_S)]
    )
    for unit in (prefill, decode):
        unit.start()
    pool = ThreadPoolExecutor(4)
    try:
        yield prefill, decode, bport, pool
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        for unit in (prefill, decode):
            if unit.worker is not None and unit.worker.poll() is None:
                unit.worker.send_signal(signal.SIGCONT)
            unit.kill()


def _request(rid: str, bport: int, room: int, prompt_len: int = 40) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[100 + i % 500 for i in range(prompt_len)]),
        sampling_params=greedy(8),
        disaggregated_params=pb.DisaggregatedParams(
            bootstrap_host="127.0.0.1", bootstrap_port=bport, bootstrap_room=room
        ),
    )


def _call(pool: ThreadPoolExecutor, unit: Unit, req: pb.GenerateRequest) -> Future:
    def run() -> list[int] | grpc.RpcError:
        try:
            out: list[int] = []
            for r in stub(unit.address).Generate(req, timeout=90):
                if r.HasField("chunk"):
                    out += r.chunk.token_ids
                if r.HasField("complete"):
                    out += r.complete.output_ids
            return out
        except grpc.RpcError as e:
            return e

    return pool.submit(run)


def _unavailable(result: object, room: int) -> str:
    assert isinstance(result, grpc.RpcError), f"expected an error, got {result}"
    assert result.code() == grpc.StatusCode.UNAVAILABLE, result
    assert str(room) in result.details(), result.details()
    return result.details()


def _no_pages_kept(*units: Unit) -> None:
    for unit in units:
        s = stub(unit.address)
        wait_until(lambda s=s: used_tokens(s) == 0, 20, f"{unit.name}'s pages free")


def _sending(unit: Unit) -> int:
    loads = stub(unit.address).GetLoads(pb.GetLoadsRequest(include=["disagg"]), timeout=5)
    return loads.loads[0].disaggregation.prefill_inflight_queue_reqs


def _serves_again(prefill: Unit, decode: Unit, bport: int, pool: ThreadPoolExecutor) -> None:
    """A fresh disaggregated request completes (after a worker restart the
    units may take a moment to reconnect: retried until then)."""
    deadline = time.monotonic() + 90
    room = 9000 + int(time.monotonic()) % 1000
    while True:
        room += 1
        req = _request(f"again-{room}", bport, room)
        p, d = _call(pool, prefill, req), _call(pool, decode, req)
        got_p, got_d = p.result(120), d.result(120)
        if isinstance(got_d, list) and isinstance(got_p, list):
            assert len(got_d) == 8 and got_p == got_d[:1]
            return
        assert time.monotonic() < deadline, f"not serving again: {got_p!r} {got_d!r}"
        time.sleep(1)


def test_a_room_nobody_claims_times_out_on_both_units(units):
    prefill, decode, bport, pool = units
    t0 = time.monotonic()
    alone_p = _call(pool, prefill, _request("alone-p", bport, 1001))
    alone_d = _call(pool, decode, _request("alone-d", bport, 1002))
    message = _unavailable(alone_p.result(60), 1001)
    assert "not claimed" in message
    message = _unavailable(alone_d.result(60), 1002)
    assert "no prefill request" in message or "not given pages" in message
    assert time.monotonic() - t0 < 3 * BOOTSTRAP_TIMEOUT_S + 10
    _no_pages_kept(prefill, decode)


def _killed_mid_transfer(units, victim: str, room: int) -> None:
    """Stall a transfer (the decode worker stopped), kill ``victim``'s
    worker, check both calls fail naming the room, restart it, and check
    both units serve again and keep no page."""
    prefill, decode, bport, pool = units
    killed = prefill if victim == "prefill" else decode
    decode.worker.send_signal(signal.SIGSTOP)
    try:
        req = _request(f"kill-{victim}", bport, room, prompt_len=600)
        p, d = _call(pool, prefill, req), _call(pool, decode, req)
        wait_until(lambda: _sending(prefill) == 1, 30, "the prefill unit sending")
        killed.worker.kill()
        killed.worker.wait()
        _unavailable(p.result(60), room)
        _unavailable(d.result(60), room)
    finally:
        if decode.worker.poll() is None:
            decode.worker.send_signal(signal.SIGCONT)
    killed.start_worker()
    _serves_again(prefill, decode, bport, pool)
    _no_pages_kept(prefill, decode)


def test_decode_worker_killed_mid_transfer(units):
    _killed_mid_transfer(units, "decode", 2001)


def test_prefill_worker_killed_mid_transfer(units):
    _killed_mid_transfer(units, "prefill", 3001)
