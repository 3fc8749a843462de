"""Run a function on 2 gloo ranks in spawned processes (tensor-parallel
collectives on CPU); a rank's exception fails the caller."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.worker_service.support.worker_process import free_port
from worker_service.device.distributed import TensorParallel, init_tensor_parallel


def _rank_main(rank: int, size: int, port: int, body: Callable[[TensorParallel], None]) -> None:
    tp = init_tensor_parallel(rank, size, f"127.0.0.1:{port}", torch.device("cpu"))
    try:
        body(tp)
    finally:
        dist.destroy_process_group()


def on_gloo_ranks(body: Callable[[TensorParallel], None], size: int = 2) -> None:
    """``body`` (a module-level function, pickled by name) on every rank."""
    mp.spawn(_rank_main, args=(size, free_port(), body), nprocs=size, join=True)
