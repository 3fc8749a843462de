"""Rerank: SGLang's cross-encoder path (``EmbedRequest.is_cross_encoder``) on a
sequence classifier, a model whose worker reports a score head.

The pair to score is ``texts`` = [query, document], tokenized together as
SGLang's tokenizer manager does (``tokenizer(query, document)``: the
tokenizer's pair template), or already tokenized by the client
(``tokenized``, which is all SGLang's servicer reads). The score is the
classifier's logits at the pair's last token, then the activation the model
declares for cross-encoder scores (identity unless its config names one:
SGLang's ``CrossEncodingPooler``), one value per label.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service.core.sampling import InvalidRequestError


@dataclass(frozen=True, slots=True)
class ScoringHead:
    """A sequence classifier's score head as the worker reports it (GetInfo)."""

    num_labels: int
    labels: tuple[str, ...]  # id2label, in index order
    activation: str  # identity | sigmoid | tanh


def scoring_head_of(worker_info: dict) -> ScoringHead | None:
    """From GetInfo's ModelInfo (as MessageToDict writes it); None: a causal LM."""
    model = worker_info.get("model", {})
    num_labels = int(model.get("numLabels", 0))
    if not num_labels:
        return None
    activation = model.get("scoreActivation") or "identity"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"the worker reports an unknown score activation {activation!r}")
    return ScoringHead(num_labels, tuple(model.get("labels", ())), activation)


def _sigmoid(x: float) -> float:
    # Either branch's exp argument is <= 0: no overflow for any logit.
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


_ACTIVATIONS: dict[str, Callable[[float], float]] = {
    "identity": float,
    "sigmoid": _sigmoid,
    "tanh": math.tanh,
}


def activate(logits: list[float], head: ScoringHead) -> list[float]:
    """A rerank request's scores: the declared activation of each label's logit."""
    fn = _ACTIVATIONS[head.activation]
    return [fn(x) for x in logits]


def pair_ids(
    m: pb.EmbedRequest,
    encode_pair: Callable[[str, str], list[int]],
    *,
    has_tokenizer: bool,
) -> list[int] | None:
    """The tokens of ``texts``' query/document pair; None when the request
    gives its pair tokenized instead."""
    if not m.texts:
        return None
    if m.tokenized.input_ids or m.tokenized.original_text:
        raise InvalidRequestError(
            "texts / tokenized: a rerank request gives its pair once, as texts "
            "[query, document] or already tokenized, not both"
        )
    if len(m.texts) != 2 or not all(m.texts):
        raise InvalidRequestError(
            f"texts: a rerank request scores one pair, [query, document], both non-empty; "
            f"got {len(m.texts)} text(s)"
        )
    if not has_tokenizer:
        raise InvalidRequestError("texts needs a tokenizer, and this model has none")
    return encode_pair(m.texts[0], m.texts[1])
