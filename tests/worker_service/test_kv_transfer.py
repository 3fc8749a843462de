"""The worker-to-worker KV transfer (Worker.PushKv; kv_sender.py,
kv_receiver.py, kv_page_bytes.py) between two default-model workers over
loopback gRPC (the receiver served by the worker's real server, token
included; the sender reads its own pool in process): pages land in the
named pages bit for bit, in several batches under a window; a batch whose
checksum does not match, a receiver stopped mid-transfer and a wrong token
each fail the sender's call with a clear error."""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator

import grpc
import pytest
import torch

from common.worker_token import metadata
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.worker_service.support.worker_factory import worker_for
from worker_service.device.kv_cache import KvCache
from worker_service.device.kv_page_bytes import bytes_per_page, read_pages
from worker_service.rpc import kv_receiver
from worker_service.rpc.kv_sender import KvTransferError, push_pages
from worker_service.rpc.server import serve
from worker_service.worker import Worker

TOKEN = "s3cret-token"
SRC, DST = [3, 9, 1, 14, 6], [12, 2, 7, 5, 10]


def _fill(kv: KvCache, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer in kv.layers:
        raw = layer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[Worker, Worker, str]]:
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN)
    sender = worker_for("default", num_pages=16, swa_memory=False)
    receiver = worker_for(
        "default", num_pages=16, swa_memory=False, worker_token_file=str(token_file)
    )
    yield sender, receiver, str(token_file)


def _kv(w: Worker) -> KvCache:
    return w.runner.compute.kv  # type: ignore[attr-defined]


def _serve(receiver: Worker) -> tuple[grpc.Server, grpc.Channel]:
    server, port = serve(receiver)
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


def test_pages_move_bit_for_bit_in_batches_under_a_window(pair):
    sender, receiver, _ = pair
    _fill(_kv(sender), 1)
    _fill(_kv(receiver), 2)
    untouched = read_pages(_kv(receiver), [0, 1, 3])
    server, channel = _serve(receiver)
    try:
        n = push_pages(
            channel,
            room="r1",
            kv=_kv(sender),
            src_pages=SRC,
            dst_pages=DST,
            token=TOKEN,
            pages_per_batch=2,
            window=2,
        )
    finally:
        channel.close()
        server.stop(0)
    assert n == len(SRC)
    assert read_pages(_kv(receiver), DST) == read_pages(_kv(sender), SRC)
    assert read_pages(_kv(receiver), [0, 1, 3]) == untouched


def test_a_wrong_or_missing_token_is_refused(pair):
    sender, receiver, _ = pair
    server, channel = _serve(receiver)
    try:
        for token in ("wrong", None):
            with pytest.raises(KvTransferError, match="UNAUTHENTICATED"):
                push_pages(
                    channel, room="r2", kv=_kv(sender), src_pages=[1], dst_pages=[2], token=token
                )
    finally:
        channel.close()
        server.stop(0)


def test_a_batch_with_a_bad_checksum_fails_the_transfer(pair):
    sender, receiver, _ = pair
    per_page = bytes_per_page(_kv(sender))
    data = read_pages(_kv(sender), [1])
    server, channel = _serve(receiver)
    stub = worker_pb2_grpc.WorkerStub(channel)
    batch = pb.KvBatch(
        room="r3",
        bytes_per_page=per_page,
        dst_pages=[2],
        data=data,
        crc32=zlib.crc32(data) ^ 1,
        last=True,
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.PushKv(iter([batch]), metadata=metadata(TOKEN), timeout=30))
    finally:
        channel.close()
        server.stop(0)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert "r3" in err.value.details() and "checksum" in err.value.details()


def test_a_page_outside_the_pool_or_another_layout_is_refused(pair):
    sender, receiver, _ = pair
    server, channel = _serve(receiver)
    try:
        with pytest.raises(KvTransferError, match=r"INVALID_ARGUMENT.*outside the pool"):
            push_pages(
                channel, room="r4", kv=_kv(sender), src_pages=[1], dst_pages=[99], token=TOKEN
            )
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError, match="bytes, this worker's"):
            list(
                stub.PushKv(
                    iter([pb.KvBatch(room="r5", bytes_per_page=7, last=True)]),
                    metadata=metadata(TOKEN),
                    timeout=30,
                )
            )
    finally:
        channel.close()
        server.stop(0)


def test_a_receiver_stopped_mid_transfer_fails_the_senders_call(pair, monkeypatch):
    sender, receiver, _ = pair
    server, channel = _serve(receiver)
    real = kv_receiver.write_pages
    calls = 0

    def write_then_die(*args: object) -> None:
        nonlocal calls
        calls += 1
        real(*args)  # type: ignore[arg-type]
        if calls == 2:  # the receiver goes away with batches still to come
            threading.Thread(target=server.stop, args=(0,)).start()
            threading.Event().wait(0.5)

    monkeypatch.setattr(kv_receiver, "write_pages", write_then_die)
    try:
        with pytest.raises(KvTransferError, match=r"room r6: the KV transfer failed after \d of 5"):
            push_pages(
                channel,
                room="r6",
                kv=_kv(sender),
                src_pages=SRC,
                dst_pages=DST,
                token=TOKEN,
                pages_per_batch=1,
                window=1,
                timeout_s=20,
            )
    finally:
        channel.close()
        server.stop(0)
