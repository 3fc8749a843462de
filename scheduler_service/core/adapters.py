"""LoRA adapters: which are loaded, and which the worker's adapter slots hold.

The worker applies a request's adapter from one of ``max_per_batch`` slots
(1..N; 0 is the base model). The scheduler owns the slots as it owns every
other resource the worker holds: a request takes a slot when it is admitted
(the join names it) and gives it back when it leaves the worker (finished,
retracted, preempted, aborted, or the worker lost). A slot holding an adapter
that no request uses may be given to another adapter, least recently used
first; a pinned adapter keeps its slot once it has one. So at most N
distinct adapters run in any step, and admission skips a request whose
adapter finds no slot (SGLang's per-batch cap).

Slot changes reach the worker as ``StepPlan.adapter_slots``, taken once per
plan; the worker applies them after the plan's departures and before its
joins, so a slot is only reassigned once its last user has left.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# lora_ids and names (from --lora-paths and LoadLoRAAdapter): what a metric
# label, a log field and a path segment all take.
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class AdapterError(ValueError):
    """An adapter operation the table refuses: the message says why, ``code``
    what kind of refusal (a gRPC status name, which the service answers with)."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Adapter:
    lora_id: str  # what requests name (GenerateRequest.lora_id) and the worker's name
    name: str  # the caller's human-readable name
    path: str  # the directory the workers read it from
    pinned: bool = False


class AdapterSlots:
    def __init__(self, max_loaded: int, max_per_batch: int) -> None:
        if max_per_batch < 1 or max_loaded < 1:
            raise ValueError("max_loaded and max_per_batch must be >= 1")
        self.max_loaded = max_loaded
        self.max_per_batch = max_per_batch
        self.loaded: dict[str, Adapter] = {}  # lora_id -> adapter, in load order
        # Index 0 is the base model and never used; slots 1..max_per_batch.
        self.holder: list[str | None] = [None] * (max_per_batch + 1)
        self.users = [0] * (max_per_batch + 1)
        self.last_used = [0] * (max_per_batch + 1)
        self._tick = 0
        self._changes: list[tuple[int, str]] = []  # for the next plan

    # ------------------------------------------------------------ registry
    def register(self, adapter: Adapter) -> None:
        self.check_register(adapter)
        self.loaded[adapter.lora_id] = adapter

    def check_register(self, adapter: Adapter, loading: int = 0) -> None:
        """Raise AdapterError if ``adapter`` could not be registered now
        (``loading``: adapters being loaded that will count too)."""
        if not adapter.lora_id:
            raise AdapterError("lora_id is required")
        if adapter.lora_id in self.loaded:
            raise AdapterError(
                f"an adapter with lora_id {adapter.lora_id!r} is already loaded", "ALREADY_EXISTS"
            )
        if any(a.name == adapter.name for a in self.loaded.values()):
            raise AdapterError(
                f"an adapter named {adapter.name!r} is already loaded", "ALREADY_EXISTS"
            )
        if len(self.loaded) + loading >= self.max_loaded:
            being = f" and {loading} being loaded" if loading else ""
            raise AdapterError(
                f"{len(self.loaded)} adapters are loaded{being}, the limit "
                f"(--max-loaded-loras) is {self.max_loaded}; unload one first",
                "RESOURCE_EXHAUSTED",
            )
        if adapter.pinned and self.pinned_count() >= self.max_per_batch - 1:
            raise AdapterError(
                f"at most {self.max_per_batch - 1} adapters can be pinned with "
                f"--max-loras-per-batch {self.max_per_batch} (one slot must stay free "
                "for the others)"
            )

    def check_unregister(self, lora_id: str) -> Adapter:
        adapter = self.loaded.get(lora_id)
        if adapter is None:
            raise AdapterError(f"no adapter with lora_id {lora_id!r} is loaded")
        return adapter

    def unregister(self, lora_id: str) -> Adapter:
        """Forget an adapter no request uses (the caller checked)."""
        adapter = self.check_unregister(lora_id)
        for k in self._slots():
            if self.holder[k] == lora_id:
                if self.users[k]:
                    raise AdapterError(f"adapter {lora_id!r} is in use by {self.users[k]} requests")
                self.holder[k] = None
        self._changes = [(k, n) for k, n in self._changes if n != lora_id]
        del self.loaded[lora_id]
        return adapter

    def pinned_count(self) -> int:
        return sum(a.pinned for a in self.loaded.values())

    # --------------------------------------------------------------- slots
    def _slots(self) -> range:
        return range(1, self.max_per_batch + 1)

    def slot_of(self, lora_id: str) -> int:
        for k in self._slots():
            if self.holder[k] == lora_id:
                return k
        return 0

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one no request uses
        and no pinned adapter holds; 0 if none."""
        best, best_tick = 0, None
        for k in self._slots():
            held = self.holder[k]
            if held is None:
                return k
            if self.users[k] or self.loaded[held].pinned:
                continue
            if best_tick is None or self.last_used[k] < best_tick:
                best, best_tick = k, self.last_used[k]
        return best

    def can_acquire(self, lora_id: str) -> bool:
        return bool(self.slot_of(lora_id) or self._free_slot())

    def acquire(self, lora_id: str) -> int:
        """A slot holding ``lora_id`` for one more request; 0 if none can."""
        if lora_id not in self.loaded:
            raise AdapterError(f"no adapter with lora_id {lora_id!r} is loaded")
        k = self.slot_of(lora_id) or self._free_slot()
        if not k:
            return 0
        if self.holder[k] != lora_id:
            self.holder[k] = lora_id
            self._changes.append((k, lora_id))
        self.users[k] += 1
        self._tick += 1
        self.last_used[k] = self._tick
        return k

    def release(self, slot: int) -> None:
        if not 1 <= slot <= self.max_per_batch or self.users[slot] <= 0:
            raise AdapterError(f"adapter slot {slot} released but not held")
        self.users[slot] -= 1

    @property
    def changed(self) -> bool:
        return bool(self._changes)

    def take_changes(self) -> list[tuple[int, str]]:
        """Slot assignments since the last plan, for the next one."""
        changes, self._changes = self._changes, []
        return changes

    def reset(self) -> None:
        """The worker group was lost: its slots are empty (the adapters stay
        registered; the service reloads them on the group that comes back)."""
        self.holder = [None] * (self.max_per_batch + 1)
        self.users = [0] * (self.max_per_batch + 1)
        self._changes = []

    # ----------------------------------------------------------- invariant
    def check_integrity(self, slotted: Iterable[tuple[str, str | None, int]]) -> None:
        """``slotted``: (rid, adapter, slot) of every live request. Each slot's
        user count is the number of requests holding it, each request holds
        the slot of its own adapter, and a slot holds a loaded adapter."""
        users = [0] * (self.max_per_batch + 1)
        for rid, adapter, slot in slotted:
            if not slot:
                continue
            if not 1 <= slot <= self.max_per_batch:
                raise AssertionError(f"{rid} holds adapter slot {slot} of {self.max_per_batch}")
            if self.holder[slot] != adapter:
                raise AssertionError(
                    f"{rid} of adapter {adapter!r} holds slot {slot}, which holds "
                    f"{self.holder[slot]!r}"
                )
            users[slot] += 1
        if users != self.users:
            raise AssertionError(f"adapter slot users {self.users[1:]} != holders {users[1:]}")
        held = [h for h in self.holder[1:] if h is not None]
        if len(held) != len(set(held)):
            raise AssertionError(f"an adapter holds two slots: {held}")
        for h in held:
            if h not in self.loaded:
                raise AssertionError(f"a slot holds {h!r}, which is not loaded")
