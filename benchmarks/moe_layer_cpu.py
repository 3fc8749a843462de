"""The MoE layer's grouped expert forward against two dense loops, on the CPU
(a program, not a test).

For one layer of each shape, a batch of ``--tokens`` tokens routed by a
random router (softmax, top k), timed three ways:

- grouped (models/moe_experts.py, what the worker runs): assignments sorted
  by expert, one gate/up and one down matmul per expert that has tokens;
- dense over experts: every expert on every token, weighted by a dense
  (tokens x experts) routing matrix that is zero off the top k;
- token loop: each token through each of its k experts, one at a time.

Times are the process's CPU time per call (median of ``--repeats``), torch
on ``--threads`` threads: on a shared machine wall time also counts the
waits for a core. The three agree to fp32 rounding (checked).

    python benchmarks/moe_layer_cpu.py
    python benchmarks/moe_layer_cpu.py --tokens 64 --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker_service.device.distributed import TensorParallel
from worker_service.kernels import select_kernels
from worker_service.models.config import MoeConfig
from worker_service.models.moe_experts import MoeExperts
from worker_service.models.moe_routing import route

# name -> (hidden, experts, expert intermediate, top k)
SHAPES = {
    "mixtral-like (8 x 1024, top 2)": (1024, 8, 1024, 2),
    "qwen3-moe-like (64 x 256, top 8)": (1024, 64, 256, 8),
}


def dense_over_experts(experts: MoeExperts, x, weights, ids) -> torch.Tensor:
    dense = torch.zeros(x.shape[0], experts.moe.num_experts).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(experts.moe.num_experts):
        h = experts.activation(F.linear(x, experts.w13[e]))
        out += F.linear(h, experts.w2[e]) * dense[:, e : e + 1]
    return out


def token_loop(experts: MoeExperts, x, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = experts.activation(F.linear(x[t : t + 1], experts.w13[e]))
            out[t] += (F.linear(h, experts.w2[e]) * weights[t, j])[0]
    return out


def cpu_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def measure(hidden: int, num_experts: int, inter: int, top_k: int, *, tokens: int, repeats: int):
    cpu = torch.device("cpu")
    moe = MoeConfig(num_experts=num_experts, top_k=top_k, expert_intermediate_size=inter)
    experts = MoeExperts(
        hidden, moe, tp=TensorParallel(), dtype=torch.float32, device=cpu,
        kernels=select_kernels(cpu, torch.float32),
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    experts.w13.data.normal_(0, 0.02, generator=g)
    experts.w2.data.normal_(0, 0.02, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = route(torch.randn(tokens, num_experts, generator=g), moe)
    with torch.inference_mode():
        grouped = experts(x, weights, ids)
        for other in (dense_over_experts, token_loop):
            assert torch.allclose(grouped, other(experts, x, weights, ids), atol=1e-5)
        return {
            "grouped_ms": cpu_ms(lambda: experts(x, weights, ids), repeats),
            "dense_over_experts_ms": cpu_ms(
                lambda: dense_over_experts(experts, x, weights, ids), repeats
            ),
            "token_loop_ms": cpu_ms(lambda: token_loop(experts, x, weights, ids), repeats),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for name, shape in SHAPES.items():
        r = measure(*shape, tokens=args.tokens, repeats=args.repeats)
        results[name] = r
        grouped, dense, loop = r["grouped_ms"], r["dense_over_experts_ms"], r["token_loop_ms"]
        print(
            f"{name}: grouped {grouped:.2f} ms, dense over experts {dense:.2f} ms "
            f"({dense / grouped:.1f}x), token loop {loop:.2f} ms ({loop / grouped:.1f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "threads": args.threads, **results}, f, indent=2)


if __name__ == "__main__":
    main()
