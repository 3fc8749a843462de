"""Mixtral (MixtralForCausalLM): Mistral's attention (optional sliding
window) with a MoE MLP in every layer: softmax over all experts, top k,
always renormalised; experts named w1 (gate), w3 (up), w2 (down) under
``block_sparse_moe``. Config: models/moe_families.py."""

from __future__ import annotations

from worker_service.models.moe_model import MoeForCausalLM


class MixtralForCausalLM(MoeForCausalLM):
    pass
