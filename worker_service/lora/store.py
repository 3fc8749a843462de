"""The worker's adapters: loaded ones by name, and which adapter each adapter
slot holds.

Two kinds of threads meet here. LoadAdapter / UnloadAdapter run on gRPC
threads and change ``loaded`` under the lock; they never wait for a step (a
load reads its files before it takes the lock, only to publish). The
executing thread looks names up under the same lock when a plan assigns
slots, and owns the slot table alone. A slot, and every request that joined
through it, holds a Python reference to its adapter object, so unloading or
replacing a name never pulls weights from under a plan: the old object lives
until the last slot and request holding it let go.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

import structlog

logger = structlog.get_logger(__name__)


class LoadedAdapter(Protocol):
    """What the store needs of an adapter (a LoraAdapter with weights, or the
    simulated worker's config-only AdapterInfo)."""

    @property
    def name(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def target_modules(self) -> tuple[str, ...]: ...


class AdapterStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loaded: dict[str, LoadedAdapter] = {}  # under _lock
        # Adapter slot (1..N) -> adapter: the executing thread's alone.
        self.slots: dict[int, LoadedAdapter] = {}

    # ------------------------------------------------ gRPC threads
    def put(self, adapter: LoadedAdapter) -> bool:
        """Publish ``adapter`` under its name; True if it replaced one."""
        with self._lock:
            replaced = adapter.name in self._loaded
            self._loaded[adapter.name] = adapter
        logger.info("adapter loaded", name=adapter.name, rank=adapter.rank, replaced=replaced)
        return replaced

    def remove(self, name: str) -> bool:
        with self._lock:
            found = self._loaded.pop(name, None) is not None
        logger.info("adapter unloaded", name=name, found=found)
        return found

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._loaded)

    # ------------------------------------------------ executing thread
    def lookup(self, names: Iterable[str]) -> dict[str, LoadedAdapter]:
        """The loaded adapters among ``names`` (one snapshot: a plan's slot
        assignments are checked and applied with the same objects)."""
        wanted = [n for n in names if n]
        if not wanted:
            return {}
        with self._lock:
            return {n: self._loaded[n] for n in wanted if n in self._loaded}

    def assign(self, slot: int, adapter: LoadedAdapter | None) -> None:
        if adapter is None:
            self.slots.pop(slot, None)
        else:
            self.slots[slot] = adapter

    def clear_slots(self) -> None:
        """A new scheduler stream starts with every slot empty (the adapters
        stay loaded: loading is not part of a stream)."""
        self.slots.clear()
