"""A sequence classifier's score head as its config.json declares it
(transformers' ``*ForSequenceClassification`` of the Llama family: the base
model's weights plus ``score.weight`` [num_labels, hidden], read at the last
prompt token's final-norm hidden state, and no LM head; ``layers.ScoreHead``
computes it). Rerankers are such classifiers with one label.

``ScoreHeadConfig`` is what config.json declares: the number of labels, their
names (``id2label``) and the activation its author declares for cross-encoder
scores. SGLang's ``get_cross_encoder_activation_function`` reads the latter
from ``sbert_ce_default_activation_function`` (a ``torch.nn.modules`` class,
only those, for safety) and otherwise applies none; sentence-transformers 4+
writes the same declaration as ``sentence_transformers.activation_fn``, which
we read too. We compute the activations below and refuse any other at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The architectures served as classifiers, by the causal LM they extend.
SEQUENCE_CLASSIFIERS: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}

# torch.nn.modules class -> our activation name (the API process applies it).
ACTIVATIONS: dict[str, str] = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Tanh": "tanh",
}


class UnsupportedScoreHeadError(ValueError):
    """The classifier declares something this worker does not compute."""


@dataclass(frozen=True, slots=True)
class ScoreHeadConfig:
    num_labels: int
    labels: tuple[str, ...]  # id2label, in index order
    activation: str = "identity"  # one of ACTIVATIONS' values


def score_head_from_hf(cfg: dict[str, Any]) -> ScoreHeadConfig:
    """A classifier's config.json -> its head. transformers writes
    ``id2label`` (string keys) and derives num_labels from it; a config
    with only ``num_labels`` gets LABEL_i, as transformers names them, and
    one with neither has transformers' default two (it leaves the default
    out of config.json)."""
    id2label = cfg.get("id2label") or {}
    num_labels = len(id2label) or int(cfg.get("num_labels", 2))
    if num_labels < 1:
        raise UnsupportedScoreHeadError("a sequence classifier needs at least one label")
    labels = tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))
    return ScoreHeadConfig(num_labels, labels, _activation(cfg))


def _activation(cfg: dict[str, Any]) -> str:
    declared = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function"
    )
    if declared is None:
        return "identity"  # SGLang's default (bge-reranker's raw logit)
    if declared not in ACTIVATIONS:
        raise UnsupportedScoreHeadError(
            f"the classifier's activation {declared!r} is not supported "
            f"(one of {sorted(ACTIVATIONS)})"
        )
    return ACTIVATIONS[declared]
