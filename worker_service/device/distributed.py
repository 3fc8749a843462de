"""Tensor parallelism: the process group of a worker group and its collectives.

Ranks join with torch.distributed (NCCL on GPUs, gloo on CPU, so CPU tests
cover it). With tp_size 1 every collective is a no-op and no group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

logger = structlog.get_logger(__name__)


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def shard(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly across ranks."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) does not split across {self.size} ranks")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per


def init_tensor_parallel(
    rank: int, size: int, dist_addr: str | None, device: torch.device
) -> TensorParallel:
    """Join the group (blocks until every rank has joined)."""
    if size == 1:
        return TensorParallel(0, 1)
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} is outside [0, {size})")
    if not dist_addr:
        raise ValueError("--dist-addr HOST:PORT is needed with --tp-size > 1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("joining tensor-parallel group", rank=rank, size=size, addr=dist_addr)
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{dist_addr}", rank=rank, world_size=size
    )
    return TensorParallel(rank, size)
