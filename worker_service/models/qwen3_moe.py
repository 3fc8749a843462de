"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k RMSNorm,
no biases) with a MoE MLP in every layer: softmax over all experts, top k,
renormalised iff ``norm_topk_prob``. Config: models/moe_families.py."""

from __future__ import annotations

from worker_service.models.moe_model import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    pass
