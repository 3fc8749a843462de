"""Sequence classifiers on the model worker: a *ForSequenceClassification
checkpoint loads (base weights plus score.weight, no LM head), an embedding
request's vector is the score head's logits at its last prompt token, equal
to transformers' within 1e-4 whatever the chunking and batching; the worker
refuses work a classifier cannot do and GetInfo says what it is."""

from __future__ import annotations

import pytest

from tests.support.tiny_classifier import SIGMOID, build_classifier, hf_logits
from tests.worker_service.support.worker_factory import worker_for
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.models.config import ModelConfig, UnsupportedModelError
from worker_service.models.score_head import ScoreHeadConfig, score_head_from_hf
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.weights.pooling_config import PoolingConfig, PoolingConfigError

PAGE = 4


def _join(slot: int, prompt: list[int], pooling: str = "last") -> Join:
    return Join(
        slot, f"r{slot}", SamplingParams(), LogprobOptions(), len(prompt), [], pooling=pooling
    )


def _pages(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // PAGE)))


@pytest.mark.parametrize(("family", "num_labels"), [("llama", 1), ("qwen2", 3)])
def test_scores_equal_transformers_logits_chunked_and_batched(tmp_path, family, num_labels):
    hf = build_classifier(tmp_path, family=family, num_labels=num_labels)
    w = worker_for(tmp_path, page_size=PAGE, num_pages=64)
    assert w.pooling == PoolingConfig("last", normalize=False)
    a = [1, 4, 5, 6, 7, 8, 2, 10, 11, 12, 13]  # [BOS] query [SEP] document
    b = [1, 9, 14, 2, 15, 16, 17]
    # Step 1: a's first chunk beside b whole; step 2: a's last chunk.
    plan1 = Plan(
        1,
        ForwardMode.PREFILL,
        joins=[_join(0, a), _join(1, b)],
        extends=[
            Extend(0, 0, a[:6], _pages(0, 6), sample=False),
            Extend(1, 0, b, _pages(10, len(b)), sample=False),
        ],
    )
    r1 = w.runner.execute(plan1)
    assert not r1.error, r1.error
    (only_b,) = r1.embeddings
    plan2 = Plan(2, ForwardMode.PREFILL, extends=[Extend(0, 6, a[6:], [2, 3], sample=False)])
    r2 = w.runner.execute(plan2)
    assert not r2.error, r2.error
    (only_a,) = r2.embeddings
    for got, ids in ((only_a, a), (only_b, b)):
        want = hf_logits(hf, ids)
        assert len(got.values) == num_labels
        assert max(abs(x - y) for x, y in zip(got.values, want, strict=True)) < 1e-4
    assert abs(only_a.values[0] - only_b.values[0]) > 1e-2  # not a constant


def test_a_classifier_refuses_generation_and_mean_pooling(tmp_path):
    build_classifier(tmp_path)
    w = worker_for(tmp_path, page_size=PAGE, num_pages=16)
    assert not w.runner.compute.model.generates and w.runner.grammars is None
    for pooling in ("", "mean"):
        plan = Plan(
            1,
            ForwardMode.PREFILL,
            joins=[_join(0, [1, 4, 5], pooling)],
            extends=[Extend(0, 0, [1, 4, 5], [0], sample=not pooling)],
        )
        assert "sequence classifier" in w.runner.execute(plan).error
        assert not w.runner.slots
    with pytest.raises(PoolingConfigError, match="score head"):
        worker_for(tmp_path, page_size=PAGE, num_pages=16, pooling="mean")


def test_get_info_reports_the_score_head(tmp_path):
    from worker_service.rpc.servicer import WorkerServicer

    build_classifier(tmp_path, family="qwen2", num_labels=2, activation=SIGMOID)
    info = WorkerServicer(worker_for(tmp_path, page_size=PAGE, num_pages=16)).GetInfo(None, None)
    m = info.model
    assert m.architecture == "Qwen2ForSequenceClassification"
    assert (m.num_labels, list(m.labels), m.score_activation) == (
        2,
        ["LABEL_0", "LABEL_1"],
        "sigmoid",
    )
    assert (m.pooling, m.normalize) == (1, False)  # POOLING_LAST, raw
    assert info.grammar_backend == "none"


def test_the_config_declares_labels_and_the_activation():
    base = {"architectures": ["LlamaForSequenceClassification"]}
    assert score_head_from_hf(base).labels == ("LABEL_0", "LABEL_1")  # transformers default
    head = score_head_from_hf({**base, "id2label": {"0": "no", "1": "yes"}})
    assert head == ScoreHeadConfig(2, ("no", "yes"), "identity")  # SGLang: none declared
    head = score_head_from_hf(
        {**base, "num_labels": 1, "sbert_ce_default_activation_function": SIGMOID}
    )
    assert head == ScoreHeadConfig(1, ("LABEL_0",), "sigmoid")
    st = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}
    assert score_head_from_hf({**base, "num_labels": 1, **st}).activation == "tanh"
    shape = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=32,
        num_labels=1,
    )
    softmax = {"sbert_ce_default_activation_function": "torch.nn.modules.activation.Softmax"}
    with pytest.raises(UnsupportedModelError, match="Softmax"):
        ModelConfig.from_hf({**base, **shape, **softmax})
    causal = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], **shape})
    assert causal.score_head is None
