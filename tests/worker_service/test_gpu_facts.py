"""scripts/gpu_facts.py, the interop facts gpu_check.sh prints first: on a
machine without CUDA every fact runs and reports (a CUDA-only one its error),
a fact stuck in Python is cut by its timeout and the next still runs, the
summary is on disk after each fact; and the attention and graph-capture facts
run their real code on the CPU through the FlashInfer CPU harness."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from tests.worker_service.support import flashinfer_cpu_harness as harness

ROOT = Path(__file__).resolve().parents[2]


def load_facts():
    spec = importlib.util.spec_from_file_location("gpu_facts", ROOT / "scripts" / "gpu_facts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA report")
def test_without_cuda_every_fact_reports(tmp_path) -> None:
    facts = load_facts()
    out = tmp_path / "facts.json"
    assert facts.main(["--json", str(out)]) == 1
    summary = json.loads(out.read_text())
    assert summary["facts"]["versions"]["torch"] == torch.__version__
    assert set(summary["facts"]) | set(summary["errors"]) == set(facts.FACTS)
    assert summary["errors"]["sync_debug_mode"] == "RuntimeError: no CUDA device"


def test_a_fact_stuck_in_python_is_cut_and_the_next_runs(tmp_path) -> None:
    facts = load_facts()
    out = tmp_path / "facts.json"
    t0 = time.perf_counter()
    summary = facts.run_facts(
        {"stuck": lambda: time.sleep(30), "versions": facts.versions}, timeout_s=0.3, out=out
    )
    assert time.perf_counter() - t0 < 10
    assert summary["errors"]["stuck"].startswith("FactTimeout")
    assert json.loads(out.read_text())["facts"]["versions"]["python"]


@pytest.mark.usefixtures("fi_cpu")
def test_attention_and_graph_capture_facts_on_the_cpu_harness(monkeypatch) -> None:
    facts = load_facts()
    monkeypatch.setattr(facts, "_cuda", lambda: torch.device("cpu"))
    harness.install_graph_stand_ins(monkeypatch)
    monkeypatch.setattr(facts, "HEAD_DIMS", (64, 128))
    found = facts.attention()
    assert len(found) == 2 * 2 * 2 + 2  # and the soft-capped bf16 x 256 on both decode kernels
    assert "bfloat16/d256/soft-cap/cuda-core" in found
    assert all(v.startswith("ok, max diff") for v in found.values()), found
    assert all(float(v.rsplit(" ", 1)[1]) < 0.05 for v in found.values()), found
    graph = facts.graph_capture()
    assert graph["kv_equal_outside_scratch"] and graph["replay_max_diff"] < 0.05, graph
