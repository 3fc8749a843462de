"""The KV pool in shared memory (prefill/decode disaggregation on one
host): a decode worker started with ``--kv-shared-memory`` keeps its pool
in one file under /dev/shm (mode 0600, named by its pid and a random
nonce) and names it in ``WorkerInfo.kv_shared_memory``. A prefill worker
told to send pages there (``SendKv``) that can open that file (same host,
same user, and the file has exactly the size the layout needs) copies the
pages straight into it, layer by layer, instead of streaming them over
gRPC. Both pools are CPU tensors; a CUDA pool is never shared this way.

Layout: the layers one after another, each ``(num_pages, 2, page_size,
heads, head_dim)`` as the pool holds it. The file is removed when the
worker exits; files of workers that died are removed by the next worker
that starts one."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

logger = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "radixserve-kv-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path = SHM_DIR) -> int:
    """Remove the pool files of workers that are gone; how many."""
    removed = 0
    for path in directory.glob(PREFIX + "*"):
        pid_text = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _alive(int(pid_text)):
            with contextlib.suppress(OSError):
                path.unlink()
                removed += 1
    return removed


def allocate_layers(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, directory: Path = SHM_DIR
) -> tuple[str, list[torch.Tensor]]:
    """Zeroed layer tensors of ``shapes`` in one new shared file: (its path, the layers)."""
    remove_stale(directory)
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [itemsize * int(torch.Size(s).numel()) for s in shapes]
    total = sum(sizes)
    path = directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, total)
    finally:
        os.close(fd)
    atexit.register(lambda: path.unlink(missing_ok=True))
    flat = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
    layers, at = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        layers.append(flat[at : at + size].view(dtype).view(shape))
        at += size
    logger.info("KV pool in shared memory", path=str(path), bytes=total)
    return str(path), layers


class SharedPool:
    """A receiver's pool file, opened by a sender: its layers as rows of
    bytes, ``(num_pages, layer_page_bytes)`` each."""

    def __init__(self, path: str, layers: list[torch.Tensor]) -> None:
        self.path = path
        self.layers = layers
        self.num_pages = layers[0].shape[0] if layers else 0

    @classmethod
    def open(cls, path: str, layer_page_bytes: Sequence[int]) -> SharedPool | None:
        """The pool at ``path`` if this process can open it and its size fits
        layers of ``layer_page_bytes`` (the sender's own); else None."""
        name = Path(path)
        if name.parent != SHM_DIR or not name.name.startswith(PREFIX):
            return None
        try:
            size = name.stat().st_size
        except OSError:
            return None
        per_page = sum(layer_page_bytes)
        if not per_page or size % per_page:
            return None
        num_pages = size // per_page
        try:
            flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        except (OSError, RuntimeError):
            return None
        layers, at = [], 0
        for b in layer_page_bytes:
            layers.append(flat[at : at + num_pages * b].view(num_pages, b))
            at += num_pages * b
        return cls(path, layers)

    def write(
        self, src_layers: Sequence[torch.Tensor], src_pages: Sequence[int], dst_pages: Sequence[int]
    ) -> None:
        """Copy ``src_pages`` of the sender's layers into ``dst_pages`` here."""
        bad = [p for p in dst_pages if not 0 <= p < self.num_pages][:5]
        if bad:
            raise ValueError(f"pages outside the receiver's pool [0, {self.num_pages}): {bad}")
        src = torch.tensor(list(src_pages), dtype=torch.long)
        dst = torch.tensor(list(dst_pages), dtype=torch.long)
        for mine, theirs in zip(src_layers, self.layers, strict=True):
            rows = mine.view(torch.uint8).reshape(mine.shape[0], -1)
            theirs.index_copy_(0, dst, rows.index_select(0, src))


__all__ = ["PREFIX", "SHM_DIR", "SharedPool", "allocate_layers", "remove_stale"]
