"""The quantized linear (kernels/quant_linear.py) against the float linear the
worker runs today (models/cpu_linear.py: the C skinny kernel up to 128 rows,
oneDNN past them) on the same weights dequantized, on the CPU (a program, not
a test).

Two measurements, each A/B interleaved (quantized, float, quantized, ...)
with medians of wall time, so that load from other processes on a shared
machine hits both sides alike:

- per shape: the default model's matrices (576->576, 576->192, 576->1536,
  1536->576 in Q4_1, the LM head 576->49152 in Q8_0) at ``--rows`` rows.
  Small matrices stay in the caches between repeats, so these are compute
  figures more than memory figures.
- the model pass: every matrix of the default model's 30 layers (7 each,
  distinct weights: q, k, v, o, gate, up, down) and the LM head, one after
  the other at 1 row, so that the weights stream from memory as in a decode
  step; with the GB/s of weight traffic this implies.

Random weights (gguf's quantizer on random floats: the kernel's time does not
depend on the values).

    python benchmarks/quant_linear_cpu.py
    python benchmarks/quant_linear_cpu.py --threads 1 --rows 1 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from worker_service.kernels import quant_linear
from worker_service.models import cpu_linear

LAYERS = 30
# name -> (GGUF type, out, in, matrices per layer; 0: the LM head, once)
SHAPES: dict[str, tuple[str, int, int, int]] = {
    "q/o 576->576": ("Q4_1", 576, 576, 2),
    "k/v 576->192": ("Q4_1", 192, 576, 2),
    "gate/up 576->1536": ("Q4_1", 1536, 576, 2),
    "down 1536->576": ("Q4_1", 576, 1536, 1),
    "lm_head 576->49152": ("Q8_0", 49152, 576, 0),
}


def quantized_matrix(qtype: str, out_features: int, in_features: int, seed: int):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.05
    blocks = quants.quantize(w, GGMLQuantizationType[qtype])
    return quant_linear.pack(qtype, blocks, out_features, in_features)


def interleaved(
    fns: list[Callable[[], object]], repeats: int, *, fastest: list[float] | None = None
) -> list[float]:
    """Median wall seconds of each of ``fns``, run in turn ``repeats`` times
    (their fastest times appended to ``fastest`` if given: on a loaded machine
    the least disturbed run)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    if fastest is not None:
        fastest.extend(min(t) for t in times)
    return [statistics.median(t) for t in times]


def per_shape(rows_list: list[int], repeats: int) -> list[dict]:
    results = []
    for name, (qtype, n, k, _) in SHAPES.items():
        w = quantized_matrix(qtype, n, k, seed=n + k)
        packed = cpu_linear.pack(quant_linear.dequantize(w))
        for rows in rows_list:
            x = torch.randn(rows, k)
            reps = max(5, repeats // max(1, rows // 16)) if n < 10000 else max(5, repeats // 10)
            quant, flt = interleaved(
                [
                    lambda x=x, w=w: quant_linear.matmul(x, w),
                    lambda x=x, packed=packed: cpu_linear.linear(x, packed, None),
                ],
                reps,
            )
            results.append(
                {
                    "shape": name,
                    "qtype": qtype,
                    "rows": rows,
                    "quant_us": quant * 1e6,
                    "float_us": flt * 1e6,
                    "speedup": flt / quant,
                    "quant_weight_GBps": w.nbytes / quant / 1e9 if rows == 1 else None,
                }
            )
            print(
                f"{name:20s} rows {rows:4d}: quantized {quant * 1e6:9.1f} us, "
                f"float {flt * 1e6:9.1f} us, x{flt / quant:5.2f}"
            )
    return results


def model_pass(repeats: int) -> dict:
    weights = []
    for layer in range(LAYERS):
        for qtype, n, k, count in SHAPES.values():
            for c in range(count):
                weights.append(quantized_matrix(qtype, n, k, seed=1000 * layer + 10 * c + n))
    qtype, n, k, _ = SHAPES["lm_head 576->49152"]
    weights.append(quantized_matrix(qtype, n, k, seed=7))
    floats = [cpu_linear.pack(quant_linear.dequantize(w)) for w in weights]
    xs = {k: torch.randn(1, k) for k in {w.in_features for w in weights}}

    def quant() -> None:
        for w in weights:
            quant_linear.matmul(xs[w.in_features], w)

    def flt() -> None:
        for w, p in zip(weights, floats, strict=True):
            cpu_linear.linear(xs[w.in_features], p, None)

    fastest: list[float] = []
    q_s, f_s = interleaved([quant, flt], repeats, fastest=fastest)
    quant_bytes = sum(w.nbytes for w in weights)
    float_bytes = sum(w.out_features * w.in_features * 4 for w in weights)
    print(
        f"model pass, 1 row ({len(weights)} matrices, {quant_bytes / 1e6:.1f} MB quantized, "
        f"{float_bytes / 1e6:.1f} MB float): quantized {q_s * 1e3:.2f} ms "
        f"({quant_bytes / q_s / 1e9:.1f} GB/s), float {f_s * 1e3:.2f} ms "
        f"({float_bytes / f_s / 1e9:.1f} GB/s), x{f_s / q_s:.2f}; fastest runs "
        f"{fastest[0] * 1e3:.2f} / {fastest[1] * 1e3:.2f} ms"
    )
    return {
        "matrices": len(weights),
        "quant_ms": q_s * 1e3,
        "float_ms": f_s * 1e3,
        "quant_fastest_ms": fastest[0] * 1e3,
        "float_fastest_ms": fastest[1] * 1e3,
        "quant_MB": quant_bytes / 1e6,
        "float_MB": float_bytes / 1e6,
        "quant_GBps": quant_bytes / q_s / 1e9,
        "float_GBps": float_bytes / f_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--pass-repeats", type=int, default=15)
    parser.add_argument("--skip-pass", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not quant_linear.available():
        raise SystemExit("the C quantized linear could not be built here")
    print(f"threads {args.threads}, vector path {quant_linear._require().isa} (2 VNNI, 1 AVX2)")
    results: dict = {"threads": args.threads, "per_shape": per_shape(args.rows, args.repeats)}
    if not args.skip_pass:
        results["model_pass"] = model_pass(args.pass_repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
