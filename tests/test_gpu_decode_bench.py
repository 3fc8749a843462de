"""scripts/gpu_decode_bench.py on the CPU with a tiny real model: steps are
timed as the worker's --overlap runs them (step N+1 started before step N is
completed), and the JSON summary is on disk after every configuration, so a
run killed by its timeout keeps what finished."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.worker_service.support.tiny_hf_models import tiny_model
from worker_service.execution.model_runner import ModelRunner

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location(
        "gpu_decode_bench", ROOT / "scripts" / "gpu_decode_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama3-rope-scaling", path)
    return path


def argv(checkpoint: Path, batches: str) -> list[str]:
    return [
        "gpu_decode_bench.py",
        *("--device", "cpu", "--backends", "torch", "--models", str(checkpoint)),
        *("--batches", batches, "--context", "16", "--steps", "4", "--warmup", "1"),
        *("--gpu-steps", "0", "--copy-gib", "0.01"),
    ]


def test_steps_are_timed_with_overlap(monkeypatch, checkpoint, tmp_path) -> None:
    bench = load_bench()
    events: list[tuple[str, int]] = []
    runner_cls = ModelRunner
    real_start, real_complete = runner_cls.start, runner_cls.complete

    def start(self, plan):
        events.append(("start", plan.step_id))
        return real_start(self, plan)

    def complete(self, step):
        events.append(("complete", step.step_id))
        return real_complete(self, step)

    monkeypatch.setattr(runner_cls, "start", start)
    monkeypatch.setattr(runner_cls, "complete", complete)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", argv(checkpoint, "2"))
    assert bench.main() in (0, None)
    decode = [(what, sid) for what, sid in events if sid >= 10_000]
    order = {event: i for i, event in enumerate(decode)}
    # Past the warm-up step, each step starts before the one before it is completed.
    overlapped = [
        sid
        for what, sid in decode
        if what == "start"
        and ("complete", sid - 1) in order
        and sid > 10_001
        and order[("start", sid)] < order[("complete", sid - 1)]
    ]
    assert len(overlapped) >= 3, decode
    summary = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert summary["results"][0]["overlap"] is True
    assert summary["results"][0]["steps"] == 4


def test_the_summary_is_written_after_each_configuration(monkeypatch, checkpoint, tmp_path) -> None:
    """The second configuration never ends (the run's timeout kills it): the
    first one's figures are on disk already."""
    bench = load_bench()
    real_run_batch = bench.Bench.run_batch

    def run_batch(self, worker, batch):
        if batch == 2:
            raise SystemExit("killed by the timeout")
        return real_run_batch(self, worker, batch)

    monkeypatch.setattr(bench.Bench, "run_batch", run_batch)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", argv(checkpoint, "1,2"))
    with pytest.raises(SystemExit):
        bench.main()
    summary = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert [(r["batch"], r["steps"]) for r in summary["results"]] == [(1, 4)]
    assert summary["results"][0]["step_ms"] > 0


def test_dry_run_lists_the_configurations_in_run_order(monkeypatch, tmp_path, capsys) -> None:
    bench = load_bench()
    out = tmp_path / "dry.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "x",
            "--dry-run",
            "--models",
            "a,b",
            "--backends",
            "flashinfer,torch",
            "--batches",
            "1,64",
            "--json",
            str(out),
        ],
    )
    assert bench.main() == 0
    expected = [[m, b, n] for b in ("flashinfer", "torch") for m in ("a", "b") for n in (1, 64)]
    assert json.loads(out.read_text())["configurations"] == expected
    assert "a / flashinfer / batch 1" in capsys.readouterr().out
