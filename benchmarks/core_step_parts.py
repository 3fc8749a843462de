"""Where a decode step's CPU goes in the core process, part by part (a
program, not a test): 256 streams decoding, no worker and no pipe.

Each step runs the core loop's parts in order and times each:
``Scheduler.step()``, ``WorkerCodec.encode`` (plan -> protobuf),
``WorkerCodec.decode`` (a worker result with one token per entry ->
StepResult), ``Scheduler.update``, ``Engine._publish`` (the step's outputs
pickled as they would go down the pipe), and, for the API process's side,
unpickling them and ``Outputs.items()``. Medians over the decode steps after
100 of warm-up. Garbage collection stays on, as in the services' processes;
``--gc-tuned`` applies their settings (scheduler_service/gc_tuning.py).

    python benchmarks/core_step_parts.py [--steps 1500] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protos import worker_pb2 as pb
from scheduler_service.core import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler_service.core.plan import ForwardMode
from scheduler_service.engine.loop import Engine

PARTS = ("step", "encode", "decode", "update", "publish", "api_unpickle")


class PickledConn:
    """Stands in for the pipe: keeps what Connection.send would write."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, obj: object) -> None:
        self.sent.append(bytes(ForkingPickler.dumps(obj)))


def measure(batch: int, steps: int) -> dict:
    cfg = SchedulerConfig(
        page_size=16,
        max_running_requests=batch,
        schedule_policy="fcfs",
        vocab_size=32000,
        eos_token_ids=frozenset({2}),
    )
    sched = Scheduler(cfg, 65536)
    conn = PickledConn()
    # only its codec and _publish are used
    engine = Engine(sched, None, conn, overlap_depth=1, recovery_timeout_s=60)
    codec = engine.codec
    for i in range(batch):
        sched.add_request(
            Request(
                f"b{i}",
                [(i * 31 + j) % 32000 for j in range(16)],
                SamplingParams(temperature=0.0, max_new_tokens=1_000_000, ignore_eos=True),
            )
        )
    times: dict[str, list[float]] = {k: [] for k in PARTS}
    clock = time.perf_counter
    token = 0
    for i in range(steps):
        t0 = clock()
        plan = sched.step()
        t1 = clock()
        msg = codec.encode(plan)
        t2 = clock()
        n = len(msg.decode_slots) + sum(1 for e in msg.extends if e.sample)
        tokens = [(token + k) % 32000 for k in range(n)]
        result = pb.StepResult(step_id=plan.step_id, token_ids=tokens)
        token += 7
        t3 = clock()
        decoded = codec.decode(result, plan)
        t4 = clock()
        sched.update(decoded)
        t5 = clock()
        conn.sent.clear()
        engine._publish()
        t6 = clock()
        out = pickle.loads(conn.sent[-1])
        items = out.items() if hasattr(out, "items") else out.deltas
        t7 = clock()
        assert len(items) == n
        if plan.mode is ForwardMode.DECODE and i >= 100:
            spans = (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5, t7 - t6)
            for k, dt in zip(PARTS, spans, strict=True):
                times[k].append(dt * 1e3)
    med = {f"{k}_ms": round(statistics.median(v), 4) for k, v in times.items()}
    med["core_ms"] = round(sum(med[f"{k}_ms"] for k in PARTS[:-1]), 4)
    med["pipe_bytes_per_step"] = len(conn.sent[-1])
    med["steps"] = len(times["step"])
    return med


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--gc-tuned", action="store_true")
    args = p.parse_args()
    if args.gc_tuned:
        from scheduler_service.gc_tuning import tune_gc

        tune_gc()
    r = measure(args.batch, args.steps)
    print(
        "per decode step (ms, medians): "
        + "  ".join(f"{k} {r[f'{k}_ms']:.3f}" for k in PARTS)
        + f"  | core total {r['core_ms']:.3f}  pipe {r['pipe_bytes_per_step']} bytes",
        flush=True,
    )
    print(json.dumps({"batch": args.batch, **r}))


if __name__ == "__main__":
    main()
