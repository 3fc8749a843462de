"""The host tier's page copies: those the plan being built will carry and
those in plans the worker has not answered, with what each holds.

A copy is planned while the scheduler builds a plan (a node written to the
host, a host-only prefix loaded for a request of that plan) and rides on it
(``StepPlan.write_backs``, ``StepPlan.loads``; plan.py says what the worker
must guarantee). Until the worker answers that plan:

- every node a copy reads or fills keeps its host copy: ``host_ref`` counts
  the plans in flight (and the one being built) that touch it, and host
  eviction passes it by;
- the last node of a loaded prefix holds a device lock
  (``RadixCache.lock``: the node and its path) that ``answered`` gives back.

Records name nodes; a node split while a copy of it is in flight passes its
``host_ref`` to its new upper half (``on_split``), and a record may outlive a
node the cache dropped (its parent is then None, and nothing is given back
for it). A worker loss drops every record with the tree (``clear``).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

from scheduler_service.core.ids import PageCopies, id_array
from scheduler_service.core.kv.radix_node import RadixNode


@dataclass(slots=True)
class TransferRecord:
    """What one plan's copies hold: nodes whose ``host_ref`` it raised (once
    per raise) and nodes it locked on the device (once per lock)."""

    step_id: int = 0
    host_refs: list[RadixNode] = field(default_factory=list)
    locks: list[RadixNode] = field(default_factory=list)


class HostTransfers:
    def __init__(self) -> None:
        self._write_src = id_array()  # device pages
        self._write_dst = id_array()  # host pages
        self._load_src = id_array()  # host pages
        self._load_dst = id_array()  # device pages
        self._building = TransferRecord()
        self._inflight: deque[TransferRecord] = deque()
        # Pages copied (counted when planned), for statistics.
        self.written_pages = 0
        self.loaded_pages = 0

    # ----------------------------------------------------------- planning
    @property
    def pending(self) -> bool:
        """Whether the plan being built has copies (it must be sent)."""
        return bool(self._write_src) or bool(self._load_src)

    def write_back(self, node: RadixNode, device: array, host: array) -> None:
        """Copy ``device`` pages to ``host`` pages (both ``node``'s) before the
        plan's loads and forward."""
        self._write_src += device
        self._write_dst += host
        self.written_pages += len(host)
        node.host_ref += 1
        self._building.host_refs.append(node)

    def load(self, nodes: list[RadixNode], host: array, device: array) -> None:
        """Copy ``host`` pages (those of ``nodes``, in order) to ``device``
        pages before the plan's forward."""
        self._load_src += host
        self._load_dst += device
        self.loaded_pages += len(device)
        for node in nodes:
            node.host_ref += 1
        self._building.host_refs += nodes

    def hold_lock(self, node: RadixNode) -> None:
        """The caller locked ``node`` for a copy of the plan being built."""
        self._building.locks.append(node)

    def take(self, step_id: int) -> tuple[PageCopies | None, PageCopies | None]:
        """The copies planned since the last plan, for plan ``step_id``
        (write-backs, loads; None: none), whose record is kept until
        ``answered(step_id)``."""
        rec = self._building
        writes = loads = None
        if self._write_src:
            writes = PageCopies(self._write_src, self._write_dst)
            self._write_src, self._write_dst = id_array(), id_array()
        if self._load_src:
            loads = PageCopies(self._load_src, self._load_dst)
            self._load_src, self._load_dst = id_array(), id_array()
        if rec.host_refs or rec.locks:
            rec.step_id = step_id
            self._inflight.append(rec)
            self._building = TransferRecord()
        return writes, loads

    # ----------------------------------------------------------- answers
    def answered(self, step_id: int) -> TransferRecord | None:
        """The record of plan ``step_id`` (just answered), if it had copies;
        the caller gives back what it holds. Plans are answered in order."""
        inflight = self._inflight
        if inflight and inflight[0].step_id == step_id:
            return inflight.popleft()
        if inflight and inflight[0].step_id < step_id:
            raise RuntimeError(
                f"plan {inflight[0].step_id}'s host copies were never answered "
                f"(answer for {step_id})"
            )
        return None

    def on_split(self, upper: RadixNode, node: RadixNode) -> None:
        """``upper`` took the first part of ``node``, whose host copy copies
        in flight touch: it is held as often as ``node`` is."""
        upper.host_ref = node.host_ref
        for rec in self._records():
            k = rec.host_refs.count(node)
            if k:
                rec.host_refs += [upper] * k

    def clear(self) -> None:
        """Forget every copy (the worker, and its host pool, are gone)."""
        self._write_src, self._write_dst = id_array(), id_array()
        self._load_src, self._load_dst = id_array(), id_array()
        self._building = TransferRecord()
        self._inflight.clear()

    # ---------------------------------------------------------- invariants
    def _records(self) -> list[TransferRecord]:
        return [*self._inflight, self._building]

    def held(self) -> tuple[dict[int, int], int]:
        """(id(node) -> host_ref the records account for, over live nodes;
        device locks the records hold)."""
        refs: dict[int, int] = {}
        locks = 0
        for rec in self._records():
            for node in rec.host_refs:
                if node.parent is not None:
                    refs[id(node)] = refs.get(id(node), 0) + 1
            locks += sum(node.parent is not None for node in rec.locks)
        return refs, locks

    def check_pairs(self) -> None:
        if len(self._write_src) != len(self._write_dst) or len(self._load_src) != len(
            self._load_dst
        ):
            raise AssertionError("a planned host copy lacks its source or destination page")
