"""Decode throughput of a worker against the HBM roofline (a program, not a test).

For each model, attention backend and batch size: ``batch`` requests whose
first ``--context`` positions are in the KV cache, then ``--steps`` timed decode
steps of the whole batch through the worker's model runner (plan in, tokens out:
model, attention, sampling and bookkeeping; CUDA graphs where the backend has
them). Reported per (model, backend, batch):

- ms / step (median) and tokens / s. Steps are timed as the worker runs them
  with ``--overlap`` (the default here, ``--overlap on``): step N+1 is started
  (planned, its kernels queued, its decode inputs gathered on the device from
  N's tokens) before step N is completed, so a timed step is one iteration of
  "start N+1, complete N", the period the worker sustains. ``--overlap off``
  times "start N, complete N" with a device sync before each, as before issue
  31 (which under-reported against the roofline: the host's planning was not
  hidden behind the GPU's work);
- bytes read per step: every weight once (the LM head included; an untied
  input embedding is not counted, a step reads only ``batch`` rows of it; tied
  embeddings count once, as the LM head) plus the KV read,
  ``batch x kv_len x layers x 2 x kv_heads x head_dim x element size`` with
  kv_len the mean length attended over the timed steps;
- the bandwidth that implies, as a fraction of the device copy bandwidth
  measured here (one large device-to-device copy, bytes read + written / time)
  and of the 4.3 TB/s H200 figure (``--roofline-tbps``);
- the worker busy fraction: GPU time of a step / wall time of a step. GPU time
  comes from CUDA events around a step that was queued behind a sleep kernel
  long enough for the host to queue the whole step first, so the events see
  the step's kernels back to back, without the host's gaps (and a host sync
  before the token copy would show up as extra GPU time). An upper bound: the
  span also holds the host's bookkeeping after the token copy. n/a on CPU.

Then flashinfer / torch speed-up per (model, batch). One line per
configuration, a JSON line at the end. The JSON summary is (re)written to
``--json`` (default ``$OUT/gpu_bench.json`` when ``$OUT`` is set) after every
configuration, through a temporary file and a rename, so a run killed by a
timeout leaves every configuration that finished. ``--dry-run`` prints the
configurations in run order and writes the empty summary, touching no device.

The KV cache is not prefilled by default (``--fill random``): its pages are
filled with random values and each request's state is set as if its prompt had
been prefilled, since a decode step costs the same whatever the values; a
256 x 1k prefill through the torch backend would take minutes. ``--fill
prefill`` prefills for real, 8 requests per plan.

    python scripts/gpu_decode_bench.py            # H200: both models, 1/64/256, 1k
    python scripts/gpu_decode_bench.py --kernels torch   # the same without FlashInfer's
                                                         # fused norm/RoPE/SiLU (an A/B)
    python scripts/gpu_decode_bench.py --device cpu --backends torch \\
        --models random:smollm2-135m --batches 1,4 --context 64 --steps 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from scripts.json_out import write_json
from worker_service.config import WorkerConfig
from worker_service.device.context import resolve_device
from worker_service.execution.model_runner import ModelRunner, StartedStep
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan, Result
from worker_service.execution.request_state import SlotState
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.worker import Worker, build_worker

GREEDY = SamplingParams(temperature=0.0)
DEFAULT_MODELS = "random:smollm2-135m,random:llama-3.1-8b"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float, iters: int = 10) -> float:
    """Bytes read + written per second of one large copy on ``device``."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (and first touch on the CPU)
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        iters = 3
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2 * n * iters / seconds


class SleepCalibration:
    """``torch.cuda._sleep`` cycles per millisecond on this GPU."""

    def __init__(self) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 10_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)

    def sleep(self, ms: float) -> None:
        torch.cuda._sleep(int(self.cycles_per_ms * ms))


def weight_bytes(worker: Worker) -> int:
    """Weight bytes a decode step reads (see the module docstring)."""
    model = worker.runner.compute.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    if model.lm_head is not model.embed_tokens:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(worker: Worker) -> int:
    kv = worker.runner.compute.kv
    return kv.num_layers * 2 * kv.num_kv_heads * kv.head_dim * kv.layers[0].element_size()


def check(result: Result) -> None:
    if result.error:
        raise RuntimeError(result.error)


def timed_steps(
    runner: ModelRunner,
    next_plan: Callable[[], Plan],
    *,
    steps: int,
    overlap: bool,
    max_s: float,
    before_step: Callable[[], None] | None = None,
) -> tuple[list[float], list[int]]:
    """Wall seconds of each timed step and the position it decoded at. With
    ``overlap`` an iteration starts step N+1, then completes step N (the
    runner's --overlap pipeline; the first iteration also starts step 0, the
    last step is completed untimed); else it starts and completes one step.
    Stops early once ``max_s`` passed after at least 3 steps."""
    times: list[float] = []
    positions: list[int] = []
    running: StartedStep | None = runner.start(next_plan()) if overlap else None
    t_config = time.perf_counter()
    for i in range(steps):
        if before_step is not None:
            before_step()
        t0 = time.perf_counter()
        plan = next_plan()
        started = runner.start(plan)
        if overlap:
            check(runner.complete(running))
            running = started
        else:
            check(runner.complete(started))
        times.append(time.perf_counter() - t0)
        positions.append(plan.decode_positions[0] - (1 if overlap else 0))
        if i >= 2 and time.perf_counter() - t_config > max_s:
            break  # enough for a median; keeps slow configurations in budget
    if running is not None:
        check(runner.complete(running))
    return times, positions


def configurations(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(model, backend, batch) in run order: backends outer, so with the default
    order every flashinfer figure comes first and a run cut short by --budget-s
    loses the torch comparison, not the roofline."""
    batches = [int(b) for b in args.batches.split(",")]
    return [
        (model, backend, batch)
        for backend in args.backends.split(",")
        for model in args.models.split(",")
        for batch in batches
    ]


def json_path(args: argparse.Namespace) -> Path | None:
    if args.json:
        return Path(args.json)
    return Path(os.environ["OUT"], "gpu_bench.json") if os.environ.get("OUT") else None


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.sleeper = SleepCalibration() if self.device.type == "cuda" else None
        # Positions a request reaches: context, then one per step of every kind.
        steps = args.warmup + args.steps + args.gpu_steps + 1
        self.pages_per_req = -(-(args.context + steps) // args.page_size)

    def build(self, model: str, backend: str, max_batch: int) -> Worker:
        a = self.args
        cfg = WorkerConfig(
            model=model,
            device=a.device,
            dtype=a.dtype,
            attention_backend=backend,
            kernels=a.kernels,
            page_size=a.page_size,
            num_pages=self.pages_per_req * max_batch,
            overlap=a.overlap,
        )
        worker = build_worker(cfg)
        if a.fill == "random":
            gen = torch.Generator(device=worker.device).manual_seed(1)
            for layer in worker.runner.compute.kv.layers:
                layer.normal_(0.0, 1.0, generator=gen)
        return worker

    def table(self, slot: int) -> list[int]:
        return list(range(slot * self.pages_per_req, (slot + 1) * self.pages_per_req))

    def start_requests(self, worker: Worker, batch: int) -> None:
        """``batch`` requests with ``context`` positions cached and one sampled token."""
        a, runner = self.args, worker.runner
        runner.reset()
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, worker.vocab_size, (batch, a.context + 1), generator=g).tolist()
        if a.fill == "random":
            for slot, tokens in enumerate(prompts):
                state = SlotState(
                    rid=f"r{slot}",
                    sampling=GREEDY,
                    logprobs=LogprobOptions(),
                    prompt_len=a.context,
                    tokens=tokens,
                    kv_len=a.context,
                    pages=self.table(slot),
                )
                runner.adopt(slot, state)  # the page table mirrors its pages
            return
        for first in range(0, batch, 8):  # 8 requests per plan bounds activations
            plan = Plan(first + 1, ForwardMode.PREFILL)
            for slot in range(first, min(batch, first + 8)):
                prompt = prompts[slot][: a.context]
                plan.joins.append(Join(slot, f"r{slot}", GREEDY, LogprobOptions(), len(prompt), []))
                plan.extends.append(Extend(slot, 0, prompt, self.table(slot), True))
            result = runner.execute(plan)
            if result.error:
                raise RuntimeError(result.error)

    def run_batch(self, worker: Worker, batch: int) -> dict[str, Any]:
        a, runner, device = self.args, worker.runner, worker.device
        self.start_requests(worker, batch)
        step_id = 10_000
        position = a.context

        def plan() -> Plan:
            nonlocal step_id, position
            p = Plan(step_id, ForwardMode.DECODE)
            p.decode_slots = list(range(batch))
            p.decode_positions = [position] * batch
            p.decode_new_pages = [0] * batch  # whole tables were set up front
            step_id += 1
            position += 1
            return p

        def step() -> None:
            check(runner.execute(plan()))

        for _ in range(a.warmup):
            step()
        overlapped = a.overlap == "on" and runner.overlap
        times, kv_lens = timed_steps(
            runner,
            plan,
            steps=a.steps,
            overlap=overlapped,
            max_s=a.max_config_s,
            before_step=None if overlapped else lambda: sync(device),
        )
        kv_lens = [k + 1 for k in kv_lens]  # a step attends over its position too
        step_s = statistics.median(times)

        gpu_ms: float | None = None
        if self.sleeper is not None and a.gpu_steps:
            gpu: list[float] = []
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            for _ in range(a.gpu_steps):
                sync(device)
                # Long enough for the host to queue the whole step before it runs.
                self.sleeper.sleep(max(2.0, 1.5 * step_s * 1e3))
                start.record()
                step()  # ends with the token copy: the host waited for the step
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end))
            gpu_ms = statistics.median(gpu)

        w_bytes = weight_bytes(worker)
        kv_len = statistics.fmean(kv_lens)
        kv_b = int(batch * kv_len * kv_bytes_per_token(worker))
        moved = w_bytes + kv_b
        achieved = moved / step_s
        return {
            "batch": batch,
            "overlap": overlapped,
            "steps": len(times),
            "step_ms": step_s * 1e3,
            "tokens_per_s": batch / step_s,
            "weight_bytes": w_bytes,
            "kv_bytes": kv_b,
            "bytes_per_step": moved,
            "achieved_GBps": achieved / 1e9,
            "frac_measured_bw": achieved / self.copy_bw,
            "frac_roofline": achieved / (a.roofline_tbps * 1e12),
            "gpu_step_ms": gpu_ms,
            "busy_fraction": None if gpu_ms is None else min(gpu_ms / (step_s * 1e3), 1.0),
        }


def fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated model names")
    p.add_argument("--model", dest="models", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--backends", default="flashinfer,torch")
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "torch", "flashinfer"),
        help="norms, RoPE, SiLU, sampling filters (auto: FlashInfer's on CUDA); torch for an A/B",
    )
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpu-steps", type=int, default=3, help="steps timed for the busy fraction")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--fill", choices=("random", "prefill"), default="random")
    p.add_argument(
        "--overlap",
        choices=("on", "off"),
        default="on",
        help="time steps as the worker's --overlap runs them (start N+1, complete N)",
    )
    p.add_argument("--max-config-s", type=float, default=30.0, help="timed seconds per config")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip configs past this")
    p.add_argument("--roofline-tbps", type=float, default=4.3)
    p.add_argument("--copy-gib", type=float, default=None, help="2 on CUDA, 0.25 on CPU")
    p.add_argument("--json", default=None, help="summary file (default $OUT/gpu_bench.json)")
    p.add_argument("--dry-run", action="store_true", help="list the configurations, run none")
    return p.parse_args(argv)


def summarize(
    args: argparse.Namespace,
    *,
    device_name: str,
    copy_bw: float | None,
    results: list[dict[str, Any]],
    errors: list[dict[str, str]],
    skipped: list[str],
    elapsed_s: float,
) -> dict[str, Any]:
    """The JSON summary of the configurations run so far."""
    speedup: dict[str, dict[str, float]] = {}
    by_key = {(r["model"], r["backend"], r["batch"]): r for r in results}
    for (model, backend, batch), r in by_key.items():
        ref = by_key.get((model, "torch", batch))
        if backend == "flashinfer" and ref is not None:
            speedup.setdefault(model, {})[str(batch)] = ref["step_ms"] / r["step_ms"]
    goal = by_key.get(("random:llama-3.1-8b", "flashinfer", 64))
    return {
        "device": args.device,
        "device_name": device_name,
        "dtype": args.dtype,
        "kernels": args.kernels,
        "overlap": args.overlap,
        "context": args.context,
        "page_size": args.page_size,
        "fill": args.fill,
        "copy_bw_TBps": None if copy_bw is None else copy_bw / 1e12,
        "roofline_TBps": args.roofline_tbps,
        "configurations": [list(c) for c in configurations(args)],
        "results": results,
        "speedup_flashinfer_over_torch": speedup,
        "goal_8b_b64_frac_roofline": None if goal is None else goal["frac_roofline"],
        "errors": errors,
        "skipped": skipped,
        "elapsed_s": elapsed_s,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    out_json = json_path(args)
    results: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    skipped: list[str] = []
    if args.dry_run:
        for model, backend, batch in configurations(args):
            print(f"{model} / {backend} / batch {batch}", flush=True)
        summary = summarize(
            args,
            device_name="dry run",
            copy_bw=None,
            results=results,
            errors=errors,
            skipped=skipped,
            elapsed_s=0.0,
        )
        write_json(out_json, summary)
        print(json.dumps(summary), flush=True)
        return 0
    device = torch.device(args.device)
    gib = args.copy_gib or (2.0 if device.type == "cuda" else 0.25)
    bench = Bench(args)
    bench.copy_bw = copy_bandwidth(device, gib)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device {name}: copy bandwidth {bench.copy_bw / 1e12:.3f} TB/s (read + write, "
        f"{gib:g} GiB); roofline {args.roofline_tbps} TB/s; fill {args.fill}; "
        f"overlap {args.overlap}",
        flush=True,
    )

    def save() -> dict[str, Any]:
        summary = summarize(
            args,
            device_name=name,
            copy_bw=bench.copy_bw,
            results=results,
            errors=errors,
            skipped=skipped,
            elapsed_s=time.perf_counter() - t_start,
        )
        write_json(out_json, summary)
        return summary

    batches = [int(b) for b in args.batches.split(",")]
    for backend in args.backends.split(","):
        for model in args.models.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"{model}/{backend}")
                continue
            worker = None
            try:
                t0 = time.perf_counter()
                worker = bench.build(model, backend, max(batches))
                print(
                    f"{model} / {backend}: worker ready in {time.perf_counter() - t0:.1f} s "
                    f"(dtype {worker.dtype}, attention {worker.attention_backend}, "
                    f"kernels {worker.runner.compute.model.kernels.name})",
                    flush=True,
                )
                for batch in batches:
                    if time.perf_counter() - t_start > args.budget_s:
                        skipped.append(f"{model}/{backend}/b{batch}")
                        continue
                    r = {"model": model, "backend": backend} | bench.run_batch(worker, batch)
                    results.append(r)
                    save()
                    print(
                        f"{model:22s} {backend:10s} batch {batch:4d}: "
                        f"{r['step_ms']:8.2f} ms/step {r['tokens_per_s']:10.1f} tok/s  "
                        f"{r['bytes_per_step'] / 1e9:7.3f} GB/step "
                        f"{r['achieved_GBps']:8.1f} GB/s = {r['frac_measured_bw']:6.1%} of "
                        f"measured, {r['frac_roofline']:6.1%} of {args.roofline_tbps} TB/s  "
                        f"busy {fmt(r['busy_fraction'], '.1%')}",
                        flush=True,
                    )
            except Exception as e:  # one failing backend must not hide the others
                traceback.print_exc()
                errors.append({"model": model, "backend": backend, "error": repr(e)})
                save()
            finally:
                del worker
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    summary = save()
    for model, by_batch in summary["speedup_flashinfer_over_torch"].items():
        for batch, x in by_batch.items():
            print(f"{model} batch {batch}: flashinfer {x:.2f}x torch")
    print(json.dumps(summary), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
