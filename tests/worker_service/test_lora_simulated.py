"""The simulated worker's adapters: LoadAdapter reads the config only (rank,
targets, the rank limit) and a request of adapter ``name`` follows the
simulated model started from initial_state(name)."""

from __future__ import annotations

import json

import pytest

from common.simulated_model import expected_output
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.worker_factory import worker_for
from worker_service.execution.plan import AdapterSlot
from worker_service.lora.peft_config import AdapterError

VOCAB = 32000


def _config_dir(path, **fields):
    path.mkdir()
    config = {"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": ["q_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return path


def test_simulated_adapters_follow_their_own_rule(tmp_path):
    worker = worker_for("simulated")
    loader, store = worker.adapter_loader, worker.runner.adapters
    alpha = loader.load("alpha", _config_dir(tmp_path / "a", target_modules="all-linear"), 16)
    assert alpha.rank == 16 and len(alpha.target_modules) == 7
    store.put(alpha)
    store.put(loader.load("beta", _config_dir(tmp_path / "b", r=4), 0))
    with pytest.raises(AdapterError, match="rank 16 is above the limit of 8"):
        loader.load("gamma", tmp_path / "a", 8)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reqs = [
        DriverRequest(prompt, 6, adapter_slot=1),
        DriverRequest(prompt, 6, adapter_slot=2),
        DriverRequest(prompt, 6),
        DriverRequest(prompt, 6, arrive=2, adapter_slot=1, share_from=0),
    ]
    slots = [AdapterSlot(1, "alpha"), AdapterSlot(2, "beta")]
    PlanDriver(worker.runner, 4, chunk=3).run(reqs, adapter_slots=slots)
    for r, adapter in zip(reqs, ["alpha", "beta", None, "alpha"], strict=True):
        assert r.outputs == expected_output(prompt, 6, VOCAB, adapter=adapter)
    assert len({tuple(r.outputs) for r in reqs}) == 3


def test_fused_targets_are_their_parts(tmp_path):
    """Phi-3 adapters name the checkpoint's fused qkv_proj / gate_up_proj."""
    loader = worker_for("simulated").adapter_loader
    fused = _config_dir(tmp_path / "f", target_modules=["qkv_proj", "o_proj", "gate_up_proj"])
    assert loader.load("f", fused, 0).target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"
    )  # fmt: skip
    with pytest.raises(AdapterError, match=r"unsupported target modules \['wqkv'\]"):
        loader.load("w", _config_dir(tmp_path / "w", target_modules=["wqkv"]), 0)
