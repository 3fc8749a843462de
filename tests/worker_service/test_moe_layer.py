"""The mixture-of-experts layer on its own (models/moe*.py): the routing
rules, the grouped expert forward against a dense reference, loading each
checkpoint spelling, and what the MoE families' config readers refuse."""

from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F

from tests.worker_service.support import published_moe_configs as published
from worker_service.device.distributed import TensorParallel
from worker_service.kernels import select_kernels
from worker_service.models.config import MoeConfig, UnsupportedModelError
from worker_service.models.moe import MoeBlock
from worker_service.models.moe_experts import MoeExperts, clamped_swiglu
from worker_service.models.moe_routing import TOPK_SOFTMAX, route
from worker_service.models.registry import config_from_hf
from worker_service.weights import open_model

CPU = torch.device("cpu")


def test_softmax_topk_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.0]])
    probs = logits.softmax(-1)
    plain = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=8, norm_topk_prob=False)
    weights, ids = route(logits, plain)
    assert ids.tolist() == [[0, 1], [2, 1]]
    assert torch.equal(weights, probs.gather(1, ids))
    normalised = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=8, norm_topk_prob=True)
    weights, _ = route(logits, normalised)
    assert torch.allclose(weights.sum(-1), torch.ones(2))
    assert torch.allclose(weights[0], probs[0, :2] / probs[0, :2].sum())


def test_topk_softmax_takes_the_softmax_over_the_chosen_logits_only():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    moe = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=8, router=TOPK_SOFTMAX)
    weights, ids = route(logits, moe)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, torch.tensor([[2.0, 1.0]]).softmax(-1))


def _experts(
    moe: MoeConfig, hidden: int, seed: int, tp: TensorParallel | None = None
) -> MoeExperts:
    experts = MoeExperts(
        hidden,
        moe,
        tp=tp or TensorParallel(),
        dtype=torch.float32,
        device=CPU,
        kernels=select_kernels(CPU, torch.float32),
    )
    g = torch.Generator().manual_seed(seed)
    i = moe.expert_intermediate_size
    for e in range(moe.num_experts):
        for part, shape in (("gate", (i, hidden)), ("up", (i, hidden)), ("down", (hidden, i))):
            experts.load_expert(e, part, "weight", torch.randn(shape, generator=g) * 0.1)
            if moe.expert_bias:
                bias = torch.randn(shape[0], generator=g) * 0.1
                experts.load_expert(e, part, "bias", bias)
    return experts


def dense_reference(experts: MoeExperts, x, weights, ids) -> torch.Tensor:
    """Every token through each of its experts, one token at a time."""
    out = torch.zeros_like(x)
    w13, w2 = experts.w13, experts.w2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            b13 = experts.b13[e] if experts.b13 is not None else None
            h = experts.activation(F.linear(x[t], w13[e], b13))
            y = F.linear(h, w2[e], experts.b2[e] if experts.b2 is not None else None)
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("biased", [False, True], ids=["silu", "clamped-swiglu-biased"])
def test_grouped_experts_equal_a_token_by_token_loop(biased):
    extra = {"expert_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0} if biased else {}
    moe = MoeConfig(num_experts=5, top_k=2, expert_intermediate_size=12, **extra)
    experts = _experts(moe, 16, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 16, generator=g)
    weights, ids = route(torch.randn(64, 5, generator=g), moe)
    ids[:, 0] = torch.where(ids[:, 0] == 4, 3, ids[:, 0])  # some expert gets no token
    ids[:, 1] = torch.where(ids[:, 1] == 4, 0, ids[:, 1])
    ids[ids[:, 0] == ids[:, 1], 1] = 2
    ids[ids[:, 0] == ids[:, 1], 1] = 1
    got = experts(x, weights, ids)
    assert torch.allclose(got, dense_reference(experts, x, weights, ids), atol=1e-6)
    assert experts(x[:0], weights[:0], ids[:0]).shape == (0, 16)


def test_clamped_swiglu_is_gpt_oss_activation():
    gate = torch.tensor([-9.0, -1.0, 0.5, 8.0])
    up = torch.tensor([-8.0, 0.3, 2.0, 9.0])
    got = clamped_swiglu(torch.cat([gate, up]), 1.702, 7.0)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    assert torch.allclose(got, (u + 1) * g * torch.sigmoid(1.702 * g))
    assert got[3] == pytest.approx(8.0 * 7.0 * torch.sigmoid(torch.tensor(7 * 1.702)).item())


class HalfRanks(TensorParallel):
    """One process playing both ranks of a 2-way split: the all-reduce is the
    caller's sum of the two ranks' partials."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank=rank, size=2)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("biased", [False, True])
def test_two_ranks_shards_sum_to_the_whole_layer(biased):
    extra = {"expert_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0} if biased else {}
    moe = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=12, **extra)
    whole = _experts(moe, 16, seed=3)
    halves = [_experts(moe, 16, seed=3, tp=HalfRanks(r)) for r in (0, 1)]
    assert halves[0].w13.shape == (4, 12, 16) and halves[0].w2.shape == (4, 16, 6)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 16, generator=g)
    weights, ids = route(torch.randn(10, 4, generator=g), moe)
    summed = halves[0](x, weights, ids) + halves[1](x, weights, ids)
    assert torch.allclose(summed, whole(x, weights, ids), atol=1e-6)


def test_a_block_refuses_a_router_bias_it_does_not_have():
    moe = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=8)
    block = MoeBlock(
        16,
        moe,
        tp=TensorParallel(),
        dtype=torch.float32,
        device=CPU,
        kernels=select_kernels(CPU, torch.float32),
    )
    with pytest.raises(ValueError, match="router bias"):
        block.router.load("bias", torch.zeros(4))
    with pytest.raises(ValueError, match="expert gate bias"):
        block.experts.load_expert(0, "gate", "bias", torch.zeros(8))


QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 256,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
}


def test_qwen3_moe_config_is_read():
    cfg = config_from_hf(QWEN3_MOE)
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.qk_norm
    assert cfg.moe == MoeConfig(
        num_experts=4, top_k=2, expert_intermediate_size=32, norm_topk_prob=True
    )


MIXTRAL = {
    **{k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "norm_topk_prob")},
    "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 4,
}
for _key in ("moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step"):
    del MIXTRAL[_key]
OLMOE = {**MIXTRAL, "architectures": ["OlmoeForCausalLM"], "num_experts": 4, "clip_qkv": None}
del OLMOE["num_local_experts"]
BASES = {"qwen3-moe": QWEN3_MOE, "mixtral": MIXTRAL, "olmoe": OLMOE}


@pytest.mark.parametrize("family", sorted(BASES))
def test_each_base_config_is_served(family):
    assert config_from_hf(BASES[family]).moe is not None


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("qwen3-moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3-moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3-moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3-moe", {"attention_bias": True}, "attention_bias"),
        ("qwen3-moe", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        ("qwen3-moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ],
)
def test_config_fields_not_implemented_are_refused_by_name(family, change, named):
    with pytest.raises(UnsupportedModelError, match=named):
        config_from_hf({**BASES[family], **change})


def test_mixtral_router_jitter_noise_is_training_only_and_accepted():
    cfg = config_from_hf({**MIXTRAL, "router_jitter_noise": 0.1, "sliding_window": 4096})
    assert cfg.moe is not None and cfg.moe.norm_topk_prob
    assert cfg.moe.expert_intermediate_size == 128
    assert cfg.sliding_window == 4096


@pytest.mark.parametrize(
    ("arch", "experts", "named"),
    [("olmoe", 64, "'olmoe'"), ("gpt-oss", 32, "'gpt-oss'"), ("qwen2moe", 60, "'qwen2moe'")],
    ids=["olmoe", "gpt-oss", "qwen2moe"],
)
def test_gguf_mixture_of_experts_files_we_do_not_read_are_refused_by_name(
    tmp_path, arch, experts, named
):
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_uint32(f"{arch}.expert_count", experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=f"mixture-of-experts .*{named}"):
        open_model(path)


def test_published_configs_are_read_as_their_models_run():
    qwen = config_from_hf(published.QWEN3_30B_A3B)
    assert qwen.moe == MoeConfig(num_experts=128, top_k=8, expert_intermediate_size=768)
    assert qwen.qk_norm and qwen.sliding_window is None and qwen.head_dim == 128
    mixtral = config_from_hf(published.MIXTRAL_8X7B)
    assert mixtral.moe == MoeConfig(num_experts=8, top_k=2, expert_intermediate_size=14336)
    olmoe = config_from_hf(published.OLMOE_1B_7B)
    assert olmoe.moe is not None and not olmoe.moe.norm_topk_prob and not olmoe.qk_norm
    bf16_copy = {k: v for k, v in published.GPT_OSS_20B.items() if k != "quantization_config"}
    gpt = config_from_hf(bf16_copy)
    assert gpt.moe == MoeConfig(
        num_experts=32,
        top_k=4,
        expert_intermediate_size=2880,
        router="topk_softmax",
        norm_topk_prob=False,
        router_bias=True,
        expert_bias=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )
    assert gpt.attention_sinks and gpt.qkv_bias and gpt.sliding_window == 128
    assert [gpt.window_of(i) for i in range(4)] == [128, None, 128, None]
    assert gpt.rope.scaling_type == "yarn" and gpt.rope.factor == 32.0 and not gpt.rope.truncate


def test_the_published_gpt_oss_checkpoint_is_refused_for_its_mxfp4_experts():
    with pytest.raises(UnsupportedModelError, match="quantization_config"):
        config_from_hf(published.GPT_OSS_20B)
