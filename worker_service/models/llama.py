"""The Llama family in one implementation: Llama 2/3, Mistral, Qwen2/2.5
(qkv bias), Qwen3 (qk-norm), SmolLM2 (tied embeddings); GQA, SwiGLU, RoPE
with scaling.

The forward runs over a flat batch of tokens from many requests (no padding):
every token carries its position, and attention goes through the backend,
which reads and writes the paged KV cache. Only the rows that need logits
(the last token of each sampling request, prompt-logprob positions) reach
the LM head.

The small ops (norms, RoPE, SiLU-and-mul) go through the model's ``Kernels``
(worker_service/kernels/): torch on CPU, FlashInfer's fused kernels on CUDA.
The decoder loop is written the way the fused kernels want it (as SGLang and
vLLM do): each residual add is done together with the norm that follows it,
the next layer's input norm or, after the last layer, the final norm:

    residual = embed(ids);  x = input_norm_0(residual)
    per layer i:  residual += attn_i(x);  x = post_attention_norm_i(residual)
                  residual += mlp_i(x);   x = input_norm_{i+1}(residual)  (final norm)

which is the Hugging Face computation, op for op (the torch kernels add, then
norm: the CPU path stays bit-identical).

LoRA: ``forward`` takes the step's ``LoraBatch`` (None: base model only) and
hands it to every projection through the model's ``LoraContext`` for the
length of the forward; each projection knows its layer and module name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from worker_service.attention.base import AttentionBackend
from worker_service.device.distributed import TensorParallel
from worker_service.device.kv_cache import KvCache
from worker_service.kernels import Kernels, select_kernels
from worker_service.lora.batch import LoraBatch, LoraContext
from worker_service.models.config import ModelConfig
from worker_service.models.family import FamilySupport, ModelFamily
from worker_service.models.layers import (
    FusedColumnLinear,
    LayerBuild,
    RMSNorm,
    RowLinear,
    ScoreHead,
    VocabEmbedding,
)
from worker_service.models.rope import RotaryEmbedding
from worker_service.models.score_head import SEQUENCE_CLASSIFIERS


class DecodeFastPath(Protocol):
    """What runs a step's stack instead of the Python loop where it can
    (models/cpu_decode_chain.DecodeChain); None from ``run``: it cannot."""

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, kv: KvCache
    ) -> torch.Tensor | None: ...


class LlamaAttention(nn.Module):
    """q/k/v projection, query/key norms, RoPE, attention, output projection.
    A family changes it through its hooks: ``o_proj_bias``, ``qk_norm_class``
    (the per-head norm a ``cfg.qk_norm`` model gets) or ``qk_norms`` (another
    kind), ``qk`` (where the norms apply); ``cfg.attention_sinks`` adds a
    learned sink logit per head (GPT-OSS)."""

    o_proj_bias = False
    qk_norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, build: LayerBuild) -> None:
        super().__init__()
        tp = build.tp
        self.num_heads = cfg.num_heads // tp.size
        self.num_kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        parts = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size}
        self.qkv_proj = FusedColumnLinear(
            cfg.hidden_size,
            parts,
            bias=cfg.qkv_bias,
            lora=build.site("qkv_proj"),
            **build.linear,
        )
        self.o_proj = RowLinear(
            cfg.q_size,
            cfg.hidden_size,
            bias=self.o_proj_bias,
            lora=build.site("o_proj"),
            **build.linear,
        )
        self.q_norm, self.k_norm = self.qk_norms(cfg, build)
        self.sinks: nn.Parameter | None = None
        if cfg.attention_sinks:
            self.heads_lo, _ = tp.shard(cfg.num_heads, "attention heads")
            # float32, as the backends take them (a sink is one logit per head).
            sinks = torch.empty(self.num_heads, dtype=torch.float32, device=build.device)
            self.sinks = nn.Parameter(sinks, requires_grad=False)

    def qk_norms(
        self, cfg: ModelConfig, build: LayerBuild
    ) -> tuple[nn.Module | None, nn.Module | None]:
        """The query and key norms (None: none); a family's hook. Llama's
        (Qwen3's): ``qk_norm_class`` over each head."""
        if not cfg.qk_norm:
            return None, None
        norm, eps = self.qk_norm_class, cfg.rms_norm_eps
        return norm(cfg.head_dim, eps, **build.norm), norm(cfg.head_dim, eps, **build.norm)

    def qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's q and k projections, (T, width) -> (T, heads, head_dim),
        normed; a family's hook (where the norms apply)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def forward(
        self,
        layer: int,
        positions: torch.Tensor,
        x: torch.Tensor,
        *,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        kv: KvCache,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        q, k = self.qk(q, k)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        out = attn.forward(layer, q, k, v, kv=kv, sinks=self.sinks)
        return self.o_proj(out.reshape(-1, self.num_heads * self.head_dim))

    def load_sinks(self, tensor: torch.Tensor) -> None:
        assert self.sinks is not None
        self.sinks.data.copy_(tensor[self.heads_lo : self.heads_lo + self.num_heads])


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, build: LayerBuild) -> None:
        super().__init__()
        self.kernels = build.kernels
        parts = {"gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size}
        self.gate_up_proj = FusedColumnLinear(
            cfg.hidden_size,
            parts,
            bias=cfg.mlp_bias,
            lora=build.site("gate_up_proj"),
            **build.linear,
        )
        self.down_proj = RowLinear(
            cfg.intermediate_size,
            cfg.hidden_size,
            bias=cfg.mlp_bias,
            lora=build.site("down_proj"),
            **build.linear,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up_proj's output is [gate | up] (this rank's shard of each).
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """A layer's norms around the attention and MLP its model built."""

    def __init__(
        self, cfg: ModelConfig, attention: nn.Module, mlp: nn.Module, build: LayerBuild
    ) -> None:
        super().__init__()
        eps, on = cfg.rms_norm_eps, build.norm
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, **on)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, **on)
        self.mlp = mlp


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tp: TensorParallel | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels``: None picks them for the device and dtype (select_kernels)."""
        super().__init__()
        tp = tp or TensorParallel()
        device = torch.device(device)
        kernels = kernels or select_kernels(device, dtype)
        self.kernels = kernels
        tp.shard(cfg.num_heads, "attention heads")
        tp.shard(cfg.num_kv_heads, "KV heads")
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        on = {"tp": tp, "dtype": dtype, "device": device}
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, **on)
        # The running step's LoRA work, shared by every projection.
        self.lora = LoraContext()
        self.layers = nn.ModuleList(
            self.decoder_layer(
                cfg,
                LayerBuild(
                    tp=tp, dtype=dtype, device=device, kernels=kernels, lora=self.lora, layer=i
                ),
            )
            for i in range(cfg.num_layers)
        )
        self.norm = self.norm_class(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device, kernels=kernels
        )
        # A sequence classifier has a score head instead of an LM head: it
        # scores prompts (embedding requests) and never samples.
        self.score: ScoreHead | None = None
        self.lm_head: VocabEmbedding | None
        if cfg.score_head is not None:
            self.lm_head = None
            self.score = ScoreHead(
                cfg.hidden_size, cfg.score_head.num_labels, dtype=dtype, device=device
            )
        elif cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, **on)
        self.rope = RotaryEmbedding(cfg, device, kernels)

    # A family's hooks for its layers (section 5 of docs/design.md): the
    # classes below, or ``make_mlp`` for an MLP built otherwise (MoE).
    attention_class: type[LlamaAttention] = LlamaAttention
    norm_class: type[RMSNorm] = RMSNorm  # the final norm's
    mlp_class: type[LlamaMLP] = LlamaMLP
    layer_class: type[nn.Module] = LlamaDecoderLayer
    # The CPU decode steps' C path (models/cpu_decode_chain.py), set by the
    # worker after packing where the model qualifies.
    decode_chain: DecodeFastPath | None = None

    def decoder_layer(self, cfg: ModelConfig, build: LayerBuild) -> nn.Module:
        """Layer ``build.layer`` of the stack: ``layer_class`` around its attention and MLP."""
        attention = self.attention_class(cfg, build)
        return self.layer_class(cfg, attention, self.make_mlp(cfg, build), build)

    def make_mlp(self, cfg: ModelConfig, build: LayerBuild) -> nn.Module:
        """Layer ``build.layer``'s MLP: ``mlp_class``; a family's hook."""
        return self.mlp_class(cfg, build)

    @property
    def num_local_kv_heads(self) -> int:
        return self.config.num_kv_heads // self.tp.size

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        attn: AttentionBackend,
        kv: KvCache,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Final hidden states (T, hidden) of a flat token batch (the module
        docstring has the loop's shape); ``lora``: the step's adapter rows."""
        self.lora.batch = lora
        try:
            return self._forward(input_ids, positions, attn, kv)
        finally:
            self.lora.batch = None

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv: KvCache,
    ) -> torch.Tensor:
        chain = self.decode_chain
        if chain is not None and (hidden := chain.run(input_ids, positions, attn, kv)) is not None:
            return hidden
        residual = self.embed_tokens(input_ids)
        layers = self.layers
        if not layers:
            return self.norm(residual)
        x = layers[0].input_layernorm(residual)
        for i, layer in enumerate(layers):
            out = layer.self_attn(i, positions, x, rope=self.rope, attn=attn, kv=kv)
            x, residual = layer.post_attention_layernorm.add_forward(out, residual)
            out = layer.mlp(x)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            x, residual = next_norm.add_forward(out, residual)
        return x

    @property
    def generates(self) -> bool:
        """Whether it has an LM head (a sequence classifier has none)."""
        return self.lm_head is not None

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError("a sequence classifier has no LM head: it scores, never samples")
        logits = self.lm_head.logits(hidden)
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pack_linears_for_cpu(self) -> int:
        """Pack every projection and the LM head for oneDNN (models/cpu_linear.py),
        once the weights are loaded; how many were packed (0 off the CPU)."""
        packed = 0
        for module in [*self.modules()]:
            if module is self.embed_tokens and module is not self.lm_head:
                continue  # an embedding table only, never a matmul
            if hasattr(module, "pack_for_cpu"):
                module.pack_for_cpu()
                packed += module.packed is not None
        return packed

    # ------------------------------------------------------------ weights
    @torch.no_grad()
    def init_random_weights(self, seed: int = 0) -> None:
        """Draw every parameter in place on its device (benchmarks without
        weights): norms 1, the rest N(0, 0.02)."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; every parameter must be covered exactly once."""
        missing = {n for n, _ in self.named_parameters()}
        for name, tensor in weights:
            for target in self._targets(name):
                missing.discard(target)
            self._load_one(name, tensor)
        if self.config.tie_word_embeddings or self.lm_head is None:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}"
            )

    @staticmethod
    def _targets(name: str) -> list[str]:
        name = name.removeprefix("model.")
        for part, fused in (
            ("q_proj", "qkv_proj"),
            ("k_proj", "qkv_proj"),
            ("v_proj", "qkv_proj"),
            ("gate_proj", "gate_up_proj"),
            ("up_proj", "gate_up_proj"),
        ):
            if f".{part}." in name:
                return [name.replace(part, fused)]
        return [name]

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        parts = name.removeprefix("model.").split(".")
        if parts[0] == "embed_tokens":
            self.embed_tokens.load(tensor)
        elif parts[0] == "lm_head":
            if self.lm_head is None:
                return  # a classifier saved beside its causal LM's head (SGLang skips it too)
            if not self.config.tie_word_embeddings:
                self.lm_head.load(tensor)
        elif parts[0] == "score" and self.score is not None and parts[1] == "weight":
            self.score.load(tensor)
        elif parts[0] == "norm":
            self.norm.load(parts[1], tensor)
        elif parts[0] == "layers":
            layer = self.layers[int(parts[1])]
            module, sub, kind = parts[2], parts[3], parts[-1]
            if module in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, module).load(kind, tensor)
            elif sub in ("q_proj", "k_proj", "v_proj"):
                layer.self_attn.qkv_proj.load(sub, kind, tensor)
            elif sub == "o_proj":
                layer.self_attn.o_proj.load(kind, tensor)
            elif sub in ("q_norm", "k_norm") and layer.self_attn.q_norm is not None:
                getattr(layer.self_attn, sub).load(kind, tensor)
            elif parts[2:] == ["self_attn", "sinks"] and layer.self_attn.sinks is not None:
                layer.self_attn.load_sinks(tensor)
            elif sub in ("gate_proj", "up_proj"):
                layer.mlp.gate_up_proj.load(sub, kind, tensor)
            elif sub == "down_proj":
                layer.mlp.down_proj.load(kind, tensor)
            elif "rotary_emb" not in name:
                raise ValueError(f"unexpected weight {name!r}")
        else:
            raise ValueError(f"unexpected weight {name!r}")


def _read_config(architecture: str, cfg: dict) -> ModelConfig:
    return ModelConfig.from_hf(cfg)


FAMILY = ModelFamily(
    name="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        # The same class with a score head instead of the LM head (config.score_head).
        *SEQUENCE_CLASSIFIERS,
    ),
    model_class=LlamaForCausalLM,
    read_config=_read_config,
    support=FamilySupport(gguf=True),
)
