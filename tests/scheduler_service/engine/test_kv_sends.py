"""The prefill engine's KV send carrier (engine/kv_sends.py) against two
default-model workers served in process on loopback: a core KvSend's pages
reach the decode worker's named pages bit for bit and the send is reported
done; a decode worker that is not there, and mismatched peers, are reported
failed with a message naming the room."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from protos import worker_pb2_grpc
from scheduler_service.core.disagg.orders import KvSend
from scheduler_service.engine.kv_sends import DecodePeer, KvSendCarrier
from tests.worker_service.support.worker_factory import worker_for
from tests.worker_service.support.worker_process import free_port
from worker_service.device.kv_page_bytes import read_pages
from worker_service.rpc.server import serve


def _order(pages: tuple[int, ...], room: int = 11) -> KvSend:
    return KvSend("r", room, pages, 0, 4 * len(pages), 5, None, 0)


def _wait(carrier: KvSendCarrier) -> list[tuple[str, str | None]]:
    deadline = time.monotonic() + 60
    while True:
        done = carrier.take_done()
        if done:
            return done
        assert time.monotonic() < deadline, "the send never ended"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def units():
    prefill = worker_for("default", num_pages=16, swa_memory=False)
    decode = worker_for("default", num_pages=16, swa_memory=False)
    gen = torch.Generator().manual_seed(3)
    for layer in prefill.runner.compute.kv.layers:  # type: ignore[attr-defined]
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    servers = [serve(prefill), serve(decode)]
    channel = grpc.insecure_channel(f"127.0.0.1:{servers[0][1]}")
    yield prefill, decode, f"127.0.0.1:{servers[1][1]}", worker_pb2_grpc.WorkerStub(channel)
    channel.close()
    for server, _ in servers:
        server.stop(0)


def test_a_send_lands_bit_for_bit_and_is_reported_done(units):
    prefill, decode, target, stub = units
    carrier = KvSendCarrier([stub])
    carrier.start(_order((4, 9, 2)), DecodePeer((target,), (7, 1, 12)))
    assert _wait(carrier) == [("r", None)]
    assert carrier.in_flight() == 0
    got = read_pages(decode.runner.compute.kv, [7, 1, 12])  # type: ignore[attr-defined]
    assert got == read_pages(prefill.runner.compute.kv, [4, 9, 2])  # type: ignore[attr-defined]


def test_an_absent_decode_worker_is_a_failed_send_naming_the_room(units):
    _, _, _, stub = units
    carrier = KvSendCarrier([stub], timeout_s=5)
    carrier.start(_order((4,), room=12), DecodePeer((f"127.0.0.1:{free_port()}",), (3,)))
    [(rid, message)] = _wait(carrier)
    assert rid == "r" and message is not None and "room 12" in message


def test_mismatched_peers_fail_at_once(units):
    _, _, target, stub = units
    carrier = KvSendCarrier([stub])
    carrier.start(_order((4, 5)), DecodePeer((target,), (3,)))
    carrier.start(_order((4,), room=13), DecodePeer((target, target), (3,)))
    done = carrier.take_done()
    assert [m is not None and "decode" in m for _, m in done] == [True, True]
