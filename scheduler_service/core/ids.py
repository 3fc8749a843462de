"""Packed id runs: token ids and page ids as 32-bit ``array('i')``.

Lists of int objects cost 8 bytes a slot plus ~32 an int, and the garbage
collector walks every slot of every list on each full pass; an array is
4 bytes an id and one object whose contents the collector never looks at.
Requests keep their token ids and page tables in these arrays (packed once,
appended to as they grow), and the radix cache keeps its edges in them, so
it compares edges and copies page runs with C ``memcmp``/``memcpy`` (array
slices and ``==``) and never packs per call.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

ID_TYPE = "i"  # 32-bit signed: token ids and page ids


class IdRangeError(ValueError):
    """An id that does not fit in 32 bits."""


def id_array(ids: Iterable[int] = ()) -> array:
    """Token or page ids as a packed 32-bit array (a copy when given an array).

    A list goes through ``struct`` (about 8 ns an id here, half of what
    ``array(list)`` takes with its per-item argument parsing)."""
    try:
        if type(ids) is list:
            packed = array(ID_TYPE)
            packed.frombytes(struct.pack(f"{len(ids)}{ID_TYPE}", *ids))
            return packed
        return array(ID_TYPE, ids)
    except (OverflowError, TypeError, struct.error) as e:
        raise IdRangeError(f"token and page ids must be 32-bit integers ({e})") from None


def as_id_array(ids: Iterable[int]) -> array:
    """``ids`` itself when it already is a packed id array, else a packed copy."""
    if type(ids) is array and ids.typecode == ID_TYPE:  # type: ignore[attr-defined]
        return ids  # type: ignore[return-value]
    return id_array(ids)


def zero_pages(n: int) -> array:
    """``n`` page ids of 0 (for trees that only answer prefix lengths)."""
    return array(ID_TYPE, bytes(n * _ID_SIZE))


_ID_SIZE = array(ID_TYPE).itemsize


@dataclass(slots=True)
class PageCopies:
    """Page copies between two of the worker's pools (the host tier's
    write-backs and loads, plan.py): page ``src[i]`` of one pool is copied
    to page ``dst[i]`` of the other, whole pages, every layer."""

    src: array
    dst: array

    def __len__(self) -> int:
        return len(self.src)


BLOCK_HASH_TYPE = "q"  # 64-bit signed: chained block hashes (kv/events.py)


@dataclass(slots=True)
class StorageCopies:
    """Page copies between the worker's host pool and its file tier (the
    file tier's writes and reads, plan.py): host page ``host[i]`` and the
    file of block hash ``hashes[i]``, whole pages, every layer."""

    hashes: array  # BLOCK_HASH_TYPE
    host: array  # ID_TYPE

    def __len__(self) -> int:
        return len(self.hashes)


@dataclass(slots=True)
class StorageReadsDone:
    """The worker finished the file-tier reads plan ``step_id`` carried:
    those at ``failed`` (indices into that plan's ``storage_reads``) found
    no whole, checked file; every other one filled its host page."""

    step_id: int
    failed: array = field(default_factory=id_array)
