"""Kills of every process kind under the gateway's load: the worker
(SIGKILL: serve restarts it), the core (SIGKILL: the API process restarts
it), the worker's span process, the grammar compile processes (a child
mid-compile, then the zygote), the worker stopped (SIGSTOP for longer than
the keepalive, then SIGCONT), and at the very end `radixserve serve`
itself (nothing of it may be left 2 s later).

Each returns its Row and, where the design answers some calls with an
error (the calls in flight when the core dies end UNAVAILABLE), the window
in which the background load's failures are excused."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
from hardening_floods import hard_schema
from hardening_load import Probe
from hardening_report import Row
from hardening_system import Deployment, read_proc, tagged
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

Window = tuple[float, float] | None
WORKER_STEP = "radixserve-worker/radixserve.worker.step"


def kill_worker(dep: Deployment, probe: Probe) -> tuple[Row, Window]:
    pid = dep.one("worker")
    os.kill(pid, signal.SIGKILL)
    seconds, refused = probe.until_served()
    new = dep.one("worker", 60)
    problems = [] if new != pid else ["the worker was not restarted"]
    if refused:
        problems.append(
            f"{refused} probe calls refused while the worker was away (a pause expected)"
        )
    row = Row(
        "kills",
        "SIGKILL the worker under load (serve restarts it; clients should see a pause)",
        f"served again {seconds:.1f} s after the kill (model load included); "
        f"probe refusals {refused}",
        not problems,
        problems,
        {"recovery_s": round(seconds, 2), "refused": refused},
    )
    return row, None


def kill_core(dep: Deployment, probe: Probe) -> tuple[Row, Window]:
    pid = dep.one("core")
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    seconds, refused = probe.until_served()
    new = dep.one("core", 30)
    problems = [] if new != pid else ["the core was not restarted"]
    row = Row(
        "kills",
        "SIGKILL the core process under load (the API process restarts it; calls in flight "
        "end UNAVAILABLE by design, excused)",
        f"served again {seconds:.1f} s after the kill; {refused} probe calls refused meanwhile",
        not problems,
        problems,
        {"recovery_s": round(seconds, 2), "refused": refused},
    )
    return row, (t0, time.monotonic() + 1.0)


def kill_span_process(dep: Deployment, probe: Probe, watch_s: float = 12.0) -> tuple[Row, Window]:
    problems = []
    t_before = time.time_ns()
    probe.once()  # steps of a traced request, whatever the gateway does
    time.sleep(3.0)  # the span process exports about every second
    if not dep.spans.since(WORKER_STEP, t_before):
        problems.append("no worker step spans arrived even before the kill")
    pid = dep.one("span")
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time_ns()
    time.sleep(1.0)
    t_after = time.time_ns()
    probe.once()
    deadline = time.monotonic() + watch_s
    while not dep.spans.since(WORKER_STEP, t_after) and time.monotonic() < deadline:
        time.sleep(0.5)
    spans_back = dep.spans.since(WORKER_STEP, t_after)
    if not spans_back:
        problems.append(
            f"no worker step span ended in the {watch_s:.0f} s after the span process was "
            "killed: the worker's tracing is gone until the worker restarts"
        )
    span_pids = dep.tree().pids("span")
    row = Row(
        "kills",
        "SIGKILL the worker's span process under load",
        f"worker serves on; step spans after the kill: {'yes' if spans_back else 'none'}; "
        f"span processes now {span_pids} (was {pid})",
        not problems,
        problems,
        {"spans_after_kill": spans_back, "killed_at_ns": t_kill},
    )
    return row, None


def _grammar_call(dep: Deployment, schema: str, out: dict, key: str) -> None:
    req = pb.GenerateRequest(
        request_id=f"grammar-{key}-{time.time_ns()}",
        tokenized=pb.TokenizedInput(input_ids=list(range(300, 330))),
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=8, json_schema=schema),
    )
    t0 = time.monotonic()
    try:
        list(dep.stub.Generate(req, timeout=120))
        out[key] = ("OK", time.monotonic() - t0, "")
    except grpc.RpcError as e:
        out[key] = (e.code().name, time.monotonic() - t0, e.details() or "")


def _wait_role(dep: Deployment, role: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = dep.tree().pids(role)
        if pids:
            return pids
        time.sleep(0.02)
    return []


def kill_grammar_processes(dep: Deployment, seed: int) -> tuple[Row, Window]:
    """A compile child mid-compile, then the zygote (and its children) with a
    compile running; then a new grammar must compile and serve."""
    problems, got = [], {}
    calls = []
    for step, role in enumerate(("compile-child", "zygote")):
        schema = hard_schema(seed * 100 + step, depth=9, width=4)
        t = threading.Thread(target=_grammar_call, args=(dep, schema, got, role))
        t.start()
        pids = _wait_role(dep, "compile-child", 20.0)
        victims = pids if role == "compile-child" else dep.tree().pids("zygote")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        t.join(150)
        calls.append((role, victims))
        if not victims:
            problems.append(f"no {role} process to kill (the compile was over first?)")
    after = hard_schema(seed * 100 + 7, depth=6, width=3)
    _grammar_call(dep, after, got, "after")
    code, _, details = got["after"]
    if code != "OK":
        problems.append(f"a new grammar after the kills: {code} {details[:120]}")
    for role in ("compile-child", "zygote"):
        c, _, d = got.get(role, ("none", 0, ""))
        if c in ("INTERNAL", "UNKNOWN", "none"):
            problems.append(f"the request whose {role} was killed: {c} {d[:120]}")
    answers = "; ".join(f"{k}: {v[0]} in {v[1]:.1f} s ({v[2][:90]})" for k, v in got.items())
    row = Row(
        "kills",
        "SIGKILL a grammar compile child mid-compile, then the compile zygote (its children "
        "die with it) with a compile running; then a new grammar",
        answers,
        not problems,
        problems,
        {k: list(v[:2]) for k, v in got.items()},
    )
    return row, None


def stop_worker(dep: Deployment, probe: Probe, stopped_s: float = 15.0) -> tuple[Row, Window]:
    pid = dep.one("worker")
    os.kill(pid, signal.SIGSTOP)
    time.sleep(stopped_s)
    os.kill(pid, signal.SIGCONT)
    seconds, refused = probe.until_served()
    problems = [] if dep.one("worker") == pid else ["the stopped worker was replaced"]
    if refused:
        problems.append(f"{refused} probe calls refused after SIGCONT")
    row = Row(
        "kills",
        f"SIGSTOP the worker for {stopped_s:.0f} s under load (longer than the 10 s keepalive), "
        "then SIGCONT",
        f"served again {seconds:.1f} s after SIGCONT; probe refusals {refused}",
        not problems,
        problems,
        {"recovery_after_cont_s": round(seconds, 2)},
    )
    return row, None


def kill_serve(dep: Deployment) -> Row:
    """SIGKILL `radixserve serve`; every process it started must be gone
    within 2 s."""
    before = tagged(dep.tag)
    roles = dep.tree().roles
    dep.serve.kill()
    dep.serve.wait()
    t0 = time.monotonic()
    left, gone = before, {}
    while time.monotonic() - t0 < 2.0:
        still = []
        for p in left:
            q = read_proc(p.pid)
            if q and q.state != "Z" and q.start == p.start:
                still.append(p)
            else:
                gone[f"{roles.get(p.pid, '?')}:{p.pid}"] = round(time.monotonic() - t0, 3)
        left = still
        if not left:
            break
        time.sleep(0.01)
    gone_s = time.monotonic() - t0
    problems = [f"still running 2 s later: {[p.cmdline[:60] for p in left]}"] if left else []
    return Row(
        "kills",
        f"SIGKILL radixserve serve itself ({len(before)} processes of it running)",
        f"the last one gone {gone_s:.2f} s after (each: {gone})"
        if not left
        else f"{len(left)} left",
        not problems,
        problems,
        {"processes": len(before), "gone_s": round(gone_s, 3), "each_s": gone},
    )
