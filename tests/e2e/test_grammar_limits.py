"""Grammar compiles through the public API (real worker and scheduler
processes, the simulated model): a grammar that did not compile in time, or
was refused for lack of room, is answered RESOURCE_EXHAUSTED and compiles
when asked again (no verdict remembered); each client (API key) has its own
bound on compiles waiting, and the worker's compile queue its own."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from protos import worker_pb2, worker_pb2_grpc
from tests.e2e.support.system import BIN, process
from tests.worker_service.support.grammar_load import TINY_SCHEMA, descendants, nested_schema, state

TIMEOUT_S = 3  # --grammar-compile-timeout
KEYS = ("alice-key", "bob-key")
WORKER = ["--model", "simulated", "--simulated-vocab", "1024", "--log-level", "warning"]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grammar_limits")
    keys = tmp / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    worker = [str(BIN / "radixserve-worker"), *WORKER, "--grammar-compile-queue", "3"]
    with process(tmp, "worker", worker) as wport:
        waddr = f"127.0.0.1:{wport}"
        (worker_pid,) = [
            p for p in descendants(os.getpid()) if str(tmp / "worker.port") in cmdline(p)
        ]
        # Start the compile processes before the short timeout applies.
        warm = compile_on_worker(waddr, "regex", "warm")
        assert not warm.error
        sched = [
            str(BIN / "radixserve-scheduler"),
            *("--worker", f"grpc://{waddr}", "--log-level", "warning"),
            *("--grammar-compile-timeout", str(TIMEOUT_S)),
            *("--grammar-compiles-per-client", "2", "--api-key-file", str(keys)),
        ]
        with process(tmp, "scheduler", sched) as port:
            yield f"127.0.0.1:{port}", waddr, worker_pid


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def compiling(worker_pid: int) -> list[int]:
    """Compile children at work (below the zygote, running or paused)."""
    zygotes = {p for p in descendants(worker_pid) if "grammar_zygote" in cmdline(p)}
    return [p for z in zygotes for p in descendants(z) if state(p) in ("R", "T")]


def compile_on_worker(address: str, kind: str, text: str) -> worker_pb2.CompileGrammarResponse:
    kinds = {
        "regex": worker_pb2.GRAMMAR_KIND_REGEX,
        "json_schema": worker_pb2.GRAMMAR_KIND_JSON_SCHEMA,
    }
    req = worker_pb2.CompileGrammarRequest(grammar=worker_pb2.Grammar(kind=kinds[kind], text=text))
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).CompileGrammar(req, timeout=120)


def constrained(rid: str, schema: str, max_new: int = 12) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=[7, 8, 9]),
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_new_tokens=max_new, json_schema=schema
        ),
    )


async def generate(address: str, key: str, req: pb.GenerateRequest) -> tuple[str, str]:
    """(status name, details or the output's text)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SglangSchedulerStub(channel)
        meta = (("authorization", f"Bearer {key}"),)
        try:
            out = [r async for r in stub.Generate(req, metadata=meta, timeout=60)]
        except grpc.aio.AioRpcError as e:
            return e.code().name, e.details()
    ids = out[-1].complete.output_ids
    return "OK", bytes(t for t in ids if t < 256).decode(errors="replace")


def test_a_grammar_that_timed_out_compiles_when_asked_again(system):
    address, worker, _ = system
    hard = nested_schema(300, "late_")  # 6 s and more to compile and serialize
    code, details = asyncio.run(generate(address, KEYS[0], constrained("t1", hard)))
    assert code == "RESOURCE_EXHAUSTED", details
    assert f"did not compile within {TIMEOUT_S} s" in details and "retry later" in details
    # Compiled meanwhile (as a quieter server would have): nothing remembered the timeout.
    assert not compile_on_worker(worker, "json_schema", hard).error
    code, text = asyncio.run(generate(address, KEYS[0], constrained("t2", hard, 30)))
    assert code == "OK", text
    assert '"late_299"' in text


async def _flood(address: str) -> dict[str, tuple[str, str]]:
    slow = {
        "alice-slow-0": (KEYS[0], nested_schema(400, "a0_")),
        "alice-slow-0-twin": (KEYS[0], nested_schema(400, "a0_")),  # one grammar, one count
        "alice-slow-1": (KEYS[0], nested_schema(400, "a1_")),
        "bob-slow": (KEYS[1], nested_schema(400, "b0_")),
    }
    tasks = {
        rid: asyncio.ensure_future(generate(address, key, constrained(rid, schema)))
        for rid, (key, schema) in slow.items()
    }
    await asyncio.sleep(0.8)  # all wait on the worker now (three compiles)
    out = {}
    t0 = time.monotonic()
    out["alice-tiny"] = await generate(address, KEYS[0], constrained("at", TINY_SCHEMA))
    out["bob-tiny"] = await generate(address, KEYS[1], constrained("bt", TINY_SCHEMA))
    out["refusals_s"] = ("", f"{time.monotonic() - t0:.3f}")
    for rid, task in tasks.items():
        out[rid] = await task
    out["alice-tiny-again"] = await generate(address, KEYS[0], constrained("at2", TINY_SCHEMA, 40))
    out["bob-tiny-again"] = await generate(address, KEYS[1], constrained("bt2", TINY_SCHEMA, 40))
    return out


def test_each_client_and_the_worker_bound_the_compiles_waiting(system):
    address, _, _ = system
    out = asyncio.run(_flood(address))
    code, details = out["alice-tiny"]  # alice has two compiles waiting already
    assert code == "RESOURCE_EXHAUSTED", details
    assert "too many grammars compiling for this client" in details and "retry later" in details
    code, details = out["bob-tiny"]  # bob has his own budget; the worker's queue is full
    assert code == "RESOURCE_EXHAUSTED", details
    assert "grammar compiles already waiting" in details and "--grammar-compile-queue" in details
    assert float(out["refusals_s"][1]) < 1.0  # both at once, not after a wait
    for rid in ("alice-slow-0", "alice-slow-0-twin", "alice-slow-1", "bob-slow"):
        code, details = out[rid]  # timed out: retry later
        assert code == "RESOURCE_EXHAUSTED" and "did not compile within" in details, out[rid]
    # Refusals are no verdicts: once there is room the same grammar compiles.
    for rid in ("alice-tiny-again", "bob-tiny-again"):
        code, text = out[rid]
        assert code == "OK" and '"t4242"' in text, out[rid]


async def _cancel_after(address: str, seconds: float, worker_pid: int) -> list[int]:
    task = asyncio.ensure_future(
        generate(address, KEYS[0], constrained("gone", nested_schema(400, "gone_")))
    )
    await asyncio.sleep(seconds)
    at_work = compiling(worker_pid)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return at_work


def test_a_client_that_leaves_stops_its_compile(system):
    address, _, worker_pid = system
    at_work = asyncio.run(_cancel_after(address, 1.0, worker_pid))
    assert len(at_work) == 1
    t0 = time.monotonic()
    while compiling(worker_pid) and time.monotonic() - t0 < 1.0:
        time.sleep(0.02)
    assert not compiling(worker_pid), "the compile outlived its only request"
    assert time.monotonic() - t0 < 1.0  # long before --grammar-compile-timeout
