"""Workers and references shared by the LoRA tests (one of each per process)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from tests.support.hf_reference import chat_ids, default_model_reference
from tests.support.lora_adapters import peft_greedy, standard_adapters
from worker_service.config import WorkerConfig
from worker_service.worker import Worker, build_worker

QUESTIONS = [
    "Describe the city of Paris to someone who has never been there.",
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works, step by step.",
]


@functools.cache
def default_worker() -> Worker:
    """The default model's worker with the standard adapters loaded by name."""
    # The float path: compared with PEFT on the float weights.
    cfg = WorkerConfig(model="default", page_size=16, num_pages=512, dequantize=True)
    worker = build_worker(cfg)
    for name, path in standard_adapters().items():
        worker.runner.adapters.put(worker.adapter_loader.load(name, path, 0))
    return worker


@functools.cache
def prompts() -> tuple[tuple[int, ...], ...]:
    tok, _ = default_model_reference()
    return tuple(tuple(chat_ids(tok, q)) for q in QUESTIONS)


@functools.cache
def reference(adapter: str | None, prompt: tuple[int, ...], steps: int) -> tuple[list[int], list]:
    """transformers + PEFT greedy tokens and the logprob of each."""
    path: Path | None = None if adapter is None else standard_adapters()[adapter]
    tokens, rows = peft_greedy(path, list(prompt), steps)
    return tokens, [row[t].item() for row, t in zip(rows, tokens, strict=True)]


def max_logprob_gap(a: list[float], b: list[float]) -> float:
    return float(torch.tensor(a).sub(torch.tensor(b)).abs().max())
