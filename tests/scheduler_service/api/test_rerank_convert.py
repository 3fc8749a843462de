"""Rerank requests (is_cross_encoder) on a sequence classifier: the pair from
``texts`` through the tokenizer's pair template or already tokenized, the
model's activation of the logits, and the shapes refused by name."""

from __future__ import annotations

import dataclasses
import math

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service.api.convert.embed import embed_submission
from scheduler_service.api.convert.public import Limits
from scheduler_service.api.convert.rerank import ScoringHead, activate, scoring_head_of
from scheduler_service.config import LimitsConfig
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.sampling import InvalidRequestError

LIMITS = Limits(vocab_size=100, context_len=32, **dataclasses.asdict(LimitsConfig()))
LAST_RAW = EmbedOptions("last", normalize=False)
HEAD = ScoringHead(1, ("LABEL_0",), "sigmoid")


def words(text: str) -> list[int]:
    return [len(w) for w in text.split()]


def pair(first: str, second: str) -> list[int]:
    return [1, *words(first), 2, *words(second)]  # [BOS] query [SEP] document


def convert(m: pb.EmbedRequest, *, has_tokenizer: bool = True, scoring=HEAD):
    return embed_submission(
        m,
        LIMITS,
        words,
        has_tokenizer=has_tokenizer,
        options=LAST_RAW,
        architecture="LlamaForSequenceClassification",
        scoring=scoring,
        encode_pair=pair,
    )


def test_the_pair_comes_from_texts_or_ready_tokenized():
    sub = convert(pb.EmbedRequest(is_cross_encoder=True, texts=["what is it", "a fish"]))
    assert sub.prompt_ids == [1, 4, 2, 2, 2, 1, 4] and sub.embed == LAST_RAW
    assert sub.sampling.max_new_tokens == 0
    ids = pb.TokenizedInput(input_ids=[1, 4, 2, 9])
    assert convert(pb.EmbedRequest(is_cross_encoder=True, tokenized=ids)).prompt_ids == [1, 4, 2, 9]
    # A plain Embed on a classifier: its logits, the same prompt either way.
    assert convert(pb.EmbedRequest(tokenized=ids)).prompt_ids == [1, 4, 2, 9]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.EmbedRequest(texts=["q", "d"]), "sets is_cross_encoder"),
        (pb.EmbedRequest(is_cross_encoder=True, texts=["q", "d", "e"]), "one pair"),
        (pb.EmbedRequest(is_cross_encoder=True, texts=["q", ""]), "both non-empty"),
        (
            pb.EmbedRequest(
                is_cross_encoder=True, texts=["q", "d"], tokenized=pb.TokenizedInput(input_ids=[1])
            ),
            "not both",
        ),
    ],
)
def test_what_a_rerank_cannot_mean_is_refused_by_name(request_, message):
    with pytest.raises(InvalidRequestError, match=message):
        convert(request_)


def test_texts_need_a_tokenizer_and_rerank_a_score_head():
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        convert(pb.EmbedRequest(is_cross_encoder=True, texts=["q", "d"]), has_tokenizer=False)
    with pytest.raises(InvalidRequestError, match="sequence-classification head"):
        convert(pb.EmbedRequest(is_cross_encoder=True, texts=["q", "d"]), scoring=None)


def test_the_score_head_comes_from_the_workers_model_info():
    info = {"model": {"numLabels": 2, "labels": ["no", "yes"], "scoreActivation": "tanh"}}
    assert scoring_head_of(info) == ScoringHead(2, ("no", "yes"), "tanh")
    assert scoring_head_of({"model": {"pooling": "POOLING_LAST"}}) is None  # a causal LM
    with pytest.raises(ValueError, match="softmax"):
        scoring_head_of({"model": {"numLabels": 1, "scoreActivation": "softmax"}})


def test_activations_are_the_declared_ones_and_stable():
    assert activate([0.0, 2.0, -800.0, 800.0], HEAD) == [0.5, 1 / (1 + math.exp(-2)), 0.0, 1.0]
    assert activate([0.5], ScoringHead(1, ("a",), "tanh")) == [math.tanh(0.5)]
    assert activate([-3.25], ScoringHead(1, ("a",), "identity")) == [-3.25]
