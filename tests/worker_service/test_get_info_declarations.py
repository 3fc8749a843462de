"""GetInfo carries what the model declares (ModelInfo fields 60-62): BOS and
pad ids and the author's sampling defaults, unset where it declares none, so
the scheduler can tell "none" from 0."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from protos import worker_pb2 as pb
from worker_service.models.config import ModelConfig, SamplingDefaults
from worker_service.rpc.servicer import WorkerServicer
from worker_service.weights.pooling_config import PoolingConfig


def _info(**declared) -> pb.ModelInfo:
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=96,
        **declared,
    )
    worker = SimpleNamespace(
        model_name="m",
        vocab_size=96,
        dtype=torch.float32,
        model_config=config,
        config=SimpleNamespace(page_size=4, worker_token_file=None),
        num_pages=8,
        num_swa_pages=0,
        num_host_pages=0,
        num_storage_pages=0,
        runner=SimpleNamespace(files=None, compute=None),
        swa_window=0,
        tp=SimpleNamespace(rank=0, size=1),
        attention_backend="torch",
        device=torch.device("cpu"),
        pooling=PoolingConfig(),
        weight_bytes=0,
        kv_cache_bytes=0,
        graph_bytes=0,
        grammar_backend="none",
    )
    servicer = WorkerServicer(worker)
    return servicer.GetInfo(pb.GetInfoRequest(), None).model


def test_get_info_reports_the_models_declarations():
    defaults = SamplingDefaults(temperature=0.6, top_k=20, max_new_tokens=7)
    m = _info(bos_token_id=1, pad_token_id=0, sampling_defaults=defaults)
    assert (m.bos_token_id, m.pad_token_id) == (1, 0) and m.HasField("pad_token_id")
    declared = {f.name: v for f, v in m.sampling_defaults.ListFields()}
    assert declared == {"temperature": 0.6, "top_k": 20, "max_new_tokens": 7}


def test_nothing_declared_stays_unset():
    m = _info()
    assert not m.HasField("bos_token_id") and not m.HasField("pad_token_id")
    assert m.sampling_defaults.ListFields() == []
