"""The hardening round, as an outsider would run it (issue 27).

Starts, on loopback: an OTLP receiver, `radixserve serve` with the default
model (real weights, --metrics-port, tracing to the receiver) and the SMG
gateway in front of it. A background load of greedy chat completions
through the gateway runs the whole time; every answer is checked (status,
and the same text as the prompt's undisturbed answer). Then phase after
phase:

- garbage on both planes: random and mutated bodies to every public and
  every worker method, raw TCP garbage to the public, worker and /metrics
  ports;
- kills of every process kind under load: the worker, the core, the
  worker's span process, the grammar compile processes, the worker stopped
  (SIGSTOP/SIGCONT), and `radixserve serve` itself at the end;
- floods of every expensive request kind while a plain greedy Generate is
  timed against its quiet latency (benchmarks/hardening_floods.py,
  hardening_lora.py).

After each phase the load pauses and nothing may have leaked: GetServerInfo
queued_requests and core_requests 0, the KV pages back after a flush,
readiness SERVING, both /metrics answering, no stray or zombie process;
the processes' RSS is compared at the end. Every row says what was tried
and whether it held; the table follows, and the last line is a JSON
summary. Exit status 1 if anything did not hold.

    PYTHONPATH=$PWD python benchmarks/hardening_round.py            # ~25 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/hardening_round.py --phases kill-span,grammars
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import hardening_garbage as garbage
import hardening_kills as kills
from hardening_checks import check_clean, rss_growth
from hardening_floods import floods
from hardening_load import GatewayLoad, Probe
from hardening_lora import lora_flood
from hardening_report import Row, show, summary, table
from hardening_system import Deployment


def garbage_row(dep: Deployment, where: str, per_method: int, seed: int) -> Row:
    worker = f"127.0.0.1:{dep.worker_port()}"
    ms = garbage.public_methods() if where == "public" else garbage.worker_methods()
    t0 = time.monotonic()
    codes = garbage.garbage_calls(
        dep.address if where == "public" else worker, ms, per_method, seed
    )
    wall = time.monotonic() - t0
    problems = garbage.bad_codes(codes) + garbage.quick_calls_answer(dep.address, worker)
    total = sum(sum(c.values()) for c in codes.values())
    service = "SglangScheduler" if where == "public" else "radixserve.worker.v1.Worker"
    return Row(
        "garbage",
        f"{total} random or mutated bodies to the {len(ms)} methods of {service} "
        f"({per_method} each, fewer for never-ending streams), 16 at a time",
        f"in {wall:.0f} s; codes: " + "; ".join(f"{m}: {dict(c)}" for m, c in codes.items()),
        not problems,
        problems,
        {"calls": total, "codes": {m: dict(c) for m, c in codes.items()}},
    )


def raw_row(dep: Deployment, per_port: int, seed: int) -> Row:
    ports = {
        "public": int(dep.address.rsplit(":", 1)[1]),
        "worker": dep.worker_port(),
        "scheduler /metrics": dep.metrics_port,
        "worker /metrics": dep.worker_metrics_port,
    }
    t0 = time.monotonic()
    out = garbage.raw_tcp(ports, per_port, seed)
    wall = time.monotonic() - t0
    problems = garbage.quick_calls_answer(dep.address, f"127.0.0.1:{ports['worker']}")
    problems += dep.metrics_answer()
    return Row(
        "garbage",
        f"{per_port * len(ports)} raw TCP connections to the public, worker and both /metrics "
        f"ports ({', '.join(garbage.RAW_KINDS)})",
        f"in {wall:.0f} s; " + "; ".join(f"{p}: {dict(c)}" for p, c in out.items()),
        not problems,
        problems,
        {"connections": per_port * len(ports)},
    )


def phases(dep: Deployment, probe: Probe, quiet_s: float, args) -> dict[str, Callable]:
    """name -> run, returning (Row, the window whose load errors are excused)."""
    out: dict[str, Callable] = {
        "garbage-public": lambda: (
            garbage_row(dep, "public", args.calls_per_method, args.seed),
            None,
        ),
        "garbage-worker": lambda: (
            garbage_row(dep, "worker", args.calls_per_method, args.seed),
            None,
        ),
        "garbage-tcp": lambda: (raw_row(dep, args.raw_per_port, args.seed), None),
        "kill-worker": lambda: kills.kill_worker(dep, probe),
        "kill-core": lambda: kills.kill_core(dep, probe),
        "kill-span": lambda: kills.kill_span_process(dep, probe),
        "kill-grammar": lambda: kills.kill_grammar_processes(dep, args.seed),
        "stop-worker": lambda: kills.stop_worker(dep, probe),
    }
    for name, run in floods(dep, probe, quiet_s, args.seed):
        out[name] = lambda run=run: (run(), None)
    out["lora"] = lambda: (lora_flood(dep, probe, quiet_s, args.workdir), None)
    return out


def run_phase(
    name: str, run: Callable, load: GatewayLoad, dep: Deployment, baseline: int
) -> tuple[Row, dict]:
    load.phase = name
    load.resume()
    try:
        row, excused = run()
    except Exception as e:  # a phase that broke is a finding too
        row, excused = (
            Row(name, name, f"the phase raised {e!r}", False, [traceback.format_exc()[-600:]]),
            None,
        )
    row.tried = f"{name}: {row.tried}" if not row.tried.startswith(name) else row.tried
    load.pause()
    verdict = load.judge(load.take(), excused)
    row.measured += (
        f"; gateway load: {verdict['ok']}/{verdict['answers']} identical, "
        f"{verdict['different']} different, {verdict['errors']} errors"
        + (f" (+{verdict['excused']} excused)" if excused else "")
    )
    if verdict["different"] or verdict["errors"]:
        row.held = False
        row.problems += [f"gateway load: {s}" for s in verdict["samples"]]
    clean = check_clean(dep, baseline)
    row.measured += f"; idle after {clean.idle_s:.1f} s, processes {clean.roles}"
    if clean.problems:
        row.held = False
        row.problems += [f"after the phase: {p}" for p in clean.problems]
    row.numbers["load"] = {k: v for k, v in verdict.items() if k != "samples"}
    return row, clean.rss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--phases", help="comma-separated phase names (default: all, in order)")
    p.add_argument("--calls-per-method", type=int, default=300)
    p.add_argument("--raw-per-port", type=int, default=60)
    p.add_argument("--streams", type=int, default=3, help="background load: gateway clients")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, help="logs and adapters (default: a new temp dir)")
    p.add_argument("--no-kill-serve", action="store_true", help="end with SIGTERM instead")
    p.add_argument("serve_args", nargs="*", help="more `radixserve serve` arguments (after --)")
    args = p.parse_args()
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hardening-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.workdir}", flush=True)
    dep = Deployment(args.workdir, args.model, args.serve_args)
    rows: list[Row] = []
    extra: dict = {}
    load: GatewayLoad | None = None
    try:
        extra["startup_s"] = round(dep.start(), 1)
        load = GatewayLoad(dep.gateway_base, dep.model_name, args.streams)
        load.record_reference()
        probe = Probe(dep.address)
        extra["probe_alone_s"] = round(probe.quiet(), 3)
        start = check_clean(dep, None)
        if start.problems:
            raise RuntimeError(f"not clean at the start: {start.problems}")
        history = [("start", start.rss)]
        load.start()
        time.sleep(3.0)
        quiet = probe.quiet()
        extra["probe_quiet_s"] = round(quiet, 3)
        print(
            f"started in {extra['startup_s']} s; probe alone {extra['probe_alone_s']} s, "
            f"with the gateway load {quiet:.3f} s",
            flush=True,
        )
        table_of = phases(dep, probe, quiet, args)
        chosen = args.phases.split(",") if args.phases else list(table_of)
        for name in chosen:
            row, rss = run_phase(name, table_of[name], load, dep, start.used_tokens)
            history.append((name, rss))
            rows.append(row)
            show(row)
        problems, lines = rss_growth(history[1:] if len(history) > 2 else history, 0.5, 100)
        rows.append(
            Row(
                "leaks",
                "RSS of every process, after the first phase vs after the last",
                "; ".join(lines),
                not problems,
                problems,
            )
        )
        show(rows[-1])
        load.stop()
        if not args.no_kill_serve:
            rows.append(kills.kill_serve(dep))
            show(rows[-1])
    finally:
        if load is not None:
            load.stop()
        dep.stop()
    print()
    print(table(rows))
    print(summary(rows, extra))
    return 0 if all(r.held for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
