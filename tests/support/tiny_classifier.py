"""A tiny random-init sequence classifier (transformers'
``LlamaForSequenceClassification`` or ``Qwen2ForSequenceClassification``)
saved as a checkpoint with a word-level tokenizer whose pair template marks
the query and the document, and transformers' scores for it: the reference
the rerank tests compare against."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

WORDS = [
    "what",
    "is",
    "the",
    "capital",
    "of",
    "france",
    "paris",
    "berlin",
    "rome",
    "a",
    "city",
    "in",
    "europe",
    "germany",
    "italy",
    "river",
    "seine",
    "fish",
    "swim",
    "dogs",
    "bark",
    "cats",
    "sleep",
    "sun",
    "hot",
    "cold",
    "water",
    "blue",
    "sky",
    "green",
    "grass",
]
SPECIALS = ["[UNK]", "[BOS]", "[SEP]", "[EOS]"]
SIGMOID = "torch.nn.modules.activation.Sigmoid"
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def save_tokenizer(out: Path) -> PreTrainedTokenizerFast:
    """Whitespace words; a single text is [BOS] text, a pair [BOS] query
    [SEP] document (a template the pair must go through to match)."""
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A",
        pair="[BOS] $A [SEP] $B:1",
        special_tokens=[("[BOS]", vocab["[BOS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), **config)


def build_classifier(
    out: Path, *, family: str = "llama", num_labels: int = 1, activation: str | None = None
) -> PreTrainedModel:
    """A classifier with ``num_labels`` labels; ``activation``: the
    ``sbert_ce_default_activation_function`` its config declares (None: none)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(7)
    cfg = CONFIGS[family](
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(SPECIALS) + len(WORDS),
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=3,
        pad_token_id=None,  # transformers then scores the last token, as we do
        num_labels=num_labels,
    )
    cfg.architectures = [
        f"{CONFIGS[family].__name__.removesuffix('Config')}ForSequenceClassification"
    ]
    if activation is not None:
        cfg.sbert_ce_default_activation_function = activation
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random init's logits are ~0.01: spread them over a sigmoid's range
        model.score.weight.mul_(50.0)
    model.save_pretrained(out)
    save_tokenizer(out)
    return model


def hf_logits(model: PreTrainedModel, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().tolist()


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))
