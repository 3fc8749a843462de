"""radixserve behind the SMG gateway against vLLM's OpenAI server, measured
with vLLM's own client (`vllm bench serve`), as a user would (issue 30).

Starts `radixserve serve --model DIR` with `smg` in front of it, and vLLM's
OpenAI server (`../shared/peers/vllm_cpu.sh serve DIR PORT`), or takes their
URLs. For each load it runs `vllm bench serve` (the peer venv's) against the
gateway and against vLLM alternately (which server goes first alternates
too), ``--runs`` times, a fresh seed per run (both servers get the run's
prompts, no run repeats an earlier run's), with the servers' default
sampling (no temperature sent: both default to 1.0 for this model), and
parses each run's `--save-result` JSON. It prints per-load medians of output
tokens/s, TPOT p50 and TTFT p50 for each server, radixserve / vLLM ratios of
the medians with the per-run ranges, and a final JSON line.

Loads (vLLM bench's datasets; EOS ends a request as vllm bench serve sends
them, unless --ignore-eos: then every request runs to its length, the
requests of a wave finish together and the next wave prefills alone):

- sharedC: prefix_repetition, 4 prefixes of 256 tokens, 32-token suffixes,
  64 out, C in flight (3 C prompts);
- randomC: random 384 +- 33% in, 64 +- 33% out, C in flight (3 C prompts);
- single: random 384 in, 64 out, one stream (4 prompts);
- chat: real text through /v1/chat/completions (vLLM's custom dataset), EOS
  honoured, up to 128 out, temperature --chat-temperature, 16 in flight:
  by default passages of the Python reference text the standard library
  ships (pydoc_data.topics) with a question, drawn fresh per run; or a
  fixed JSONL of {"prompt": ...} lines (--chat-jsonl).

``--direct-vs-gateway LOAD...`` sizes the gateway: the same radixserve,
`radixserve-bench` (greedy, EOS ignored) straight to its gRPC port and
through the gateway's /v1/completions, alternating, fresh seeds.

``--profile-worker SECONDS`` records py-spy profiles of the worker and the
core process during radixserve's first run of each load (py-spy must be on
PATH or beside this Python; the files land in --out).

Examples (from the repository root):

    M=$(bash ../shared/peers/vllm_cpu.sh model)
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads shared16 random16 single
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads shared16 \\
        --radixserve-args="--no-speculative-ngram"
    python benchmarks/vs_vllm.py --model $M --runs 2 --loads --direct-vs-gateway random16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parent.parent
PEERS_HOME = Path(os.environ.get("PEERS_HOME", Path.home() / ".cache" / "radixserve-peers"))
VLLM_SCRIPT = ROOT.parent / "shared" / "peers" / "vllm_cpu.sh"
SERVERS = ("radixserve", "vllm")
FIGURES = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")


@dataclass(frozen=True)
class Load:
    name: str
    bench_args: tuple[str, ...]
    concurrency: int
    chat: bool = False


def make_load(name: str, chat_jsonl: str | None, chat_temperature: float) -> Load:
    """A load by name: shared16, random32, single, chat, ..."""
    if name == "single":
        args = ("--dataset-name", "random", "--random-input-len", "384")
        args += ("--random-output-len", "64", "--random-range-ratio", "0", "--num-prompts", "4")
        return Load(name, args, 1)
    if name == "chat":
        # The prompt goes as the user message; the server applies the template.
        args = ("--dataset-name", "custom", "--num-prompts", "48", "--skip-chat-template")
        args += ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
        args += ("--temperature", str(chat_temperature), "--custom-output-len", "128")
        if chat_jsonl:
            args += ("--dataset-path", chat_jsonl)
        return Load(name, args, 16, chat=True)
    for prefix in ("shared", "random"):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            c = int(name[len(prefix) :])
            if prefix == "shared":
                args = ("--dataset-name", "prefix_repetition")
                args += ("--prefix-repetition-num-prefixes", "4")
                args += ("--prefix-repetition-prefix-len", "256")
                args += ("--prefix-repetition-suffix-len", "32")
                args += ("--prefix-repetition-output-len", "64")
            else:
                args = ("--dataset-name", "random", "--random-input-len", "384")
                args += ("--random-output-len", "64", "--random-range-ratio", "0.33")
            return Load(name, (*args, "--num-prompts", str(3 * c)), c)
    raise SystemExit(f"unknown load {name!r}: sharedN, randomN, single or chat")


QUESTIONS = (
    "Summarize the passage above in three sentences.",
    "What is the main point of the passage above, and why does it matter?",
    "Explain the passage above to someone new to Python.",
    "List the key terms the passage above defines, with a short definition each.",
    "Write one example that illustrates the passage above, and explain it.",
)


def write_chat_prompts(path: Path, n: int, seed: int, max_chars: int = 1400) -> Path:
    """``n`` chat prompts of real prose nobody here wrote: consecutive
    paragraphs of the Python language reference's topic texts as the
    standard library ships them (``pydoc_data.topics``), up to ``max_chars``
    (about 300 tokens), then a question. The seed picks the passages, so
    each run's prompts are fresh."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    paragraphs = [
        [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80]
        for _, text in sorted(topics.items())
    ]
    paragraphs = [ps for ps in paragraphs if ps]
    with open(path, "w") as f:
        for _ in range(n):
            ps = rng.choice(paragraphs)
            start = end = rng.randrange(len(ps))
            size = len(ps[start])
            # Forward from a random paragraph, then back when the topic ends.
            while end + 1 < len(ps) and size + len(ps[end + 1]) < max_chars:
                end += 1
                size += len(ps[end])
            while start > 0 and size + len(ps[start - 1]) < max_chars:
                start -= 1
                size += len(ps[start])
            text = "\n\n".join(ps[start : end + 1])[:max_chars] + "\n\n"
            f.write(json.dumps({"prompt": text + rng.choice(QUESTIONS)}) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_models(base: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until GET /v1/models lists a model (the process must stay alive)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                if json.loads(r.read()).get("data"):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{log} did not get ready:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def probe_completion(base: str, model: str, timeout_s: float) -> None:
    """One small completion (the gateway fetches the unit's tokenizer after it
    lists the model: until then completions fail)."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(
            base + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                return
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@dataclass
class Server:
    name: str
    base_url: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    grpc_address: str | None = None
    metrics_urls: tuple[str, ...] = ()  # the scheduler's, then the worker's
    pgids: tuple[int, ...] = ()  # its process groups (started here: its own)

    def groups(self) -> list[int]:
        return list(self.pgids) or [p.pid for p in self.procs]

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def _popen(cmd: Sequence[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 (the child holds it)
    # Its own process group: stopped as a whole, children included.
    return subprocess.Popen(
        list(cmd), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(procs: Sequence[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextmanager
def radixserve(model: str, extra: Sequence[str], tmp: Path) -> Iterator[Server]:
    """`radixserve serve` and `smg` in front of it; both stopped on exit."""
    port_file = tmp / "radixserve.port"
    port_file.unlink(missing_ok=True)  # an earlier run's
    cmd = [str(BIN / "radixserve"), "serve", "--model", model, "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--port-file", str(port_file)]
    cmd += ["--served-model-name", Path(model).name, "--log-level", "warning", *extra]
    metrics = free_port()  # the worker serves its metrics on the next port
    cmd += ["--metrics-port", str(metrics)]
    procs = [_popen(cmd, tmp / "radixserve.log")]
    try:
        deadline = time.monotonic() + 600
        while not (port_file.exists() and port_file.read_text().strip()):
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise SystemExit((tmp / "radixserve.log").read_text()[-3000:])
            time.sleep(0.5)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        port = free_port()
        gw = [str(BIN / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        gw += ["--worker-urls", f"grpc://{address}"]
        gw += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        gw += ["--worker-startup-check-interval", "1", "--log-level", "warn"]
        gw += ["--shutdown-grace-period-secs", "0"]
        procs.append(_popen(gw, tmp / "smg.log"))
        base = f"http://127.0.0.1:{port}"
        wait_models(base, procs[1], tmp / "smg.log", 120)
        probe_completion(base, Path(model).name, 120)
        urls = (f"http://127.0.0.1:{metrics}/metrics", f"http://127.0.0.1:{metrics + 1}/metrics")
        yield Server("radixserve", base, procs, address, urls)
    finally:
        stop(procs)


@contextmanager
def vllm(model: str, extra: Sequence[str], tmp: Path) -> Iterator[Server]:
    """vLLM's OpenAI server (the peer script); stopped on exit."""
    port = free_port()
    cmd = ["bash", str(VLLM_SCRIPT), "serve", model, str(port), *extra]
    procs = [_popen(cmd, tmp / "vllm.log")]
    try:
        base = f"http://127.0.0.1:{port}"
        wait_models(base, procs[0], tmp / "vllm.log", 900)  # its first start compiles
        yield Server("vllm", base, procs)
    finally:
        stop(procs)


def vllm_bench(
    server: Server,
    load: Load,
    seed: int,
    model: str,
    out: Path,
    *,
    ignore_eos: bool,
    num_prompts: int | None = None,
) -> dict:
    """One `vllm bench serve` run; its saved result."""
    name = f"{load.name}-{server.name}-seed{seed}.json"
    cmd = [str(PEERS_HOME / "vllm-cpu" / "bin" / "vllm"), "bench", "serve"]
    cmd += ["--base-url", server.base_url, "--model", Path(model).name, "--tokenizer", model]
    cmd += list(load.bench_args) + ["--max-concurrency", str(load.concurrency)]
    cmd += ["--seed", str(seed), "--save-result", "--result-dir", str(out)]
    cmd += ["--result-filename", name, "--disable-tqdm"]
    cmd += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
    if ignore_eos and not load.chat:
        cmd.append("--ignore-eos")
    if load.chat and "--dataset-path" not in cmd:
        prompts = write_chat_prompts(out / f"chat-seed{seed}.jsonl", 64, seed)
        cmd += ["--dataset-path", str(prompts)]
    if num_prompts is not None:
        i = cmd.index("--num-prompts")
        cmd[i + 1] = str(num_prompts)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    log = out / (name[:-5] + ".log")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        raise SystemExit(f"vllm bench serve failed ({rc}):\n{log.read_text()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads((out / name).read_text())
    result["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def figures(result: dict) -> dict[str, float]:
    return {
        "output_tok_s": float(result["output_throughput"]),
        "tpot_p50_ms": float(result["median_tpot_ms"]),
        "ttft_p50_ms": float(result["median_ttft_ms"]),
        "completed": float(result["completed"]),
        "output_tokens": float(result["total_output_tokens"]),
        "duration_s": float(result["duration"]),
        "client_cpu_s": float(result["client_cpu_s"]),
    }


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


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict:
    """Per-server medians, ratios of the medians, per-run ratio ranges."""
    out: dict = {}
    for s in SERVERS:
        out[s] = {f: statistics.median(r[f] for r in runs[s]) for f in FIGURES}
    ratio, ranges = {}, {}
    for f in FIGURES:
        b = out["vllm"][f]
        ratio[f] = out["radixserve"][f] / b if b else math.nan
        per = [a[f] / b[f] for a, b in zip(runs["radixserve"], runs["vllm"], strict=True) if b[f]]
        ranges[f] = [min(per), max(per)] if per else []
    out["ratio"] = ratio
    out["ratio_range"] = ranges
    return out


def print_load(name: str, runs: dict[str, list[dict[str, float]]], summary: dict) -> None:
    print(f"\n== {name} ({len(runs['vllm'])} runs per server; ratio = radixserve / vLLM)")
    print(f"{'figure':<14}{'radixserve':>12}{'vLLM':>12}{'ratio':>9}  per-run range / values")
    for f in FIGURES:
        lo, hi = summary["ratio_range"][f] or (math.nan, math.nan)
        rs = ", ".join(f"{r[f]:.1f}" for r in runs["radixserve"])
        vl = ", ".join(f"{r[f]:.1f}" for r in runs["vllm"])
        print(
            f"{f:<14}{summary['radixserve'][f]:>12.1f}{summary['vllm'][f]:>12.1f}"
            f"{summary['ratio'][f]:>8.2f}x  {lo:.2f}-{hi:.2f}  [rs {rs} | vllm {vl}]"
        )
    sys.stdout.flush()


def run_loads(args: argparse.Namespace, servers: dict[str, Server], out: Path) -> dict:
    results: dict = {}
    for li, name in enumerate(args.loads):
        load = make_load(name, args.chat_jsonl, args.chat_temperature)
        for s in SERVERS if li == 0 else ():  # the first requests pay one-off costs
            vllm_bench(
                servers[s],
                load,
                10_000 + li,
                args.model,
                out,
                ignore_eos=True,
                num_prompts=max(4, load.concurrency // 2),
            )
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SERVERS}
        for i in range(args.runs):
            seed = args.seed + 100 * li + i
            order = SERVERS if (i + li) % 2 == 0 else SERVERS[::-1]
            for s in order:
                with ExitStack() as stack:
                    if s == "radixserve" and i == 0 and args.profile_worker:
                        pids = radixserve_pids(servers[s])
                        stack.enter_context(py_spy(pids, args.profile_worker, out, name))
                        print(f"profiling {pids} for {args.profile_worker}s", flush=True)
                    cpu0 = cpu_seconds(servers[s])
                    steps0 = scrape(servers[s]) if servers[s].metrics_urls else {}
                    r = figures(
                        vllm_bench(
                            servers[s], load, seed, args.model, out, ignore_eos=args.ignore_eos
                        )
                    )
                    cpu1 = cpu_seconds(servers[s])
                    if servers[s].metrics_urls:
                        r["steps"] = steps_delta(steps0, scrape(servers[s]))
                r["cpu_s"] = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu1.items()}
                r["cpu_s"]["bench-client"] = round(r.pop("client_cpu_s"), 1)
                runs[s].append(r)
                print(f"{name} run {i} {s}: " + json.dumps(r), flush=True)
        summary = summarize(runs)
        print_load(name, runs, summary)
        results[name] = {"runs": runs, **summary}
    return results


def radixserve_bench(
    server: Server, load: str, seed: int, model: str, out: Path, *, gateway: bool
) -> dict[str, float]:
    """One radixserve-bench run of ``load`` (greedy, EOS ignored), straight to
    the gRPC port or through the gateway."""
    c = int("".join(ch for ch in load if ch.isdigit()) or 1)
    if load.startswith("shared"):
        w = ["--dataset", "generated-shared-prefix", "--gsp-num-groups", "4"]
        w += ["--gsp-prompts-per-group", str(3 * c // 4), "--gsp-system-prompt-len", "256"]
        w += ["--gsp-question-len", "32", "--gsp-output-len", "64"]
    else:
        w = ["--dataset", "random", "--num-prompts", str(3 * c), "--random-input-len", "384"]
        w += ["--random-output-len", "64", "--random-range-ratio", "1"]
    path = out / f"direct-{load}-{'gateway' if gateway else 'grpc'}-seed{seed}.json"
    cmd = [str(BIN / "radixserve-bench"), *w, "--max-concurrency", str(c), "--seed", str(seed)]
    cmd += ["--tokenizer", model, "--no-progress", "--output-json", str(path)]
    if gateway:
        cmd += ["--backend", "openai", "--base-url", server.base_url, "--model", Path(model).name]
    else:
        cmd += ["--address", str(server.grpc_address)]
    steps0 = scrape(server) if server.metrics_urls else {}
    cpu0 = cpu_seconds(server)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: round(v - cpu0.get(k, 0.0), 1) for k, v in cpu_seconds(server).items()}
    cpu["bench-client"] = round(
        (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), 1
    )
    s = next(iter(json.loads(path.read_text())["results"].values()))
    return {
        "output_tok_s": s["output_tokens_per_s"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "input_tokens": s["input_tokens"],
        "cached_tokens": s["cached_tokens"],
        "steps": steps_delta(steps0, scrape(server)) if server.metrics_urls else {},
        "cpu_s": cpu,
    }


def direct_vs_gateway(args: argparse.Namespace, server: Server, out: Path) -> dict:
    results = {}
    for li, load in enumerate(args.direct_vs_gateway):
        runs: dict[str, list[dict[str, float]]] = {"grpc": [], "gateway": []}
        for i in range(args.runs):
            for j, gw in enumerate((False, True) if i % 2 == 0 else (True, False)):
                seed = args.seed + 5000 + 100 * li + 2 * i + j
                r = radixserve_bench(server, load, seed, args.model, out, gateway=gw)
                runs["gateway" if gw else "grpc"].append(r)
                print(f"direct {load} run {i} {'gateway' if gw else 'grpc'}: {r}", flush=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in FIGURES} for k, v in runs.items()}
        ratio = {f: med["gateway"][f] / med["grpc"][f] for f in FIGURES}
        print(f"\n== {load}: through the gateway / straight to gRPC (radixserve-bench, greedy)")
        for f in FIGURES:
            print(f"{f:<14}{med['grpc'][f]:>10.1f}{med['gateway'][f]:>10.1f}{ratio[f]:>8.2f}x")
        results[load] = {"runs": runs, "median": med, "gateway_over_grpc": ratio}
    return results


def markdown(reports: Sequence[Path]) -> str:
    """Saved reports (report.json) as one markdown table, a row per load."""
    rows = ["| load | radixserve args | output tok/s (ratio, range) | TPOT p50 ms | TTFT p50 ms |"]
    rows.append("|---|---|---|---|---|")
    for path in reports:
        report = json.loads(Path(path).read_text())
        for name, r in report["loads"].items():
            rs, vl, ratio, rng = r["radixserve"], r["vllm"], r["ratio"], r["ratio_range"]
            cells = []
            for f, fmt in (
                ("output_tok_s", "{:.1f}"),
                ("tpot_p50_ms", "{:.0f}"),
                ("ttft_p50_ms", "{:.0f}"),
            ):
                lo, hi = rng[f]
                pair = f"{fmt.format(rs[f])} vs {fmt.format(vl[f])}"
                cells.append(f"{pair}: **{ratio[f]:.2f}x** ({lo:.2f}-{hi:.2f})")
            args = report.get("radixserve_args") or "defaults"
            rows.append(f"| {name} | `{args}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=str(PEERS_HOME / "smollm2-135m-instruct-f32"),
        help="an HF directory both servers load (vllm_cpu.sh model)",
    )
    p.add_argument("--loads", nargs="*", default=["shared16", "random16", "single"])
    p.add_argument("--runs", type=int, default=2, help="runs per load and server")
    p.add_argument(
        "--seed",
        type=int,
        default=int(time.time()) % 100_000,
        help="first run's seed (fresh prompts: every run adds to it)",
    )
    p.add_argument("--radixserve-args", default="", help="more `radixserve serve` flags")
    p.add_argument("--vllm-args", default="", help="more vLLM server flags")
    p.add_argument("--gateway-url", help="a running gateway in front of radixserve")
    p.add_argument("--grpc-address", help="that radixserve's gRPC address (--direct-vs-gateway)")
    p.add_argument("--vllm-url", help="a running vLLM OpenAI server")
    p.add_argument(
        "--vllm-pgid",
        type=int,
        nargs="*",
        default=[],
        help="its process group (for the CPU figures)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="synthetic loads run to their output length (default: EOS ends a request, as "
        "vllm bench serve does; the finishes then spread and arrivals meet running decodes)",
    )
    p.add_argument("--chat-jsonl", help="the chat load's prompts (JSONL, {'prompt': ...})")
    p.add_argument("--chat-temperature", type=float, default=0.8)
    p.add_argument(
        "--direct-vs-gateway",
        nargs="*",
        default=[],
        help="loads (sharedN, randomN) run by radixserve-bench to gRPC and gateway",
    )
    p.add_argument(
        "--profile-worker",
        type=float,
        default=0.0,
        help="py-spy the worker and core for this many seconds of the first run",
    )
    p.add_argument("--out", help="where results and logs go (default: a new temp dir)")
    p.add_argument("--markdown", nargs="+", metavar="REPORT", help="print saved reports as a table")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    # SIGTERM unwinds like Ctrl-C, so the servers started here stop too.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    out = Path(args.out or tempfile.mkdtemp(prefix="vs-vllm-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"results and logs in {out}; seed {args.seed}", flush=True)
    with ExitStack() as stack:
        if args.gateway_url:
            rs = Server("radixserve", args.gateway_url, grpc_address=args.grpc_address)
        else:
            rs = stack.enter_context(radixserve(args.model, shlex.split(args.radixserve_args), out))
        servers = {"radixserve": rs}
        if args.loads:
            if args.vllm_url:
                servers["vllm"] = Server("vllm", args.vllm_url, pgids=tuple(args.vllm_pgid))
            else:
                servers["vllm"] = stack.enter_context(
                    vllm(args.model, shlex.split(args.vllm_args), out)
                )
        report: dict = {"seed": args.seed, "radixserve_args": args.radixserve_args}
        # Both servers stay up: what each burns while the other is measured.
        before = {n: cpu_seconds(s) for n, s in servers.items() if s.groups()}
        time.sleep(5)
        idle = {
            n: sum(cpu_seconds(servers[n]).values()) - sum(c.values()) for n, c in before.items()
        }
        report["idle_cpu_fraction"] = {n: round(v / 5, 3) for n, v in idle.items()}
        print(f"idle CPU (cores busy while idle): {report['idle_cpu_fraction']}", flush=True)
        report["loads"] = run_loads(args, servers, out) if args.loads else {}
        if args.direct_vs_gateway:
            report["direct_vs_gateway"] = direct_vs_gateway(args, rs, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
