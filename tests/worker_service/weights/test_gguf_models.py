"""GGUF files written like llama.cpp's converter, per architecture: config from
metadata, names and Q/K layout back to the HF checkpoint, RoPE scaling, the
embedded tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.worker_service.weights.support.gguf_build import CHAT_TEMPLATE, write_model_gguf
from tests.worker_service.weights.support.tiny_checkpoints import (
    CONFIGS,
    assert_same_tensors,
    expected_state,
    tiny_model,
)
from worker_service.weights import open_model
from worker_service.weights.gguf_config import GgufMetadata
from worker_service.weights.tokenizer_files import gguf_chat_template


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_f32_gguf_gives_back_the_hf_checkpoint(kind: str, tmp_path: Path) -> None:
    model = tiny_model(kind)
    path = tmp_path / "model.gguf"
    write_model_gguf(path, model.config, model.state_dict())
    source = open_model(path)

    cfg, hf = source.config, model.config
    want_arch = "LlamaForCausalLM" if kind == "mistral" else hf.architectures[0]
    assert source.kind == "gguf" and cfg.architecture == want_arch
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 2, 96)
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.qk_norm == (kind == "qwen3")
    assert cfg.rope.theta == pytest.approx(hf.rope_parameters["rope_theta"])
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 256
    assert cfg.eos_token_ids == (2, 0)  # eos, then the end-of-turn token
    assert cfg.bos_token_id == 1

    # Exact: F32 storage, and the llama files' Q/K rows permuted back.
    assert_same_tensors(dict(source.tensors()), expected_state(model))


def test_rope_freqs_tensor_becomes_freq_factors(tmp_path: Path) -> None:
    model = tiny_model("llama-untied")
    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)  # head_dim 16 -> 8 frequencies
    path = tmp_path / "llama31.gguf"
    write_model_gguf(
        path, model.config, model.state_dict(), extra_tensors={"rope_freqs.weight": factors}
    )
    source = open_model(path)
    assert source.config.rope.freq_factors == tuple(float(f) for f in factors)
    assert source.config.rope.scaling_type is None
    names = [name for name, _ in source.tensors()]
    assert not any("rope" in name for name in names)
    assert sorted(names) == sorted(expected_state(model))


@pytest.mark.parametrize(
    ("scaling", "kind", "factor", "original"),
    [(("linear", 4.0, 64), "linear", 4.0, None), (("yarn", 4.0, 64), "yarn", 4.0, 64)],
)
def test_rope_scaling_metadata(scaling, kind, factor, original, tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    path = tmp_path / "scaled.gguf"
    write_model_gguf(path, model.config, model.state_dict(), rope_scaling=scaling)
    rope = open_model(path).config.rope
    assert (rope.scaling_type, rope.factor) == (kind, factor)
    assert rope.original_max_position_embeddings == original
    assert rope.attention_factor is None  # YaRN's default magnitude scale


def test_embedded_tokenizer(tmp_path: Path) -> None:
    model = tiny_model("llama-tied")
    path = tmp_path / "model.gguf"
    write_model_gguf(path, model.config, model.state_dict())
    files = open_model(path).tokenizer_files()

    config = json.loads(files["tokenizer_config.json"])
    assert config["chat_template"] == CHAT_TEMPLATE
    assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
    assert json.loads(files["generation_config.json"]) == {
        "bos_token_id": 1,
        "eos_token_id": [2, 0],
    }

    directory = tmp_path / "tok"
    directory.mkdir()
    for name, content in files.items():
        (directory / name).write_bytes(content)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    ids = tokenizer("hello world<|im_end|>").input_ids
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == ["hello", "Ġw"]
    assert ids[-1] == tokenizer.eos_token_id == 2
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_default_dtype_conversion(tmp_path: Path) -> None:
    model = tiny_model("qwen3")
    path = tmp_path / "model.gguf"
    write_model_gguf(path, model.config, model.state_dict())
    want = {name: t.to(torch.float16) for name, t in expected_state(model).items()}
    assert_same_tensors(dict(open_model(path).tensors(torch.float16)), want)


def test_named_chat_templates(tmp_path: Path) -> None:
    path = tmp_path / "templates.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    templates = [{"name": "default", "template": "A"}, {"name": "tool_use", "template": "B"}]
    writer.add_chat_template(templates)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = GgufMetadata(gguf.GGUFReader(path), str(path))
    assert gguf_chat_template(meta) == templates
