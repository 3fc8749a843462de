"""Dequantization: hand-made blocks decoded by the formats' definitions, float
types bit-exact, a mixed-type model within quantization error, and a type we
cannot decode refused when the file is opened."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from tests.worker_service.weights.support.gguf_build import write_model_gguf, write_tensors_gguf
from tests.worker_service.weights.support.tiny_checkpoints import expected_state, tiny_model
from worker_service.models.config import UnsupportedModelError
from worker_service.weights import open_model
from worker_service.weights.gguf_file import _dequantize

ROWS, COLS = 3, 64  # two 32-element blocks per row


def read_back(path: Path) -> dict[str, np.ndarray]:
    return {t.name: _dequantize(t) for t in gguf.GGUFReader(path).tensors}


def test_q8_0_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    scales = rng.uniform(0.01, 1.0, size=(ROWS, 2)).astype(np.float16)
    quants = rng.integers(-128, 128, size=(ROWS, 2, 32), dtype=np.int8)
    # block = fp16 scale d, then 32 int8 q; value = d * q
    blocks = np.concatenate([scales[..., None].view(np.uint8), quants.view(np.uint8)], axis=-1)
    write_tensors_gguf(tmp_path / "q8.gguf", {"w": (blocks.reshape(ROWS, -1), QType.Q8_0)})

    want = (scales.astype(np.float32)[..., None] * quants).reshape(ROWS, COLS)
    got = read_back(tmp_path / "q8.gguf")["w"]
    assert got.shape == (ROWS, COLS) and np.array_equal(got, want)


def test_q4_1_blocks(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    scales = rng.uniform(0.01, 1.0, size=(ROWS, 2)).astype(np.float16)
    mins = rng.uniform(-2.0, 0.0, size=(ROWS, 2)).astype(np.float16)
    nibbles = rng.integers(0, 16, size=(ROWS, 2, 32), dtype=np.uint8)
    # block = fp16 d, fp16 m, 16 bytes: byte j holds element j (low nibble)
    # and element j + 16 (high nibble); value = d * q + m
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    blocks = np.concatenate(
        [scales[..., None].view(np.uint8), mins[..., None].view(np.uint8), packed], axis=-1
    )
    write_tensors_gguf(tmp_path / "q4.gguf", {"w": (blocks.reshape(ROWS, -1), QType.Q4_1)})

    d, m = scales.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
    want = (d * nibbles + m).reshape(ROWS, COLS)
    got = read_back(tmp_path / "q4.gguf")["w"]
    assert got.shape == (ROWS, COLS) and np.array_equal(got, want)


def test_float_types_are_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    bf16 = torch.from_numpy(values).to(torch.bfloat16)
    bf16_bits = bf16.view(torch.int16).numpy().view(np.uint8)
    write_tensors_gguf(
        tmp_path / "floats.gguf",
        {
            "f32": (values, None),
            "f16": (values.astype(np.float16), None),
            "bf16": (bf16_bits, QType.BF16),
            "vector": (values[0], None),
        },
    )
    got = read_back(tmp_path / "floats.gguf")
    assert np.array_equal(got["f32"], values)
    assert np.array_equal(got["f16"], values.astype(np.float16).astype(np.float32))
    assert np.array_equal(got["bf16"], bf16.float().numpy())
    assert np.array_equal(got["vector"], values[0])


def test_mixed_type_model(tmp_path: Path) -> None:
    model = tiny_model("llama-untied")
    types = {
        "token_embd": QType.Q8_0,
        "attn_q": QType.Q4_1,
        "attn_k": QType.Q8_0,
        "attn_v": QType.BF16,
        "attn_output": QType.F16,
        "ffn_gate": QType.Q4_1,
        "ffn_up": QType.Q8_0,
        "output.": QType.Q4_1,
    }
    path = tmp_path / "mixed.gguf"
    write_model_gguf(path, model.config, model.state_dict(), types=types)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {QType.Q8_0, QType.Q4_1, QType.BF16, QType.F16, QType.F32} == set(stored.values())

    got = dict(open_model(path).tensors())
    want = expected_state(model)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        # Bounds: half a quantization step (Q4_1 spans max - min in 15
        # steps, Q8_0 spans +-absmax in 127) plus the fp16 scale's rounding.
        scale = tensor.abs().max().item()
        if "q_proj" in name or "gate_proj" in name or name == "lm_head.weight":
            atol = 2 * scale / 15 * 0.5 * 1.01
        elif "embed" in name or "k_proj" in name or "up_proj" in name:
            atol = scale / 127 * 0.5 * 1.01
        elif "v_proj" in name:
            atol = scale / 128
        elif "o_proj" in name:
            atol = scale / 1024
        else:
            atol = 0.0
        assert torch.allclose(got[name], tensor, rtol=0, atol=atol), name


def test_unsupported_quantization_type(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    state = dict(model.state_dict())
    del state["model.layers.1.mlp.down_proj.weight"]
    # Q8_1 is llama.cpp's internal activation format: gguf has no codec for it.
    block, block_bytes = gguf.GGML_QUANT_SIZES[QType.Q8_1]
    q8_1 = np.zeros((64, 128 // block * block_bytes), dtype=np.uint8)  # down_proj is [64, 128]
    path = tmp_path / "q8_1.gguf"
    extra = {"blk.1.ffn_down.weight": (q8_1, QType.Q8_1)}
    write_model_gguf(path, model.config, state, extra_tensors=extra, tokenizer=False)
    with pytest.raises(UnsupportedModelError, match=r"Q8_1.*blk\.1\.ffn_down\.weight"):
        open_model(path)
