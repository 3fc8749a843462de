"""The whole worker on a GPU (random SmolLM2-shaped weights, bf16, FlashInfer):
a decode step queues its work without waiting for the GPU, the wait for the
sampled tokens aside, with and without CUDA graphs; prefill too runs through. fp16
starts on FlashInfer's prebuilt modules, fp32 on the torch backend; the grammar
mask compiles nothing and waits for nothing on the GPU.

Skips without CUDA (and without flashinfer unless RADIXSERVE_REQUIRE_FLASHINFER=1,
as in test_flashinfer_backend.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

from worker_service.config import WorkerConfig
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.worker import Worker, build_worker

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PAGE = 16
PROMPTS = [37, 5, 70]  # three requests of different lengths


def start(worker: Worker, sampling: SamplingParams) -> list[int]:
    """Prefill the PROMPTS (one plan); the positions their first decode computes."""
    gen = torch.Generator().manual_seed(0)
    plan = Plan(1, ForwardMode.PREFILL)
    for slot, n in enumerate(PROMPTS):
        prompt = torch.randint(0, worker.vocab_size, (n,), generator=gen).tolist()
        pages = list(range(slot * 8, slot * 8 + 8))  # 128 positions each
        lp = LogprobOptions()
        plan.joins.append(Join(slot, f"r{slot}", sampling, lp, n, []))
        plan.extends.append(Extend(slot, 0, prompt, pages, True))
    result = worker.runner.execute(plan)
    assert not result.error, result.error
    assert all(0 <= t < worker.vocab_size for t in result.token_ids)
    return list(PROMPTS)


def decode(worker: Worker, step_id: int, positions: list[int]) -> list[int]:
    plan = Plan(step_id, ForwardMode.DECODE)
    plan.decode_slots = list(range(len(positions)))
    plan.decode_positions = positions
    plan.decode_new_pages = [0] * len(positions)
    result = worker.runner.execute(plan)
    assert not result.error, result.error
    return result.token_ids


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_step_waits_only_for_its_tokens(graphs: bool, temperature: float) -> None:
    cfg = WorkerConfig(
        model="random:smollm2-135m",
        device="cuda",
        attention_backend="flashinfer",
        page_size=PAGE,
        num_pages=64,
        cuda_graphs=graphs,
    )
    worker = build_worker(cfg)
    assert worker.dtype == torch.bfloat16  # "auto" on CUDA
    assert (worker.runner.compute.graphs is not None) == graphs
    sampling = SamplingParams(temperature=temperature, seed=1 if temperature else None)
    positions = start(worker, sampling)
    for step in range(2):  # warm: pinned-memory pools, lazy module loads
        decode(worker, 10 + step, positions)
        positions = [p + 1 for p in positions]
    torch.cuda.synchronize()
    # Every implicit host sync (.item(), .tolist(), a copy from pageable memory,
    # nonzero, ...) now warns; the token copy waits on an event, which does not.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens = decode(worker, 20, positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, f"host syncs in a decode step: {syncs[:3]}"
    assert len(tokens) == len(PROMPTS)
    assert all(0 <= t < worker.vocab_size for t in tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("flashinfer_ok")
@pytest.mark.parametrize(("dtype", "attention"), [("float16", "flashinfer"), ("float32", "torch")])
def test_fp16_and_fp32_start_and_decode(dtype: str, attention: str) -> None:
    """fp16 runs FlashInfer's prebuilt fp16 modules (graph capture included); fp32
    goes to the torch backend and kernels (FlashInfer has no fp32 kernels)."""
    cfg = WorkerConfig(
        model="random:smollm2-135m", device="cuda", dtype=dtype, page_size=PAGE, num_pages=64
    )
    worker = build_worker(cfg)
    assert worker.attention_backend == attention
    positions = start(worker, SamplingParams(temperature=0.0))
    tokens = decode(worker, 10, positions)
    assert len(tokens) == len(PROMPTS)
    assert all(0 <= t < worker.vocab_size for t in tokens)


@pytest.mark.gpu
@needs_cuda
def test_grammar_mask_on_the_gpu_compiles_nothing_and_waits_for_nothing() -> None:
    from worker_service.sampling import grammar

    pytest.importorskip("xgrammar")
    vocab, rows = 49152, [0, 2]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = grammar.allocate_bitmask(3, vocab)
    bitmask.copy_(torch.randint(-(2**31), 2**31, bitmask.shape, generator=gen, dtype=torch.int64))
    on_gpu = logits.cuda()
    grammar.apply_bitmask(on_gpu, bitmask, rows, backend="torch")  # warm
    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grammar.apply_bitmask(on_gpu, bitmask, rows, backend=grammar.bitmask_backend("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    grammar.apply_bitmask(logits, bitmask, rows, backend="cpu")
    assert torch.equal(on_gpu.cpu(), logits)
