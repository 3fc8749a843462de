"""The C decode chain (models/cpu_decode_chain.py) against the Python forward
it replaces: the same worker, the same requests, the chain on and off; the
tokens and logprobs must be equal bit for bit, on the quantized default model
and on its float (dequantized) copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.quant_reference import random_blocks
from tests.worker_service.support.quantized_models import needs_kernel
from tests.worker_service.weights.support.gguf_build import write_model_gguf
from tests.worker_service.weights.support.tiny_checkpoints import TINY
from worker_service.config import WorkerConfig
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.worker import build_worker

pytestmark = [pytest.mark.slow, needs_kernel]


def _requests(vocab: int = 30000) -> list[DriverRequest]:
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    top = LogprobOptions(top_logprobs_num=3)
    base = min(100, vocab // 4)

    def ids(step: int, n: int, first: int) -> list[int]:
        return [(step * j) % (vocab - 2 * base) + first for j in range(n)]

    return [
        DriverRequest(ids(11, 40, base), 12, logprobs=top),
        DriverRequest(ids(7, 70, base + 1), 9, arrive=2),
        DriverRequest(ids(5, 21, base + 2), 10, arrive=1, sampling=sampled),
        # Shares the first request's pages: its decode rows read another's prefix.
        DriverRequest(ids(11, 32, base) + [9, 8, 7], 6, arrive=4, share_from=0),
    ]


def _run(worker, *, chain: bool, team: bool = True, vocab: int = 30000):
    model = worker.runner.compute.model
    saved = model.decode_chain
    model.decode_chain = saved if chain else None
    if saved is not None:
        saved.use_team = team
    try:
        reqs = _requests(vocab)
        PlanDriver(worker.runner, worker.config.page_size, chunk=16).run(reqs)
    finally:
        model.decode_chain = saved
        if saved is not None:
            saved.use_team = True
    return [(r.outputs, r.logprob_values, r.top) for r in reqs]


@pytest.mark.parametrize("dequantize", [False, True], ids=["quantized", "float"])
def test_chain_equals_python_forward(dequantize: bool) -> None:
    worker = build_worker(
        WorkerConfig(model="default", threads=2, num_pages=200, dequantize=dequantize)
    )
    chain = worker.runner.compute.model.decode_chain
    assert chain is not None, "the default model on the CPU runs the chain"
    want = _run(worker, chain=False)
    before = chain.steps
    got = _run(worker, chain=True)
    assert chain.steps - before >= 8, "decode steps ran through the chain"
    assert got == want


# Every block size and type the kernel has, mixed within the fused q/k/v and
# gate/up: the team path quantizes each linear's rows once per block size.
# gguf's Python writer has no K-quant quantizer: those tensors are random
# valid blocks, written raw.
WRITTEN = {"attn_v": QType.Q8_0, "ffn_gate": QType.Q4_0, "ffn_down": QType.Q4_1}
RAW = {
    "q_proj": ("attn_q", "Q4_K"),
    "k_proj": ("attn_k", "Q6_K"),
    "o_proj": ("attn_output", "Q5_K"),
    "up_proj": ("ffn_up", "Q4_K"),
}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_team_path_equals_python_forward_on_every_type(tmp_path: Path, threads: int) -> None:
    """A tiny Llama whose dimensions the K-quants take (256, 512) as GGUF in
    every kernel type: the chain's team path (one OpenMP region a step), its
    op-by-op path and the Python forward agree bit for bit. Three threads on
    a machine of two cores lose their cores mid-step: their partners take
    their pieces of a phase and they catch up (decode_chain.c's phases)."""
    config = LlamaConfig(
        **{**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    )
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(config)
    hf.config.architectures = ["LlamaForCausalLM"]
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn_like(param) * 0.2)
    state = dict(hf.state_dict())
    raw = {}
    for name in [n for n in state if n.split(".")[-2] in RAW]:
        tensor = state.pop(name)
        gguf_part, qtype = RAW[name.split(".")[-2]]
        layer = int(name.split(".")[2])
        blocks = random_blocks(qtype, tensor.shape[0], tensor.shape[1], seed=layer)
        raw[f"blk.{layer}.{gguf_part}.weight"] = (blocks, QType[qtype])
    path = tmp_path / "mixed.gguf"
    write_model_gguf(path, hf.config, state, types=WRITTEN, extra_tensors=raw)
    worker = build_worker(
        WorkerConfig(model=str(path), threads=threads, num_pages=200, swa_memory=False)
    )
    chain = worker.runner.compute.model.decode_chain
    assert chain is not None and not chain.has_float
    vocab = config.vocab_size
    want = _run(worker, chain=False, vocab=vocab)
    before = chain.steps
    got_team = _run(worker, chain=True, vocab=vocab)
    assert chain.steps - before >= 8 and chain.team_threads == threads
    got_ops = _run(worker, chain=True, team=False, vocab=vocab)
    assert got_team == want
    assert got_ops == want
