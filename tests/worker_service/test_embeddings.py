"""Embedding requests on the model worker: the pooled final-norm hidden state
(last token, or the mean over the prompt, summed across chunks) against
transformers' ``hidden_states[-1]`` on the same weights, batched in the same
steps as a generating request; the plans the worker refuses; the model's
sentence-transformers pooling config."""

from __future__ import annotations

import json

import pytest
import torch

from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan
from worker_service.sampling.params import LogprobOptions, SamplingParams
from worker_service.weights.pooling_config import (
    PoolingConfig,
    PoolingConfigError,
    read_pooling_config,
)

PAGE = 4
GREEDY = SamplingParams(temperature=0.0)


def _join(slot: int, prompt: list[int], pooling: str = "", *, normalize: bool = False) -> Join:
    return Join(
        slot,
        f"r{slot}",
        GREEDY,
        LogprobOptions(),
        len(prompt),
        [],
        pooling=pooling,
        normalize=normalize,
    )


def _pages(first: int, n_tokens: int) -> list[int]:
    return list(range(first, first + -(-n_tokens // PAGE)))


def hf_hidden(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # the final norm's output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return tiny_model("llama3-rope-scaling", path), path


def test_pooled_vectors_match_transformers_across_chunks_and_beside_generation(tiny):
    hf, path = tiny
    runner = worker_for(path, page_size=PAGE, num_pages=256).runner
    g = torch.Generator().manual_seed(5)
    gen, last, mean = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 21, 19))
    # Step 1: the generating request's whole prompt (it samples), the
    # embeddings' first chunks. Step 2: its decode beside their last chunks.
    plan1 = Plan(
        1,
        ForwardMode.PREFILL,
        joins=[_join(0, gen), _join(1, last, "last", normalize=True), _join(2, mean, "mean")],
        extends=[
            Extend(0, 0, gen, _pages(0, 9), sample=True),
            Extend(1, 0, last[:8], _pages(10, 8), sample=False),
            Extend(2, 0, mean[:11], _pages(20, 11), sample=False),
        ],
    )
    r1 = runner.execute(plan1)
    assert not r1.error and r1.embeddings == [] and len(r1.token_ids) == 1
    plan2 = Plan(
        2,
        ForwardMode.MIXED,
        extends=[
            Extend(1, 8, last[8:], _pages(12, 13), sample=False),
            Extend(2, 11, mean[11:], [23, 24], sample=False),
        ],
        decode_slots=[0],
        decode_positions=[9],
        decode_new_pages=[0],
    )
    r2 = runner.execute(plan2)
    assert not r2.error, r2.error
    got = {e.slot: torch.tensor(e.values) for e in r2.embeddings}
    assert sorted(got) == [1, 2] and len(r2.token_ids) == 1
    want_last = torch.nn.functional.normalize(hf_hidden(hf, last)[-1], dim=0)
    want_mean = hf_hidden(hf, mean).mean(dim=0)
    assert (got[1] - want_last).abs().max() < 1e-4
    assert (got[2] - want_mean).abs().max() < 1e-4
    assert abs(got[1].norm().item() - 1.0) < 1e-5 and abs(got[2].norm().item() - 1.0) > 1e-2


def test_the_worker_refuses_a_cached_mean_and_a_sampling_embedding(tiny):
    _, path = tiny
    runner = worker_for(path, page_size=PAGE, num_pages=64).runner
    cached = _join(0, [1, 2, 3, 4, 5], "mean")
    cached.prefix_ids = [1, 2, 3, 4]
    plan = Plan(
        1, ForwardMode.PREFILL, joins=[cached], extends=[Extend(0, 4, [5], [0, 1], sample=False)]
    )
    assert "mean pooling needs the hidden state of every prompt position" in (
        runner.execute(plan).error
    )
    plan = Plan(
        2,
        ForwardMode.PREFILL,
        joins=[_join(0, [1, 2, 3], "last")],
        extends=[Extend(0, 0, [1, 2, 3], [0], sample=True)],
    )
    assert "it is an embedding request" in runner.execute(plan).error
    assert not runner.slots  # refused plans change nothing


def _sentence_transformers_files(path, mode: str, *, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False}
    cfg.update({"pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": False, mode: True})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(cfg))


def test_the_models_sentence_transformers_config_chooses_the_pooling(tmp_path):
    assert read_pooling_config(tmp_path) is None  # none: SGLang's last token, normalized
    _sentence_transformers_files(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    assert read_pooling_config(tmp_path) == PoolingConfig("mean", normalize=False)
    _sentence_transformers_files(tmp_path, "pooling_mode_lasttoken", normalize=True)
    assert read_pooling_config(tmp_path) == PoolingConfig("last", normalize=True)
    _sentence_transformers_files(tmp_path, "pooling_mode_cls_token", normalize=True)
    with pytest.raises(PoolingConfigError, match="pooling_mode_cls_token"):
        read_pooling_config(tmp_path)


def test_get_info_reports_the_pooling_the_settings_and_the_model_ask(tiny, tmp_path):
    from worker_service.rpc.servicer import WorkerServicer

    hf, _ = tiny
    hf.save_pretrained(tmp_path)
    _sentence_transformers_files(tmp_path, "pooling_mode_mean_tokens", normalize=False)
    w = worker_for(tmp_path, page_size=PAGE, num_pages=16)
    assert w.pooling == PoolingConfig("mean", normalize=False)
    info = WorkerServicer(w).GetInfo(None, None)
    assert (info.model.pooling, info.model.normalize) == (2, False)  # POOLING_MEAN
    w = worker_for(tmp_path, page_size=PAGE, num_pages=16, pooling="last", embed_normalize="on")
    assert w.pooling == PoolingConfig("last", normalize=True)
