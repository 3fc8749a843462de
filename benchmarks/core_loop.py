"""The core process's CPU per step, everything counted (a program, not a
test): the real ``Engine`` loop in this process, driving a real simulated
worker (radixserve-worker --model simulated, every step taking
``--step-ms``) over its Execute stream, with its outputs going down a real
pipe to a reader process that unpickles them as the API process does.

No API process, gRPC front end or clients: the figure is the core process's
own (every thread: the loop, gRPC's threads, the watchdog), and it holds
still on a shared machine where ``benchmarks/overlap.py``'s system-wide run
does not. ``--batch`` streams decode without end (ignore_eos). After
``--warmup`` seconds it reads this process's CPU time (getrusage: all
threads), the main thread's, the steps done and the worker's busy time, and
again ``--duration`` seconds later; ``--runs`` times, medians reported.

    python benchmarks/core_loop.py [--step-ms 2] [--batch 256] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.overlap import simulated_worker, started
from scheduler_service import ipc
from scheduler_service.core import SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.intake import Submission
from scheduler_service.engine.loop import Engine
from scheduler_service.engine.worker_group import WorkerGroup
from scheduler_service.gc_tuning import tune_gc


def read_outputs(conn: Connection) -> None:
    """The API process's part, reduced to reading: unpickle every message
    and expand its deltas; stop at None (a closed pipe)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if isinstance(msg, ipc.Outputs):
            msg.items()


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(step_ms: float, batch: int, warmup_s: float, duration_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        worker = simulated_worker(step_ms)
        with started(worker, Path(d), "worker") as port:
            group = WorkerGroup([f"127.0.0.1:{port}"])
            info = group.connect()
            sched = Scheduler(
                SchedulerConfig(
                    page_size=info.page_size,
                    max_running_requests=batch,
                    vocab_size=info.model.vocab_size,
                    eos_token_ids=frozenset(info.model.eos_token_ids),
                    enable_kv_events=True,
                ),
                info.num_pages,
            )
            ours, theirs = mp.Pipe()
            reader = mp.get_context("spawn").Process(target=read_outputs, args=(theirs,))
            reader.start()
            theirs.close()
            engine = Engine(sched, group, ours, overlap_depth=1, recovery_timeout_s=5)
            sp = SamplingParams(temperature=0.0, max_new_tokens=1_000_000, ignore_eos=True)
            for i in range(batch):
                sched.submit(Submission(f"b{i}", [(i * 31 + j) % 32000 for j in range(16)], sp))
            marks: list[tuple[float, float, float, int, float]] = []

            def watch() -> None:
                main = threading.main_thread().ident
                for wait in (warmup_s, duration_s):
                    time.sleep(wait)
                    main_cpu = time.clock_gettime(time.pthread_getcpuclockid(main))
                    marks.append(
                        (time.perf_counter(), cpu_s(), main_cpu, sched.stats.steps, engine.busy_ms)
                    )
                engine.running = False

            tune_gc()
            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            engine.run()
            watcher.join()
            group.close()
            ours.close()
            reader.join(10)
    (t0, c0, m0, s0, b0), (t1, c1, m1, s1, b1) = marks
    steps = s1 - s0
    return {
        "steps_per_s": steps / (t1 - t0),
        "core_cpu_ms_per_step": 1e3 * (c1 - c0) / steps,
        "main_thread_cpu_ms_per_step": 1e3 * (m1 - m0) / steps,
        "other_threads_cpu_ms_per_step": 1e3 * ((c1 - c0) - (m1 - m0)) / steps,
        "worker_busy_fraction": (b1 - b0) / (1e3 * (t1 - t0)),
        "core_cores": (c1 - c0) / (t1 - t0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[2.0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    results = {}
    for step_ms in args.step_ms:
        runs = [measure(step_ms, args.batch, args.warmup, args.duration) for _ in range(args.runs)]
        r = {k: round(statistics.median(x[k] for x in runs), 4) for k in runs[0]}
        r["core_cpu_ms_per_step_runs"] = [round(x["core_cpu_ms_per_step"], 3) for x in runs]
        results[f"T{step_ms:g}ms"] = r
        print(
            f"T={step_ms:5.1f} ms: core CPU/step {r['core_cpu_ms_per_step']:.3f} ms "
            f"(runs {r['core_cpu_ms_per_step_runs']}; main thread "
            f"{r['main_thread_cpu_ms_per_step']:.3f}, other threads "
            f"{r['other_threads_cpu_ms_per_step']:.3f})  steps/s {r['steps_per_s']:.1f}  "
            f"worker busy {r['worker_busy_fraction']:.1%}",
            flush=True,
        )
    print(json.dumps({"batch": args.batch, "results": results}))


if __name__ == "__main__":
    main()
