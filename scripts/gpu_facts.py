"""The torch / FlashInfer interop facts a GPU run must establish first (issue 31's
review of the GPU path against FlashInfer 0.7.2's and torch's sources), printed
one line per fact and written to ``$OUT/gpu_facts.json`` (or ``--json``) after
each fact, so a run cut short keeps what it found. scripts/gpu_check.sh runs it
before the GPU tests.

Facts, in order (each bounded by ``--fact-timeout-s``, a SIGALRM that stops a
fact stuck in Python; the shell's ``timeout`` bounds the whole script):

- ``versions``: Python, torch, its CUDA and cuDNN, the GPU and its capability
  and memory, FlashInfer and tvm_ffi and where they were imported from;
- ``bundle``: the prebuilt kernel modules FlashInfer finds
  (``flashinfer/data/aot/<uri>``) and whether JIT is disabled;
- ``dtypes``: bf16 support, a bf16 and an fp16 matmul;
- ``attention``: our FlashInferAttention on a small mixed batch (an extend and
  two decodes) per dtype (bf16, fp16), head dim (64, 80, 96, 128, 256) and
  decode kernel (CUDA-core, tensor-core), compared with TorchAttention in
  fp32: "ok" with the largest difference, or the error's first line (a
  missing prebuilt module shows up here);
- ``graph_capture``: DecodeGraphs over our backend (bf16, head dim 128), sizes
  1 and 8, capture time and replay == eager;
- ``nccl``: availability, NCCL's version, and a one-rank NCCL group's
  all_reduce and all_gather_into_tensor;
- ``pinned_copy``: a pinned host tensor copied with non_blocking=True behind a
  50 ms sleep kernel returns to the host at once (asynchronous), a pageable
  one's time, and the values after a sync;
- ``sync_debug_mode``: under ``torch.cuda.set_sync_debug_mode("error")`` a
  kernel launch passes and ``.item()`` raises (what tests/worker_service/
  test_gpu_worker.py relies on).

Expected duration on an H200 with the bundle: ~20-40 s (module loads dominate);
``--fact-timeout-s`` 30 caps one fact. On a machine without CUDA every fact but
``versions``, ``bundle`` and part of ``nccl`` reports its error; ``--dry-run``
lists the facts and writes an empty summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from scripts.json_out import write_json

Fact = Callable[[], dict[str, Any]]
HEAD_DIMS = (64, 80, 96, 128, 256)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    return torch.device("cuda")


def versions() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts |= {
            "gpu": props.name,
            "capability": f"sm_{props.major}{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "devices": torch.cuda.device_count(),
        }
    for name in ("flashinfer", "tvm_ffi"):
        if importlib.util.find_spec(name) is None:
            facts[name] = None
            continue
        module = __import__(name)
        facts[name] = f"{getattr(module, '__version__', '?')} ({Path(module.__file__).parent})"
    return facts


def bundle() -> dict[str, Any]:
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        raise RuntimeError("flashinfer is not importable")
    aot = Path(spec.origin).parent / "data" / "aot"
    modules = sorted(p.name for p in aot.iterdir() if p.is_dir()) if aot.is_dir() else []
    return {
        "aot_dir": str(aot),
        "modules": len(modules),
        "uris": modules,
        "jit_disabled": os.environ.get("FLASHINFER_DISABLE_JIT") == "1",
    }


def dtypes() -> dict[str, Any]:
    device = _cuda()
    out: dict[str, Any] = {"bf16_supported": torch.cuda.is_bf16_supported()}
    for name, dtype in DTYPES.items():
        a = torch.randn(64, 64, device=device, dtype=dtype)
        ref = a.float() @ a.float()
        out[f"{name}_matmul_max_err"] = float(((a @ a).float() - ref).abs().max())
    return out


def _small_batch(page_size: int, device: torch.device) -> Any:
    """An extend of 5 tokens on page 0, decodes at kv lengths 20 and 33 (pages 1-2
    and 3-5): rows are extends first, then decodes, as the runner orders them.
    Each sequence's pages are one row of a page table on ``device``."""
    from worker_service.attention.base import AttentionBatch, SequenceSlice
    from worker_service.device.page_table import PageTable

    tables = [[0], [1, 2], [3, 4, 5]]
    table = PageTable(device)
    rows = [table.acquire() for _ in tables]
    for row, pages in zip(rows, tables, strict=True):
        table.append(row, pages)
    table.sync()
    seqs = [
        SequenceSlice(0, 5, 5, rows[0]),
        SequenceSlice(5, 1, 20, rows[1]),
        SequenceSlice(6, 1, 33, rows[2]),
    ]
    positions, pages = [], []
    for s, t in zip(seqs, tables, strict=True):
        for p in range(s.kv_len - s.q_len, s.kv_len):
            positions.append(p)
            pages.append(t[p // page_size])
    pos = torch.tensor(positions, device=device)
    return AttentionBatch(
        seqs, 1, pos, torch.tensor(pages, device=device), pos % page_size, page_size, table
    )


def _attention_case(
    dtype: torch.dtype, head_dim: int, tensor_cores: bool, *, soft_cap: float | None = None
) -> float:
    """Largest |FlashInfer - torch fp32| over one step of the small batch."""
    from worker_service.attention.base import AttentionSpec
    from worker_service.attention.flashinfer_backend import FlashInferAttention
    from worker_service.attention.torch_backend import TorchAttention
    from worker_service.device.kv_cache import KvCache

    device, page_size, heads, kv_heads = _cuda(), 16, 8, 2
    spec = AttentionSpec(
        heads, kv_heads, head_dim, page_size, None, dtype, device, logit_soft_cap=soft_cap
    )
    fi = FlashInferAttention(spec, workspace_bytes=32 * 2**20, decode_tensor_cores=tensor_cores)
    ref = TorchAttention(
        AttentionSpec(
            heads,
            kv_heads,
            head_dim,
            page_size,
            None,
            torch.float32,
            device,
            logit_soft_cap=soft_cap,
        )
    )
    shape = dict(
        num_layers=1, num_pages=8, page_size=page_size, num_kv_heads=kv_heads, head_dim=head_dim
    )
    kv, ref_kv = (
        KvCache(**shape, dtype=dtype, device=device),
        KvCache(**shape, dtype=torch.float32, device=device),
    )
    kv.layers[0].normal_()
    ref_kv.layers[0].copy_(kv.layers[0].float())
    batch = _small_batch(page_size, device)
    t = batch.num_tokens
    q = torch.randn(t, heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(t, kv_heads, head_dim, device=device, dtype=dtype)
    fi.begin_step(batch)
    ref.begin_step(batch)
    out = fi.forward(0, q, k, v, kv=kv)
    expected = ref.forward(0, q.float(), k.float(), v.float(), kv=ref_kv)
    return float((out.float() - expected).abs().max())


def attention() -> dict[str, Any]:
    _cuda()
    results: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        for head_dim in HEAD_DIMS:
            for tc in (False, True):
                key = f"{name}/d{head_dim}/{'tensor-core' if tc else 'cuda-core'}"
                try:
                    results[key] = f"ok, max diff {_attention_case(dtype, head_dim, tc):.3g}"
                except Exception as e:  # a missing module is a fact, not a failure
                    results[key] = (
                        f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    )
    # The prebuilt soft-capped modules (Gemma 2's: bf16, head dim 256), cap 2:
    # random scores of about 1 are bent by it.
    for tc in (False, True):
        key = f"bfloat16/d256/soft-cap/{'tensor-core' if tc else 'cuda-core'}"
        try:
            diff = _attention_case(torch.bfloat16, 256, tc, soft_cap=2.0)
            results[key] = f"ok, max diff {diff:.3g}"
        except Exception as e:  # a missing module is a fact, not a failure
            results[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return results


def graph_capture() -> dict[str, Any]:
    from worker_service.attention.base import AttentionSpec
    from worker_service.attention.flashinfer_backend import FlashInferAttention
    from worker_service.device.kv_cache import KvCache
    from worker_service.execution.cuda_graphs import DecodeGraphs

    device, page_size, heads, kv_heads, d = _cuda(), 16, 8, 2, 128
    spec = AttentionSpec(heads, kv_heads, d, page_size, None, torch.bfloat16, device)
    num_pages = 16
    kv = KvCache(
        num_layers=1,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=kv_heads,
        head_dim=d,
        dtype=torch.bfloat16,
        device=device,
    )
    kv.layers[0].normal_()
    graphed = FlashInferAttention(spec, workspace_bytes=32 * 2**20)
    graphed.enable_decode_graphs(num_pages - 1, 4, sizes=(1, 8))
    bufs = {
        "q": torch.randn(8, heads, d, device=device, dtype=torch.bfloat16),
        "k": torch.randn(8, kv_heads, d, device=device, dtype=torch.bfloat16),
        "v": torch.randn(8, kv_heads, d, device=device, dtype=torch.bfloat16),
    }
    graphs = DecodeGraphs(
        graphed, lambda x: graphed.forward(0, x["q"], x["k"], x["v"], kv=kv), bufs, page_size
    )
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    batch = _small_batch(page_size, device)
    from worker_service.attention.base import AttentionBatch

    decodes = AttentionBatch(
        [s.__class__(i, 1, s.kv_len, s.row) for i, s in enumerate(batch.seqs[1:])],
        0,
        batch.positions[5:],
        batch.write_pages[5:],
        batch.write_offsets[5:],
        page_size,
        batch.pages,
    )
    inputs = {name: torch.randn_like(buf[:2]) for name, buf in bufs.items()}
    before = kv.layers[0].clone()
    out = graphs.replay(decodes, inputs)
    assert out is not None, "no captured size fits 2 decodes"
    replayed = out.clone()
    after = kv.layers[0].clone()
    kv.layers[0].copy_(before)
    eager = FlashInferAttention(spec, workspace_bytes=32 * 2**20)
    eager.begin_step(decodes)
    expected = eager.forward(0, inputs["q"], inputs["k"], inputs["v"], kv=kv)
    torch.cuda.synchronize()
    return {
        "capture_s": round(capture_s, 3),
        "replay_max_diff": float((replayed.float() - expected.float()).abs().max()),
        "kv_equal_outside_scratch": bool(
            torch.equal(after[: num_pages - 1], kv.layers[0][: num_pages - 1])
        ),
    }


def nccl() -> dict[str, Any]:
    import torch.distributed as dist

    facts: dict[str, Any] = {"available": dist.is_available() and dist.is_nccl_available()}
    device = _cuda()
    facts["version"] = ".".join(map(str, torch.cuda.nccl.version()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        x = torch.arange(4, device=device, dtype=torch.float32)
        dist.all_reduce(x)
        gathered = torch.empty(4, device=device)
        dist.all_gather_into_tensor(gathered, torch.arange(4, device=device, dtype=torch.float32))
        torch.cuda.synchronize()
        facts["all_reduce_ok"] = x.tolist() == [0.0, 1.0, 2.0, 3.0]
        facts["all_gather_into_tensor_ok"] = gathered.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()
    return facts


def _sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


def pinned_copy() -> dict[str, Any]:
    device = _cuda()
    per_ms = _sleep_cycles_per_ms()
    host = torch.arange(1 << 20, dtype=torch.int32)
    facts: dict[str, Any] = {}
    for name, src in (("pinned", host.pin_memory()), ("pageable", host.clone())):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(50 * per_ms))  # the GPU is busy for 50 ms
        t0 = time.perf_counter()
        dst = src.to(device, non_blocking=True)
        call_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        facts[f"{name}_call_ms"] = round(call_ms, 2)
        facts[f"{name}_values_ok"] = bool(torch.equal(dst.cpu(), host))
    facts["pinned_is_async"] = facts["pinned_call_ms"] < 25
    facts["pinned_ok"] = bool(host.pin_memory().is_pinned())
    return facts


def sync_debug_mode() -> dict[str, Any]:
    device = _cuda()
    facts: dict[str, Any] = {}
    x = torch.ones(4, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            y = x * 2
            facts["launch_passes"] = True
        except RuntimeError as e:
            facts["launch_passes"] = f"raised: {e}"
        try:
            y.sum().item()
            facts["item_raises"] = False
        except RuntimeError:
            facts["item_raises"] = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return facts


FACTS: dict[str, Fact] = {
    "versions": versions,
    "bundle": bundle,
    "dtypes": dtypes,
    "attention": attention,
    "graph_capture": graph_capture,
    "nccl": nccl,
    "pinned_copy": pinned_copy,
    "sync_debug_mode": sync_debug_mode,
}


class FactTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raises FactTimeout in the main thread after ``seconds`` (Python code only:
    a call stuck inside a kernel or driver waits for the shell's timeout)."""

    def expire(signum: int, frame: Any) -> None:
        raise FactTimeout(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_facts(facts: dict[str, Fact], *, timeout_s: float, out: Path | None) -> dict[str, Any]:
    """Each fact in turn: its value or its error, one line printed and the
    summary rewritten after each."""
    summary: dict[str, Any] = {"facts": {}, "errors": {}, "seconds": {}}
    for name, fact in facts.items():
        t0 = time.perf_counter()
        try:
            with time_limit(timeout_s):
                value = fact()
            summary["facts"][name] = value
            print(f"{name}: {json.dumps(value)}", flush=True)
        except Exception as e:  # every failure is a fact to report
            summary["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"{name}: ERROR {type(e).__name__}: {e}", flush=True)
        summary["seconds"][name] = round(time.perf_counter() - t0, 2)
        write_json(out, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated facts (default: all)")
    p.add_argument("--fact-timeout-s", type=float, default=30.0)
    p.add_argument("--json", default=None, help="summary file (default $OUT/gpu_facts.json)")
    p.add_argument("--dry-run", action="store_true", help="list the facts, run none")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(FACTS)
    unknown = [n for n in names if n not in FACTS]
    if unknown:
        p.error(f"unknown facts {unknown}; known: {list(FACTS)}")
    out = Path(args.json) if args.json else None
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"], "gpu_facts.json")
    if args.dry_run:
        print("\n".join(names))
        write_json(out, {"facts": {}, "errors": {}, "seconds": {}, "planned": names})
        return 0
    summary = run_facts({n: FACTS[n] for n in names}, timeout_s=args.fact_timeout_s, out=out)
    return 1 if summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
