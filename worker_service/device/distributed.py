"""Tensor parallelism: the process group of a worker group and its collectives.

Ranks join with torch.distributed (NCCL on GPUs, gloo on CPU, so CPU tests
cover it). With tp_size 1 every collective is a no-op and no group exists.

Besides the device group, the ranks share a second, gloo group for
``agree``: the step's go / no-go, decided on the host before any of the
step's device collectives is queued. Agreeing never waits for the GPU
stream (an NCCL all-reduce read on the host would wait for every kernel
queued before it: the previous step, which overlap keeps running), and
never pairs with a device collective of a rank that is out of step. It is
a group of its own on CPU too, so the CPU tests run the GPU's arrangement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.distributed as dist

logger = structlog.get_logger(__name__)

# all_gather_single is torch 2.13's name for all_gather_into_tensor (which it
# deprecates); torch >= 2.4 (pyproject) has at least the older one.
_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class GroupStepFailed(RuntimeError):
    """A step that every rank of the group fails, each learning it within the
    step (``TensorParallel.agree`` before it, or rank 0's status on the token
    broadcast): no rank's collectives run ahead of another's."""


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    # The host-side gloo group ``agree`` runs on (see the module docstring).
    host_group: Any = None

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
        # One collective into one buffer, ranks along dim 0 (what NCCL and
        # gloo gather into without a copy), then their columns side by side.
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _gather_into_tensor(out, x.contiguous())
        merged = (*x.shape[:-1], self.size * x.shape[-1])
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(merged)

    def agree(self, code: int) -> list[int]:
        """Every rank's ``code`` for this step (0: go), one host all-reduce:
        each rank writes its own entry of a zero vector and the sum is
        everyone's. Blocks until every rank has called it; never waits for
        the device."""
        if self.size == 1:
            return [code]
        codes = torch.zeros(self.size, dtype=torch.int64)
        codes[self.rank] = code
        dist.all_reduce(codes, group=self.host_group)
        return codes.tolist()

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
    return TensorParallel(rank, size, dist.new_group(backend="gloo"))
