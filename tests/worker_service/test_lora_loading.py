"""LoadAdapter / UnloadAdapter through the real gRPC servicer on a tiny model:
what loads (list or regex targets, any float dtype, reloading a name) and the
clear refusals (nothing is kept from a refused adapter)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from tests.support.lora_adapters import ALL, make_adapter
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.rpc.server import serve


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(stub, worker, adapter made for the tiny model, a work directory)."""
    path = tmp_path_factory.mktemp("tiny")
    hf = tiny_model("llama3-rope-scaling", path)
    adapters = tmp_path_factory.mktemp("adapters")
    good = make_adapter(adapters, "good", 8, ALL, seed=5, base=hf)
    worker = worker_for(path, page_size=4, num_pages=64)
    server, port = serve(worker)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield worker_pb2_grpc.WorkerStub(channel), worker, good, adapters
    channel.close()
    server.stop(0)


def variant(good: Path, where: Path, name: str, config=None, tensors=None) -> Path:
    """A copy of ``good`` with its config and tensors edited."""
    out = where / name
    shutil.copytree(good, out)
    if config is not None:
        raw = json.loads((out / "adapter_config.json").read_text())
        config(raw)
        (out / "adapter_config.json").write_text(json.dumps(raw))
    if tensors is not None:
        weights = load_file(out / "adapter_model.safetensors")
        tensors(weights)
        save_file(weights, out / "adapter_model.safetensors")
    return out


def _keep_q_and_down_in_half(w: dict) -> None:
    for k in list(w):
        if "q_proj" in k or "down_proj" in k:
            w[k] = w[k].half()
        else:
            del w[k]


def test_load_reload_and_unload(tiny):
    stub, worker, good, where = tiny
    resp = stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(good), max_rank=8))
    assert not resp.error, resp.error
    assert (resp.rank, list(resp.target_modules)) == (8, list(ALL)) and resp.load_ms > 0
    first = worker.runner.adapters.lookup(["a"])["a"]
    # A regex target set, half-precision tensors (converted to the model's fp32).
    regex = variant(
        good,
        where,
        "regex",
        config=lambda c: c.update(target_modules=r".*\.(q_proj|down_proj)"),
        tensors=_keep_q_and_down_in_half,
    )
    resp = stub.LoadAdapter(pb.LoadAdapterRequest(name="a", path=str(regex)))
    assert not resp.error, resp.error
    assert list(resp.target_modules) == ["q_proj", "down_proj"]
    again = worker.runner.adapters.lookup(["a"])["a"]
    assert again is not first
    assert set(again.layers[0]) == {"qkv_proj", "down_proj"}
    assert again.layers[0]["down_proj"].a.dtype == torch.float32
    assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a")).found
    assert not stub.UnloadAdapter(pb.UnloadAdapterRequest(name="a")).found


def _drop_layer_1(w: dict) -> None:
    for k in [k for k in w if ".layers.1." in k]:
        del w[k]


def _extra_layer(w: dict) -> None:
    for k in [k for k in w if ".layers.1." in k]:
        w[k.replace(".layers.1.", ".layers.2.")] = w[k].clone()


def _wider(w: dict) -> None:
    k = next(k for k in w if "q_proj.lora_A" in k)
    w[k] = torch.zeros(8, 96)


CASES = {
    "missing-dir": (None, None, "does not exist"),
    "missing-weights": ("no-weights", None, "adapter_model.safetensors is missing"),
    "not-lora": (lambda c: c.update(peft_type="PREFIX_TUNING"), None, "not a LoRA adapter"),
    "rank-limit": (None, None, "rank 8 is above the limit of 4"),
    "embed": (lambda c: c.update(target_modules=["embed_tokens"]), None, "unsupported target"),
    "lm-head": (lambda c: c.update(target_modules=["q_proj", "lm_head"]), None, "unsupported"),
    "modules-to-save": (lambda c: c.update(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "bias": (lambda c: c.update(bias="all"), None, "bias 'all' is not supported"),
    "dora": (lambda c: c.update(use_dora=True), None, "DoRA"),
    "rank-pattern": (lambda c: c.update(rank_pattern={"q_proj": 4}), None, "per-layer ranks"),
    "alpha-pattern": (lambda c: c.update(alpha_pattern={"q_proj": 4}), None, "per-layer alphas"),
    "layers": (lambda c: c.update(layers_to_transform=[0]), None, "layers_to_transform"),
    "missing-layer": (None, _drop_layer_1, "lacks lora_A/lora_B"),
    "more-layers": (None, _extra_layer, "the model has 2 layers"),
    "other-model": (None, _wider, "do not fit the model's 64 -> 64 projection"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refusals_name_the_problem_and_keep_nothing(tiny, case):
    stub, worker, good, where = tiny
    config, tensors, needle = CASES[case]
    if case == "missing-dir":
        path = where / "nowhere"
    elif case == "missing-weights":
        path = variant(good, where, case)
        (path / "adapter_model.safetensors").unlink()
    else:
        path = variant(good, where, case, config, tensors)
    max_rank = 4 if case == "rank-limit" else 0
    resp = stub.LoadAdapter(pb.LoadAdapterRequest(name=case, path=str(path), max_rank=max_rank))
    assert needle in resp.error, resp.error
    assert resp.error.startswith(f"adapter {case!r}: ")
    assert case not in worker.runner.adapters.names()
