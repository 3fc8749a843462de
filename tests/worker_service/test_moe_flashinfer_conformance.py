"""The MoE layer through FlashInfer's fused MoE, checked on the CPU: our
calls go through FlashInfer 0.7.2's real ``cutlass_fused_moe`` wrapper with
a torch stand-in for the compiled op that checks every argument against the
kernel's contract (support/fused_moe_cpu_harness.py), and give the grouped
torch path's results: Qwen-style SiLU experts and GPT-OSS's biased, clamped
SwiGLU experts, whole and as two tensor-parallel shards, and a bf16 worker
whose layers all run fused."""

from __future__ import annotations

import pytest
import torch

from tests.worker_service.support.fused_moe_cpu_harness import (
    FusedMoeContractError,
    install_fused_moe_harness,
)
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.worker_factory import runner_for
from worker_service.device.distributed import TensorParallel
from worker_service.kernels import select_kernels
from worker_service.models import moe_kernel
from worker_service.models.config import MoeConfig
from worker_service.models.moe import MoeBlock

CPU = torch.device("cpu")
BF16 = torch.bfloat16
SILU = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=16, norm_topk_prob=True)
GPT_OSS = MoeConfig(
    num_experts=4,
    top_k=2,
    expert_intermediate_size=16,
    router="topk_softmax",
    norm_topk_prob=False,
    router_bias=True,
    expert_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to bf16 rounding (2% of the largest value; a swapped gate and
    up, or a bias counted twice, is off by far more)."""
    return float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())


class HalfRanks(TensorParallel):
    """One process playing one rank of two: the caller sums the partials."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank=rank, size=2)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _block(moe: MoeConfig, *, fused: bool, tp: TensorParallel | None = None) -> MoeBlock:
    block = MoeBlock(
        32, moe, tp=tp or TensorParallel(), dtype=BF16, device=CPU,
        kernels=select_kernels(CPU, BF16), fused=fused,
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    block.router.load("weight", torch.randn(4, 32, generator=g).to(BF16))
    if moe.router_bias:
        block.router.load("bias", torch.randn(4, generator=g).to(BF16))
    for e in range(4):
        for part, shape in (("gate", (16, 32)), ("up", (16, 32)), ("down", (32, 16))):
            block.experts.load_expert(e, part, "weight", (torch.randn(shape, generator=g) * 0.3))
            if moe.expert_bias:
                block.experts.load_expert(e, part, "bias", torch.randn(shape[0], generator=g))
    return block


@pytest.mark.parametrize("moe", [SILU, GPT_OSS], ids=["silu", "gpt-oss"])
def test_fused_moe_gives_the_grouped_paths_results(monkeypatch, moe):
    module = install_fused_moe_harness(monkeypatch)
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(8)).to(BF16) * 2
    want = _block(moe, fused=False)(x)
    fused = _block(moe, fused=True)
    got = fused(x)
    assert close(got, want)
    (call,) = module.calls
    assert module.arch == "90"
    # [up | gate] rows: expert 0's first rows are its up projection.
    experts = fused.experts
    assert torch.equal(call["fc1_expert_weights"], experts.w13)
    grouped = _block(moe, fused=False).experts
    assert torch.equal(experts.w13[:, :16], grouped.w13[:, 16:])
    assert torch.equal(experts.w13[:, 16:], grouped.w13[:, :16])
    if moe.swiglu_limit is None:
        assert call["swiglu_alpha"] is None and call["fc1_expert_biases"] is None
    else:
        assert call["swiglu_alpha"].tolist() == pytest.approx([1.702] * 4)
        assert call["swiglu_beta"].tolist() == [1.0] * 4
        assert call["swiglu_limit"].tolist() == [7.0] * 4
        assert torch.equal(call["fc1_expert_biases"][:, :16], grouped.b13[:, 16:])
        assert torch.equal(call["fc2_expert_biases"], grouped.b2)


@pytest.mark.parametrize("moe", [SILU, GPT_OSS], ids=["silu", "gpt-oss"])
def test_two_shards_sum_to_the_whole_layer_and_the_down_bias_is_added_once(monkeypatch, moe):
    module = install_fused_moe_harness(monkeypatch)
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(9)).to(BF16)
    whole = _block(moe, fused=True)(x)
    halves = [_block(moe, fused=True, tp=HalfRanks(r))(x) for r in (0, 1)]
    assert close(halves[0].float() + halves[1].float(), whole)
    _, rank0, rank1 = module.calls
    assert rank0["fc1_expert_weights"].shape == (4, 16, 32)
    assert rank0["fc2_expert_weights"].shape == (4, 32, 8)
    if moe.expert_bias:
        assert rank0["fc2_expert_biases"] is not None and rank1["fc2_expert_biases"] is None


def test_the_harness_refuses_what_the_kernel_would(monkeypatch):
    module = install_fused_moe_harness(monkeypatch)
    from flashinfer.fused_moe import cutlass_fused_moe
    from flashinfer.tllm_enums import ActivationType

    block = _block(SILU, fused=True)
    x = torch.randn(3, 32).to(BF16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])  # int64: the kernel reads int32
    with pytest.raises(FusedMoeContractError, match="int32"):
        cutlass_fused_moe(
            x, ids, torch.ones(3, 2), block.experts.w13, block.experts.w2, BF16, [],
            output=torch.empty_like(x), activation_type=ActivationType.Swiglu,
        )  # fmt: skip
    assert module.calls == []


def test_the_kernel_is_chosen_at_start_for_bf16_on_fitting_gpus_only(monkeypatch):
    choose = moe_kernel.choose_moe_kernel
    assert choose(CPU, BF16) == moe_kernel.MoeKernelChoice("torch", "not on CUDA")
    cuda = torch.device("cuda", 0)
    assert "bf16" in choose(cuda, torch.float16).reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert choose(cuda, BF16).reason == "FlashInfer's fused MoE has no kernels for sm80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert choose(cuda, BF16) == moe_kernel.MoeKernelChoice("flashinfer", "")


@pytest.mark.slow  # transformers builds the checkpoint
def test_a_bf16_worker_runs_every_layer_fused_with_the_grouped_paths_tokens(monkeypatch, tmp_path):
    from tests.worker_service.support.tiny_moe_models import tiny_moe_model

    tiny_moe_model("qwen3-moe", tmp_path)
    prompt = list(range(20, 45))
    plain = runner_for(tmp_path, dtype="bfloat16", page_size=4, num_pages=64, threads=1)
    (want,) = PlanDriver(plain, 4).run([DriverRequest(prompt, 8)])
    module = install_fused_moe_harness(monkeypatch)
    fused = runner_for(tmp_path, dtype="bfloat16", page_size=4, num_pages=64, threads=1)
    assert all(layer.mlp.experts.fused is not None for layer in fused.compute.model.layers)
    (got,) = PlanDriver(fused, 4).run([DriverRequest(prompt, 8)])
    assert len(module.calls) == 2 * 8  # 2 layers x (1 prefill + 7 decode steps)
    assert got.outputs == want.outputs
