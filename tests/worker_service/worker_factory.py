"""Builds real workers (in-process) for tests."""

from __future__ import annotations

from pathlib import Path

from worker_service.config import WorkerConfig
from worker_service.engine import Worker, build_worker
from worker_service.executor import Executor


def worker_for(model: str | Path, **overrides) -> Worker:
    cfg = WorkerConfig(model=str(model), **overrides)
    return build_worker(cfg)


def executor_for(model: str | Path, **overrides) -> Executor:
    return worker_for(model, **overrides).executor
