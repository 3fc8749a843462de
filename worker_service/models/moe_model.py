"""What the mixture-of-experts families share: Llama's decoder layer with a
MoE block (models/moe.py) for its MLP, and the loading of router and expert weights
in their checkpoint spellings.

Checkpoint names handled here (layer prefix ``model.layers.{i}.``):

- per expert, as transformers saves Qwen3-MoE and OLMoE:
  ``mlp.experts.{e}.{gate,up,down}_proj.weight``, router ``mlp.gate.weight``;
- per expert, Mixtral's: ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``
  (gate, up, down), router ``block_sparse_moe.gate.weight``;
- stacked, transformers 5's in-memory layout some checkpoints keep:
  ``mlp.experts.gate_up_proj`` (E, 2I, hidden: gate rows then up rows) and
  ``mlp.experts.down_proj`` (E, hidden, I).

GPT-OSS's own spelling (stacked, transposed, interleaved) is in models/gpt_oss.py.
LoRA adapters reach the attention projections only: the experts are no LoRA
target (models/lora_loader.py refuses them by name).
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
import torch
from torch import nn

from worker_service.models import moe_kernel
from worker_service.models.config import ModelConfig
from worker_service.models.layers import LayerBuild
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.moe import MoeBlock

logger = structlog.get_logger(__name__)

# checkpoint module name -> expert part
EXPERT_PARTS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
# Where a MoE layer's MLP lives in each family's checkpoint.
MOE_MODULES = ("mlp", "block_sparse_moe")


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama decoder loop with MoE MLPs; families set ``attention_class``."""

    # Decode steps run eagerly (models/moe_kernel.py says why).
    decode_graphs_supported = False

    def make_mlp(self, cfg: ModelConfig, build: LayerBuild) -> nn.Module:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture}: a MoE layer needs config.moe")
        fused = self._moe_kernel(build.device, build.dtype)
        return MoeBlock(cfg.hidden_size, cfg.moe, tp=build.tp, fused=fused, **build.norm)

    def _moe_kernel(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether FlashInfer's fused MoE runs the experts: chosen (and said)
        once, when the first layer is built."""
        choice = self.__dict__.get("moe_kernel")
        if choice is None:
            choice = moe_kernel.choose_moe_kernel(device, dtype)
            self.__dict__["moe_kernel"] = choice
            log = logger.warning if device.type == "cuda" and choice.reason else logger.info
            log("MoE experts", kernel=choice.name, why_not_flashinfer=choice.reason or None)
        return choice.name == "flashinfer"

    # ------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded: set[tuple[int, int, str, str]] = set()

        def tracked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                loaded.update(self._expert_entries(name))
                yield name, tensor

        super().load_weights(tracked())
        moe = self.config.moe
        assert moe is not None
        kinds = ("weight", "bias") if moe.expert_bias else ("weight",)
        expected = {
            (layer, expert, part, kind)
            for layer in range(self.config.num_layers)
            for expert in range(moe.num_experts)
            for part in ("gate", "up", "down")
            for kind in kinds
        }
        if missing := sorted(expected - loaded):
            raise ValueError(
                f"the checkpoint lacks {len(missing)} expert tensors, e.g. (layer, expert, "
                f"part, kind) {missing[:3]}"
            )

    def _expert_entries(self, name: str) -> list[tuple[int, int, str, str]]:
        """The (layer, expert, part, kind) a checkpoint tensor fills."""
        parts = name.removeprefix("model.").split(".")
        if len(parts) < 5 or parts[0] != "layers" or parts[3] != "experts":
            return []
        layer, moe = int(parts[1]), self.config.moe
        assert moe is not None
        if parts[4].isdigit() and parts[5] in EXPERT_PARTS:
            return [(layer, int(parts[4]), EXPERT_PARTS[parts[5]], parts[-1])]
        stacked = {
            "gate_up_proj": (("gate", "up"), "weight"),
            "down_proj": (("down",), "weight"),
            "gate_up_proj_bias": (("gate", "up"), "bias"),
            "down_proj_bias": (("down",), "bias"),
        }
        if parts[4] in stacked:
            names, kind = stacked[parts[4]]
            return [(layer, e, p, kind) for e in range(moe.num_experts) for p in names]
        return []

    def _targets(self, name: str) -> list[str]:
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[2] in MOE_MODULES:
            prefix = f"layers.{parts[1]}.mlp."
            if parts[3] in ("gate", "router"):
                return [prefix + "router." + parts[-1]]
            if parts[3] == "experts":
                kind = "b" if parts[-1] == "bias" or parts[-1].endswith("_bias") else "w"
                down = "down" in name or parts[-2] == "w2"
                return [prefix + "experts." + kind + ("2" if down else "13")]
        return LlamaForCausalLM._targets(name)

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 5 and parts[0] == "layers" and parts[2] in MOE_MODULES:
            self._load_moe(self.layers[int(parts[1])].mlp, parts[3:], tensor, name)
            return
        super()._load_one(name, tensor)

    def _load_moe(self, block: MoeBlock, parts: list[str], tensor: torch.Tensor, name: str) -> None:
        """``parts``: the name after ``layers.{i}.mlp.``."""
        if parts[0] in ("gate", "router") and len(parts) == 2:
            block.router.load(parts[1], tensor)
        elif parts[0] == "experts" and parts[1].isdigit() and parts[2] in EXPERT_PARTS:
            block.experts.load_expert(int(parts[1]), EXPERT_PARTS[parts[2]], parts[3], tensor)
        elif parts[0] == "experts" and parts[1:] == ["gate_up_proj"]:
            gate, up = tensor.chunk(2, dim=1)
            block.experts.load_stacked("gate", "weight", gate)
            block.experts.load_stacked("up", "weight", up)
        elif parts[0] == "experts" and parts[1:] == ["down_proj"]:
            block.experts.load_stacked("down", "weight", tensor)
        else:
            raise ValueError(f"unexpected weight {name!r}")
