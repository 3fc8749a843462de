"""Shared cases of the fused-kernel tests (test_fused_kernels.py on the CPU,
test_fused_kernels_gpu.py on CUDA): tiny random Llamas, one mixed step through
them, every op on random inputs, a sampler batch; each compared with the torch
kernels, raising AssertionError on a mismatch."""

from __future__ import annotations

import functools

import numpy as np
import torch

from tests.worker_service.support.attention_batches import make_batch
from worker_service.attention.base import AttentionSpec
from worker_service.attention.torch_backend import TorchAttention
from worker_service.device.kv_cache import KvCache
from worker_service.kernels import Kernels, TorchKernels
from worker_service.models.config import ModelConfig, RopeConfig
from worker_service.models.llama import LlamaForCausalLM
from worker_service.models.registry import family_of
from worker_service.models.rope import inverse_frequencies
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.sampling.rows import SampleRow
from worker_service.sampling.sampler import Sampler

CPU = torch.device("cpu")

MODELS = {
    # head_dim 64 and 128 take FlashInfer's RoPE; 32 falls back to torch's.
    "llama3-h64": ModelConfig(
        "LlamaForCausalLM", 128, 256, 3, 4, 2, 64, 384, rms_norm_eps=1e-5,
        rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 64), max_position_embeddings=256,
    ),
    "qwen3-qknorm-yarn-h128": ModelConfig(
        "Qwen3ForCausalLM", 128, 192, 2, 2, 1, 128, 384, qk_norm=True,
        rope=RopeConfig(10000.0, "yarn", 4.0, original_max_position_embeddings=64),
        max_position_embeddings=256,
    ),
    "gguf-freq-factors-bias-h64": ModelConfig(
        "Qwen2ForCausalLM", 128, 256, 2, 2, 2, 64, 384, qkv_bias=True,
        rope=RopeConfig(10000.0, freq_factors=tuple(np.linspace(1, 8, 32).tolist())),
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "linear-rope-h32": ModelConfig(
        "LlamaForCausalLM", 128, 256, 2, 4, 2, 32, 384,
        rope=RopeConfig(10000.0, "linear", 2.0), max_position_embeddings=256,
    ),
    # Partial rotary (Phi-4-mini): the table rotates the first half of each head.
    "phi3-partial-rotary-h64": ModelConfig(
        "Phi3ForCausalLM", 128, 256, 2, 2, 2, 64, 384,
        rope=RopeConfig(10000.0, partial_rotary_factor=0.5), max_position_embeddings=256,
    ),
    # Gemma's norms (query/key ones on strided heads), GeGLU, scaled embeddings,
    # its own local RoPE, the final soft-cap (models/gemma.py).
    "gemma3-h64": ModelConfig(
        "Gemma3ForCausalLM", 128, 256, 2, 2, 1, 64, 384, qk_norm=True,
        rope=RopeConfig(1e6, "linear", 8.0), rope_local=RopeConfig(100.0),
        layer_types=("sliding_attention", "full_attention"), sliding_window=4096,
        embed_scale=128**0.5, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcap=5.0, max_position_embeddings=256,
    ),
}  # fmt: skip


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # fp32: the references round like the torch kernels but for op order; bf16:
    # FlashInfer rounds once where the torch path rounds twice (1-2 bf16 ulps).
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def qkv_views(
    tokens: int, heads: int, kv_heads: int, dim: int, dtype, gen, device: torch.device = CPU
):
    """q, k, v as the model makes them: strided views of one fused projection."""
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(tokens, width, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v


def check_ops(kernels: Kernels, dtype: torch.dtype, device: torch.device = CPU) -> None:
    """Every op of ``kernels`` against the torch kernels on random inputs."""
    ref = TorchKernels()
    gen = torch.Generator().manual_seed(11)
    tol = tolerance(dtype)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x, w = rand(37, 256, scale=3.0), rand(256, scale=0.5) + 1
    torch.testing.assert_close(kernels.rmsnorm(x, w, 1e-5), ref.rmsnorm(x, w, 1e-5), **tol)

    out, res = rand(37, 256), rand(37, 256, scale=4.0)
    want_x, want_res = ref.add_rmsnorm(out, res, w, 1e-6)
    got_x, got_res = kernels.add_rmsnorm(out.clone(), res.clone(), w, 1e-6)
    torch.testing.assert_close(got_res, want_res, **tol)
    torch.testing.assert_close(got_x, want_x, **tol)

    for heads, kv_heads, dim in [(4, 2, 64), (8, 1, 128), (2, 2, 32)]:
        views = functools.partial(qkv_views, 29, heads, kv_heads, dim, dtype, device=device)
        q, k, _ = views(torch.Generator().manual_seed(dim))
        qk_w = rand(dim, scale=0.3) + 1
        torch.testing.assert_close(
            kernels.rmsnorm(q, qk_w, 1e-6), ref.rmsnorm(q, qk_w, 1e-6), **tol
        )
        rope = RopeConfig(10000.0, "yarn", 4.0, original_max_position_embeddings=32)
        inv_freq, scale = inverse_frequencies(rope, dim, 128)
        angles = torch.arange(128, dtype=torch.float32)[:, None] * inv_freq
        cache = (torch.cat((angles.cos(), angles.sin()), dim=-1) * scale).to(device)
        positions = torch.randint(0, 128, (29,), generator=gen).to(device)
        want_q, want_k = ref.rope(positions, q, k, cache)
        # The same values in the same strided views of a second buffer (a clone of
        # a view would be contiguous), for the kernels that rotate in place.
        q2, k2, _ = views(torch.Generator().manual_seed(dim))
        got_q, got_k = kernels.rope(positions, q2, k2, cache)
        torch.testing.assert_close(got_q, want_q, **tol)
        torch.testing.assert_close(got_k, want_k, **tol)

    gate_up = rand(23, 2 * 96, scale=2.0)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), ref.silu_and_mul(gate_up), **tol)


def tiny_model(
    name: str, dtype: torch.dtype, kernels: Kernels, device: torch.device = CPU
) -> LlamaForCausalLM:
    cfg = MODELS[name]
    cls = family_of(cfg.architecture).model_class
    model = cls(cfg, dtype=dtype, device=device, kernels=kernels)
    model.init_random_weights(seed=5)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # norms away from 1 and biases away from 0 make them count
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=gen).to(p) * 0.2)
    return model


def forward(model: LlamaForCausalLM, device: torch.device = CPU) -> tuple[torch.Tensor, ...]:
    """Hidden states and logits of one mixed step (two prefills, three decodes)."""
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    batch = make_batch([(9, 9), (5, 40)], [1, 17, 33], 16, 64, gen, str(device))
    spec = AttentionSpec(
        cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, None, model.dtype, device
    )
    attn = TorchAttention(spec)
    kv = KvCache(
        num_layers=cfg.num_layers,
        num_pages=64,
        page_size=16,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.dtype,
        device=device,
    )
    for layer in kv.layers:  # the prefixes the decodes read
        layer.copy_(torch.randn(layer.shape, generator=gen).to(layer))
    attn.begin_step(batch)
    ids = torch.randint(0, cfg.vocab_size, (batch.num_tokens,), generator=gen).to(device)
    hidden = model(ids, batch.positions, attn=attn, kv=kv)
    return hidden, model.logits(hidden), kv.layers[0]


def check_model(name: str, dtype: torch.dtype, kernels: Kernels) -> None:
    want = forward(tiny_model(name, dtype, TorchKernels()))
    got = forward(tiny_model(name, dtype, kernels))
    tol = tolerance(dtype)
    if dtype == torch.bfloat16 and MODELS[name].embed_scale:
        # Scaled embeddings make the residual stream ~sqrt(hidden) times larger,
        # so one bf16 ulp of it (0.0625 in [8, 16)) shows in near-zero outputs.
        tol = dict(atol=6.25e-2, rtol=3e-2)
    torch.testing.assert_close(got[2], want[2], **tol)  # keys and values (RoPE'd keys)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)


VOCAB = 3000


def sampler_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, list[SampleRow]]:
    """Logits and rows mixing greedy, filtered, seeded and unseeded rows."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    rows, logits = [], []
    for i in range(n):
        spec = SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])),
            top_k=int(rng.choice([-1, 1, 5, 40, 500, VOCAB, VOCAB + 7])),
            top_p=float(rng.choice([1.0, 0.95, 0.7, 0.2, 0.0])),
            min_p=float(rng.choice([0.0, 0.0, 0.02, 0.3])),
            seed=None if i % 7 == 0 else int(rng.integers(0, 2**40)),
            frequency_penalty=float(rng.choice([0.0, 0.5])),
        )
        output = rng.integers(0, VOCAB, size=int(rng.integers(0, 9))).tolist()
        rows.append(SampleRow(spec, LogprobOptions(), (), output))
        logits.append(torch.randn(VOCAB, generator=gen) * float(rng.uniform(0.5, 6.0)))
    return torch.stack(logits), rows


def check_sampler(kernels: Kernels, n: int = 600) -> None:
    logits, rows = sampler_batch(n)
    want = Sampler(VOCAB, CPU, seed=3, kernels=TorchKernels()).sample(logits, rows).token_ids
    got = Sampler(VOCAB, CPU, seed=3, kernels=kernels).sample(logits, rows).token_ids
    assert got == want, f"{sum(a != b for a, b in zip(got, want, strict=True))} of {n} differ"
