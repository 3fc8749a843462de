"""The shape and rules of a mixture-of-experts MLP (models/moe.py).

Held by ``ModelConfig.moe`` (None: a dense model); each MoE family's
``read_config`` fills it from its config.json.
"""

from __future__ import annotations

from dataclasses import dataclass

# The routing rules (models/moe_routing.py):
# softmax over all experts, then the top k (Qwen3-MoE, OLMoE, Mixtral) ...
SOFTMAX_TOPK = "softmax_topk"
# ... or the top k router logits, then a softmax over those k (GPT-OSS).
TOPK_SOFTMAX = "topk_softmax"

# The experts' activations (models/moe_experts.py).
SILU = "silu"  # silu(gate) * up
CLAMPED_SWIGLU = "clamped_swiglu"  # GPT-OSS: clamped, sigmoid(alpha * gate), (up + 1)


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    # Renormalise the top k probabilities to sum to 1 (softmax_topk only).
    norm_topk_prob: bool = False
    router: str = SOFTMAX_TOPK
    router_bias: bool = False
    # Biases on the experts' gate/up and down projections (GPT-OSS).
    expert_bias: bool = False
    activation: str = SILU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # A dense expert every token also takes (Qwen2-MoE style); 0: none. No
    # family served today has one: kept so a reader can refuse it by name.
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} of {self.num_experts} experts")
        if self.router not in (SOFTMAX_TOPK, TOPK_SOFTMAX):
            raise ValueError(f"unknown MoE router rule {self.router!r}")
        if self.activation not in (SILU, CLAMPED_SWIGLU):
            raise ValueError(f"unknown MoE expert activation {self.activation!r}")
