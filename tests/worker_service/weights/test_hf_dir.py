"""Hugging Face directories: config and tensors equal what transformers saved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.worker_service.weights.support.tiny_checkpoints import (
    CONFIGS,
    assert_same_tensors,
    expected_state,
    tiny_model,
)
from worker_service.weights import open_model


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_tensors_and_config_match_transformers(kind: str, tmp_path: Path) -> None:
    model = tiny_model(kind)
    model.save_pretrained(tmp_path)
    source = open_model(tmp_path)

    hf = model.config
    cfg = source.config
    assert source.kind == "hf" and source.path == tmp_path
    assert cfg.architecture == hf.architectures[0]
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 2, 96)
    assert cfg.head_dim == (32 if kind == "qwen3" else 16)
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.qkv_bias == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"]
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.eos_token_ids[0] == 2 and cfg.bos_token_id == 1

    assert_same_tensors(dict(source.tensors()), expected_state(model))


def test_sharded_checkpoint_and_dtype(tmp_path: Path) -> None:
    model = tiny_model("llama-untied", seed=1)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2

    source = open_model(str(tmp_path))
    want = expected_state(model)
    assert_same_tensors(dict(source.tensors()), want)
    bf16 = {name: t.to(torch.bfloat16) for name, t in want.items()}
    assert_same_tensors(dict(source.tensors(torch.bfloat16)), bf16)


def test_tensors_are_streamed(tmp_path: Path) -> None:
    tiny_model("qwen2").save_pretrained(tmp_path)
    stream = open_model(tmp_path).tensors()
    name, tensor = next(stream)  # a generator: nothing is loaded up front
    assert isinstance(name, str) and tensor.dtype == torch.float32


def test_generation_config_adds_eos_ids(tmp_path: Path) -> None:
    tiny_model("llama-tied").save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    assert open_model(tmp_path).config.eos_token_ids == (2, 7, 9)


def test_tokenizer_files_carry_the_chat_template(tmp_path: Path) -> None:
    tiny_model("llama-tied").save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "README.md").write_text("not a tokenizer file")

    files = open_model(tmp_path).tokenizer_files()
    assert set(files) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
    }
    config = json.loads(files["tokenizer_config.json"])
    assert config == {"eos_token": "</s>", "chat_template": "{{ messages }}"}
