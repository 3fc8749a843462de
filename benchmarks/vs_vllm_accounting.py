"""vs_vllm.py's accounting: CPU seconds per process of each server, radixserve's
step figures from its Prometheus metrics, and py-spy profiles of its worker
and core."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from vs_vllm_servers import BIN, Server


@contextmanager
def py_spy(pids: dict[str, int], seconds: float, out: Path, tag: str) -> Iterator[None]:
    """py-spy samples (collapsed stacks, "raw") of ``pids`` for ``seconds``; on
    exit, each process's busiest functions are printed (inclusive share of
    the samples; idle threads are not sampled, so samples / (rate x seconds)
    is the busy fraction of one thread's worth)."""
    exe = shutil.which("py-spy") or str(BIN / "py-spy")
    procs = {}
    for name, pid in pids.items():
        dest = out / f"{tag}-{name}.pyspy.txt"
        cmd = [exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", str(SPY_RATE)]
        cmd += ["-f", "raw", "-o", str(dest), "--nonblocking"]
        procs[name] = (
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            dest,
        )
    try:
        yield
    finally:
        for name, (p, dest) in procs.items():
            try:
                p.wait(timeout=seconds + 30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if dest.exists():
                print(profile_summary(name, dest, seconds), flush=True)


SPY_RATE = 100


def profile_summary(name: str, path: Path, seconds: float, top: int = 25) -> str:
    """The functions that most samples were inside (inclusive), from py-spy's
    collapsed stacks ("frame;frame;... count")."""
    total = 0
    inclusive: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        for frame in set(stack.split(";")):
            inclusive[frame] = inclusive.get(frame, 0) + n
    lines = [f"-- {name}: {total} samples, {total / (SPY_RATE * seconds):.2f} busy threads"]
    for frame, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / max(total, 1):6.1f}%  {frame[:150]}")
    return "\n".join(lines)


def _group_processes(pgids: Sequence[int]) -> Iterator[tuple[int, str]]:
    """(pid, command line) of every process in the process groups ``pgids``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgid = os.getpgid(int(entry.name))
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
        if pgid in pgids:
            yield int(entry.name), argv


def role(argv: str) -> str:
    """A process's part, from its command line."""
    for key, name in (
        ("worker_service", "worker"),
        ("resource_tracker", "other"),
        ("spawn_main", "core"),
        ("radixserve serve", "api"),
        ("smg", "gateway"),
        ("EngineCore", "vllm-engine"),
        ("vllm", "vllm-api"),
    ):
        if key in argv:
            return name
    return "other"


def radixserve_pids(server: Server) -> dict[str, int]:
    """The worker and core processes under `radixserve serve`."""
    found = {}
    for pid, argv in _group_processes([server.procs[0].pid]):
        name = role(argv)
        if name in ("worker", "core"):
            found[name] = pid
    return found


def cpu_seconds(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each part of ``server``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid, argv in _group_processes(server.groups()):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        name = role(argv)
        # vLLM's engine core renames itself (its /proc comm), not its argv.
        comm = (
            Path(f"/proc/{pid}/comm").read_text().strip()
            if Path(f"/proc/{pid}/comm").exists()
            else ""
        )
        if comm.startswith("VLLM::"):  # vLLM names its processes (EngineCore, Worker)
            name = comm.lower().replace("::", "-")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def scrape(server: Server) -> dict[str, float]:
    """radixserve's step accounting so far: per forward mode the steps and
    their seconds, the worker's busy and idle seconds, the drafts."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for url in server.metrics_urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name.startswith("radixserve_worker_step_duration_seconds_"):
                    kind = name.rsplit("_", 1)[1]
                    if kind in ("sum", "count"):
                        out[f"{labels['mode']}_{kind}"] = sample.value
                elif name in (
                    "radixserve_worker_busy_seconds_total",
                    "radixserve_worker_idle_seconds_total",
                    "radixserve_spec_verify_steps_total",
                    "radixserve_spec_draft_tokens_total",
                    "radixserve_spec_accepted_tokens_total",
                ):
                    out[name.removeprefix("radixserve_").removesuffix("_total")] = sample.value
    return out


def steps_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What one run added: steps and mean milliseconds per mode, busy / idle s, drafts."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    out: dict[str, float] = {}
    for mode in ("prefill", "decode", "mixed", "idle"):
        n = d.get(f"{mode}_count", 0.0)
        if n:
            out[f"{mode}_steps"] = n
            out[f"{mode}_s"] = round(d[f"{mode}_sum"], 2)
            out[f"{mode}_ms_mean"] = round(1000 * d[f"{mode}_sum"] / n, 1)
    for k in ("worker_busy_seconds", "worker_idle_seconds"):
        out[k] = round(d.get(k, 0.0), 2)
    for k in ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens"):
        out[k] = d.get(k, 0.0)
    return out
