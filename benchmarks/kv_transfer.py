"""The KV transfer of prefill/decode disaggregation, worker to worker on
one host: SendKv of a prompt's pages streamed over gRPC (Worker.PushKv:
16-page batches, a crc32 each, 4 in flight) against copied into a decode
worker's shared-memory pool (--kv-shared-memory), with the default model.

Three real worker processes (one sender, two receivers, one with its pool
in /dev/shm); the pages' contents do not matter here (nothing is decoded:
tests/worker_service/test_kv_send_order.py checks the tokens). Each size
alternates the two paths, ``--repeats`` times; prints the medians and the
ratio. Run: python benchmarks/kv_transfer.py [--tokens 512 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.overlap import BIN, started
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc

PAGE = 16


def worker(*extra: str) -> list[str]:
    return [str(BIN / "radixserve-worker"), "--model", "default", "--dequantize"] + [
        *("--page-size", str(PAGE), "--num-pages", "400", "--log-level", "warning", *extra)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 6144])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        d = Path(tmp)
        sender = stack.enter_context(started(worker(), d, "sender"))
        plain = stack.enter_context(started(worker(), d, "grpc"))
        shared = stack.enter_context(started(worker("--kv-shared-memory"), d, "shm"))
        stub = worker_pb2_grpc.WorkerStub(
            stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{sender}"))
        )
        info = stub.GetInfo(pb.GetInfoRequest())
        print(
            f"model {info.model.name}, KV {info.kv_cache_bytes / info.num_pages / PAGE:.0f} B/token"
        )
        print(f"{'tokens':>7} {'MiB':>7} {'gRPC ms':>8} {'shm ms':>8} {'gRPC/shm':>9}")
        per_token = info.kv_cache_bytes / info.num_pages / PAGE
        for tokens in args.tokens:
            pages = list(range(1, -(-tokens // PAGE) + 1))
            times: dict[str, list[float]] = {"grpc": [], "shm": []}
            for _ in range(args.repeats):
                for name, port in (("grpc", plain), ("shm", shared)):
                    order = pb.SendKvRequest(
                        room="bench", src_pages=pages, target=f"127.0.0.1:{port}", dst_pages=pages
                    )
                    t0 = time.perf_counter()
                    reply = stub.SendKv(order, timeout=120)
                    times[name].append((time.perf_counter() - t0) * 1000)
                    assert reply.shared_memory == (name == "shm"), reply
            g, s = statistics.median(times["grpc"]), statistics.median(times["shm"])
            mib = tokens * per_token / 2**20
            print(f"{tokens:>7} {mib:>7.1f} {g:>8.1f} {s:>8.1f} {g / s:>8.1f}x")


if __name__ == "__main__":
    main()
