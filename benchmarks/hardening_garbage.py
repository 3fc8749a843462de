"""Garbage on both planes: random and mutated request bodies sent to every
method of the public API (sglang.grpc.scheduler.SglangScheduler) and of the
worker (radixserve.worker.v1.Worker) through gRPC generic calls, and raw
TCP garbage (random bytes, cut and corrupted HTTP/2 prefaces, silent and
reset connections) to the public, worker and /metrics ports."""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from protos import worker_pb2 as wpb

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A failure of the server itself, never an answer to garbage.
BAD_CODES = {"INTERNAL", "UNKNOWN", "DATA_LOSS", "UNAVAILABLE"}
# Calls that may legitimately run past the round's deadline: streams, what
# waits for the model (a generation, a compile), and FlushCache (a parsed
# body's timeout_s may be longer: it waits for the load to pause).
SLOW_METHODS = {
    "FlushCache",
    "Generate",
    "HealthCheck",
    "GetTokenizer",
    "SubscribeKvEvents",
    "CompileGrammar",
    "LoadLoRAAdapter",
}


# Bodies that parse start streams that run to the call's deadline: fewer of them.
FEWER = {"SubscribeKvEvents": 5, "GetTokenizer": 3}


@dataclass(frozen=True)
class Method:
    path: str  # /package.Service/Name
    name: str
    server_streaming: bool
    client_streaming: bool
    example: bytes  # a valid body, for mutations ("" : none)


def _examples() -> dict[str, Message]:
    greedy = pb.SamplingParams(temperature=0.0, max_new_tokens=4)
    return {
        "Generate": pb.GenerateRequest(
            request_id="garbage",
            tokenized=pb.TokenizedInput(input_ids=list(range(200, 220))),
            sampling_params=greedy,
        ),
        "Abort": pb.AbortRequest(request_id="garbage"),
        "GetLoads": pb.GetLoadsRequest(include=["core"]),
        "FlushCache": cpb.FlushCacheRequest(timeout_s=1),
        "LoadLoRAAdapter": pb.LoadLoRAAdapterRequest(
            lora_name="garbage", lora_id="garbage", lora_path="/nonexistent/garbage"
        ),
        "UnloadLoRAAdapter": pb.UnloadLoRAAdapterRequest(lora_name="garbage", lora_id="garbage"),
        "CompileGrammar": wpb.CompileGrammarRequest(
            grammar=wpb.Grammar(kind=wpb.GRAMMAR_KIND_REGEX, text="[a-z]{1,8}")
        ),
        "LoadAdapter": wpb.LoadAdapterRequest(name="garbage", path="/nonexistent/garbage"),
        "UnloadAdapter": wpb.UnloadAdapterRequest(name="garbage"),
    }


def methods(descriptor, service: str) -> list[Method]:
    examples = _examples()
    out = []
    for m in descriptor.services_by_name[service].methods:
        # No mutated Execute openings: one that parsed as a valid SessionOpen
        # would take the worker over (a token-less worker allows it, by design).
        ex = examples.get(m.name)
        out.append(
            Method(
                f"/{service_full(descriptor, service)}/{m.name}",
                m.name,
                m.server_streaming,
                m.client_streaming,
                b"" if ex is None or m.name == "Execute" else ex.SerializeToString(),
            )
        )
    return out


def service_full(descriptor, service: str) -> str:
    return descriptor.services_by_name[service].full_name


def public_methods() -> list[Method]:
    return methods(pb.DESCRIPTOR, "SglangScheduler")


def worker_methods() -> list[Method]:
    return methods(wpb.DESCRIPTOR, "Worker")


def body(rng: random.Random, m: Method) -> bytes:
    """Random bytes, or (where the method has an example) the example cut,
    with bytes flipped, or with random bytes after it."""
    kind = rng.randrange(4) if m.example else 0
    if kind == 0:
        return rng.randbytes(rng.choice([0, 1, 2, 5, 17, 64, 300, 4096]))
    b = bytearray(m.example)
    if kind == 1:
        return bytes(b[: rng.randrange(len(b))])
    if kind == 2:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    return bytes(b) + rng.randbytes(rng.randint(1, 64))


def call(channel: grpc.Channel, m: Method, data: bytes, timeout_s: float) -> str:
    """The status code name the call ended with."""
    ident = lambda b: b  # noqa: E731 (bytes in, bytes out)
    try:
        if m.client_streaming:
            stream = channel.stream_stream(
                m.path, request_serializer=ident, response_deserializer=ident
            )
            for _ in stream(iter([data]), timeout=timeout_s):
                pass
        elif m.server_streaming:
            stream = channel.unary_stream(
                m.path, request_serializer=ident, response_deserializer=ident
            )
            for _ in stream(data, timeout=timeout_s):
                pass
        else:
            unary = channel.unary_unary(
                m.path, request_serializer=ident, response_deserializer=ident
            )
            unary(data, timeout=timeout_s)
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def garbage_calls(
    address: str, ms: list[Method], per_method: int, seed: int, timeout_s: float = 5.0
) -> dict[str, Counter]:
    """``per_method`` calls of each method (fewer of the streams that run
    until their deadline), 16 at a time; codes by method."""
    rng = random.Random(seed)
    jobs = [(m, body(rng, m)) for m in ms for _ in range(per_method // FEWER.get(m.name, 1))]
    rng.shuffle(jobs)
    codes: dict[str, Counter] = {m.name: Counter() for m in ms}
    with grpc.insecure_channel(address) as channel, ThreadPoolExecutor(16) as pool:
        futures = [(m, pool.submit(call, channel, m, data, timeout_s)) for m, data in jobs]
        for m, f in futures:
            codes[m.name][f.result()] += 1
    return codes


def bad_codes(codes: dict[str, Counter]) -> list[str]:
    out = []
    for name, c in codes.items():
        for code, n in c.items():
            if code in BAD_CODES or (code == "DEADLINE_EXCEEDED" and name not in SLOW_METHODS):
                out.append(f"{name}: {n} x {code}")
    return out


# ------------------------------------------------------------ raw TCP
RAW_KINDS = ("random", "preface-cut", "preface-then-garbage", "silent", "reset", "frames")


def _bad_frames(rng: random.Random) -> bytes:
    """HTTP/2 frames with random types, flags, stream ids and lengths."""
    out = b""
    for _ in range(rng.randint(1, 6)):
        payload = rng.randbytes(rng.randint(0, 64))
        length = rng.choice([len(payload), rng.randrange(1 << 24)])
        header = struct.pack(">I", length)[1:] + bytes([rng.randrange(16), rng.randrange(256)])
        out += header + struct.pack(">I", rng.randrange(1 << 32)) + payload
    return out


def raw_one(port: int, kind: str, rng: random.Random) -> str:
    """One raw connection; how it ended (closed by the server, or not)."""
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
    except OSError as e:
        return f"connect failed: {e.__class__.__name__}"
    try:
        s.settimeout(3)
        if kind == "random":
            s.sendall(rng.randbytes(rng.randint(1, 8192)))
        elif kind == "preface-cut":
            s.sendall(H2_PREFACE[: rng.randrange(1, len(H2_PREFACE))])
        elif kind == "preface-then-garbage":
            s.sendall(H2_PREFACE + rng.randbytes(rng.randint(1, 2048)))
        elif kind == "frames":
            s.sendall(H2_PREFACE + _bad_frames(rng))
        elif kind == "reset":
            s.sendall(H2_PREFACE[:5])
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return "reset"
        try:
            while s.recv(65536):
                pass
            return "closed by server"
        except TimeoutError:
            return "held open"
        except OSError:
            return "reset by server"
    except OSError:
        return "reset by server"
    finally:
        s.close()


def raw_tcp(ports: dict[str, int], per_port: int, seed: int) -> dict[str, Counter]:
    rng = random.Random(seed)
    jobs = [
        (name, port, RAW_KINDS[i % len(RAW_KINDS)])
        for name, port in ports.items()
        for i in range(per_port)
    ]
    out: dict[str, Counter] = {name: Counter() for name in ports}
    with ThreadPoolExecutor(16) as pool:
        futures = [
            (name, pool.submit(raw_one, port, kind, random.Random(rng.random())))
            for name, port, kind in jobs
        ]
        for name, f in futures:
            out[name][f.result()] += 1
    return out


def quick_calls_answer(address: str, worker: str, timeout_s: float = 5.0) -> list[str]:
    """Problems: GetModelInfo (public) and GetInfo (worker) must answer at once."""
    problems = []
    with grpc.insecure_channel(address) as ch:
        m = next(x for x in public_methods() if x.name == "GetModelInfo")
        t0 = time.monotonic()
        code = call(ch, m, b"", timeout_s)
        if code != "OK":
            problems.append(f"GetModelInfo after the garbage: {code}")
        elif time.monotonic() - t0 > 1.0:
            problems.append(f"GetModelInfo took {time.monotonic() - t0:.1f} s")
    with grpc.insecure_channel(worker) as ch:
        m = next(x for x in worker_methods() if x.name == "GetInfo")
        code = call(ch, m, b"", timeout_s)
        if code != "OK":
            problems.append(f"worker GetInfo after the garbage: {code}")
    return problems
