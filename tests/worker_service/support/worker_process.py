"""Real worker processes for tests: spawned with `python -m worker_service`,
reached over gRPC on a loopback port."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc


def free_port() -> int:
    """A loopback port free now (a --dist-addr for the ranks to meet on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProc:
    """A worker process; ``address()`` waits until it serves."""

    def __init__(self, tmp_path: Path, args: tuple[str, ...], name: str) -> None:
        self.port_file = tmp_path / f"{name}.port"
        self.log_path = tmp_path / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        cmd = [sys.executable, "-m", "worker_service", "--port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, "--port-file", str(self.port_file), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def address(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while not self.port_file.exists() or not self.port_file.read_text():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited: {self.log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker did not start: {self.log_path.read_text()}")
            time.sleep(0.1)
        return f"127.0.0.1:{self.port_file.read_text()}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@contextmanager
def worker_processes(tmp_path: Path, *arg_lists: tuple[str, ...]) -> Iterator[list[str]]:
    """Start several workers at once (tensor-parallel ranks wait for each
    other), yield their addresses, stop them after."""
    procs = [WorkerProc(tmp_path, args, f"w{i}") for i, args in enumerate(arg_lists)]
    try:
        yield [p.address() for p in procs]
    finally:
        for p in procs:
            p.stop()


@contextmanager
def worker_process(tmp_path: Path, *args: str, name: str = "w") -> Iterator[str]:
    """Start one worker, yield its address once it serves, stop it after."""
    proc = WorkerProc(tmp_path, args, name)
    try:
        yield proc.address()
    finally:
        proc.stop()


def next_epoch() -> int:
    """A session epoch above every one handed out before (in this process)."""
    return time.time_ns()


class PlanStream:
    """One Execute stream, opened as a session (the worker acknowledges it):
    send a plan, get its result."""

    def __init__(self, address: str, session_id: str = "test", epoch: int | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self._plans: queue.Queue = queue.Queue()
        opening = pb.SessionOpen(session_id=session_id, epoch=epoch or next_epoch())
        self._plans.put(pb.StepPlan(session=opening))
        self._results = self.stub.Execute(iter(self._plans.get, None))
        assert next(self._results) == pb.StepResult()  # the session is open

    def send(self, plan: pb.StepPlan) -> None:
        self._plans.put(plan)

    def receive(self) -> pb.StepResult:
        return next(self._results)

    def run(self, plan: pb.StepPlan) -> pb.StepResult:
        self.send(plan)
        return self.receive()

    def close(self) -> None:
        self._plans.put(None)
        self.channel.close()


def greedy_over_grpc(
    streams: list[PlanStream],
    prompts: list[list[int]],
    steps: int,
    page_size: int,
    adapter_slots: list[int] | None = None,
    assign: list[tuple[int, str]] = (),
) -> list[list[int]]:
    """Prefill every prompt in one plan, then decode them together; every
    stream (rank) gets the same plans, the first one's tokens are returned.
    LoRA: ``assign`` (adapter slot, name) rides on the first plan and prompt i
    joins through adapter slot ``adapter_slots[i]`` (0: base model)."""
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
    plan = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
    for slot, name in assign:
        plan.adapter_slots.add(slot=slot, name=name)
    next_page = 0
    tables: list[list[int]] = []
    for slot, prompt in enumerate(prompts):
        n_pages = -(-len(prompt) // page_size)
        table = list(range(next_page, next_page + n_pages))
        next_page += n_pages
        tables.append(table)
        plan.joins.add(
            slot=slot,
            rid=f"r{slot}",
            sampling=greedy,
            prompt_len=len(prompt),
            adapter_slot=adapter_slots[slot] if adapter_slots else 0,
        )
        plan.extends.add(slot=slot, start_pos=0, input_ids=prompt, new_pages=table, sample=True)
    outputs: list[list[int]] = [[] for _ in prompts]
    kv = [len(p) for p in prompts]
    for step in range(steps):
        for s in streams:  # every rank must have the plan before any can finish it
            s.send(plan)
        results = [s.receive() for s in streams]
        for r in results:
            assert not r.error, r.error
        for slot, token in zip(results[0].slots, results[0].token_ids, strict=True):
            outputs[slot].append(token)
        plan = pb.StepPlan(step_id=step + 2, mode=pb.FORWARD_MODE_DECODE)
        for slot in range(len(prompts)):
            plan.decode_slots.append(slot)
            plan.decode_positions.append(kv[slot])
            if kv[slot] % page_size == 0:
                tables[slot].append(next_page)
                plan.decode_new_pages.append(next_page + 1)
                next_page += 1
            else:
                plan.decode_new_pages.append(0)
            kv[slot] += 1
    return outputs


def greedy_on_two_gloo_ranks(
    tmp_path: Path, prompts: list[list[int]], steps: int, *, page_size: int = 16
) -> list[list[int]]:
    """The model in ``tmp_path`` on two tensor-parallel worker processes
    (gloo), one KV pool (greedy_over_grpc's plans carry no sliding pages; two
    pools on two ranks: test_swa_grpc.py): each prompt's greedy tokens."""
    common = (
        *("--model", str(tmp_path), "--page-size", str(page_size), "--num-pages", "64"),
        *("--threads", "1", "--no-swa-memory"),
    )
    tp = ("--tp-size", "2", "--dist-addr", f"127.0.0.1:{free_port()}")
    ranks = [(*common, *tp, "--tp-rank", str(r)) for r in (0, 1)]
    with worker_processes(tmp_path, *ranks) as addresses:
        streams = [PlanStream(a) for a in addresses]
        try:
            return greedy_over_grpc(streams, prompts, steps, page_size)
        finally:
            for s in streams:
                s.close()
