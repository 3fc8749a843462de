"""Builds real workers (in-process) for tests."""

from __future__ import annotations

from pathlib import Path

from worker_service.config import WorkerConfig
from worker_service.execution.model_runner import ModelRunner
from worker_service.worker import Worker, build_worker


def worker_for(model: str | Path, **overrides) -> Worker:
    cfg = WorkerConfig(model=str(model), **overrides)
    return build_worker(cfg)


def runner_for(model: str | Path, **overrides) -> ModelRunner:
    """One KV pool unless told otherwise: plan_driver.py's plans carry no
    sliding pages (two pools are driven by swa_plan_driver.py and the real
    Scheduler)."""
    return worker_for(model, **{"swa_memory": False, **overrides}).runner
