"""What a model declares for its clients (weights/declarations.py): the pad
and BOS ids its tokenizer names and the author's sampling defaults, from a
Hugging Face directory or GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models

from tests.worker_service.weights.support.gguf_build import write_model_gguf
from tests.worker_service.weights.support.tiny_checkpoints import tiny_model
from worker_service.models.config import SamplingDefaults
from worker_service.weights import open_model

GENERATION = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": None,  # null: not a default
    "repetition_penalty": 1.05,
    "max_new_tokens": 7,
    "do_sample": True,
}


def _checkpoint(directory: Path) -> Path:
    tiny_model("llama-tied").save_pretrained(directory)
    return directory


def test_generation_config_sampling_defaults_and_the_tokenizers_pad(tmp_path: Path) -> None:
    _checkpoint(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION))
    tokenizer_config = {"pad_token": "<pad>", "added_tokens_decoder": {"5": {"content": "<pad>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    cfg = open_model(tmp_path).config
    assert cfg.sampling_defaults == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.05, max_new_tokens=7
    )
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_ids) == (5, 1, (2,))


def test_the_pad_token_from_the_vocabulary_else_config_json(tmp_path: Path) -> None:
    _checkpoint(tmp_path)
    vocab = {"[UNK]": 0, "a": 1, "<pad>": 3}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": {"content": "<pad>"}}))
    assert open_model(tmp_path).config.pad_token_id == 3
    # no pad token in the tokenizer: config.json's, never the first EOS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"pad_token_id": 9}))
    assert open_model(tmp_path).config.pad_token_id == 9
    (tmp_path / "config.json").write_text(json.dumps(config | {"pad_token_id": None}))
    cfg = open_model(tmp_path).config
    assert cfg.pad_token_id is None and cfg.sampling_defaults == SamplingDefaults()


def test_gguf_general_sampling_keys(tmp_path: Path) -> None:
    model = tiny_model("llama-tied")
    path = tmp_path / "m.gguf"
    sampling = {
        "general.sampling.temp": 0.7,
        "general.sampling.top_k": 40,
        "general.sampling.top_p": 0.8,
        "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": 1.1,
    }
    write_model_gguf(path, model.config, model.state_dict(), metadata=sampling)
    cfg = open_model(path).config
    assert cfg.sampling_defaults == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=40, min_p=0.05, repetition_penalty=1.1
    )  # float32 in the file, read back as written
    assert (cfg.pad_token_id, cfg.bos_token_id) == (2, 1)  # tokenizer.ggml.*
    # the generation_config.json rebuilt for clients says the same
    generation = json.loads(open_model(path).tokenizer_files()["generation_config.json"])
    assert generation["top_k"] == 40 and generation["temperature"] == 0.7
    bare = tmp_path / "bare.gguf"
    write_model_gguf(bare, model.config, model.state_dict())
    assert open_model(bare).config.sampling_defaults == SamplingDefaults()
