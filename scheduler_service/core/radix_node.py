"""A radix tree node, its packed id arrays, and the results of tree lookups.

A node keeps its edge as packed 32-bit integers (``array('i')``): ``key``
(token ids) and ``pages`` (page ids), plus ``hashes`` (``array('q')``, the
64-bit block hashes, when KV events are on). Lists of int objects cost
8 bytes a slot plus ~32 an int, and the garbage collector walks every slot
of every list on each full pass; an array is 4 bytes an id and one object
whose contents the collector never looks at. Requests keep their token ids
and page tables in the same arrays (packed once, appended to as they grow),
so the cache compares edges and copies page runs with C ``memcmp``/``memcpy``
(array slices and ``==``) and never packs per call.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

ID_TYPE = "i"  # 32-bit signed: token ids and page ids
HASH_TYPE = "q"  # 64-bit signed: block hashes (Python's hash() range)


class RadixCacheError(RuntimeError):
    pass


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
        raise RadixCacheError(f"token and page ids must be 32-bit integers ({e})") from None


def as_id_array(ids: Iterable[int]) -> array:
    """``ids`` itself when it already is a packed id array, else a packed copy."""
    if type(ids) is array and ids.typecode == ID_TYPE:  # type: ignore[attr-defined]
        return ids  # type: ignore[return-value]
    return id_array(ids)


def zero_pages(n: int) -> array:
    """``n`` page ids of 0 (for trees that only answer prefix lengths)."""
    return array(ID_TYPE, bytes(n * _ID_SIZE))


_ID_SIZE = array(ID_TYPE).itemsize


class RadixNode:
    __slots__ = (
        "children",
        "hashes",
        "heap_seq",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "pages",
        "parent",
    )

    def __init__(
        self,
        key: array,
        pages: array,
        parent: RadixNode | None,
        namespace: str | None,
    ) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[Any, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        # Sequence number of this node's live heap entry, -1 if none.
        self.heap_seq = -1
        self.hashes: array | None = None
        self.namespace = namespace

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


class MatchResult(NamedTuple):
    pages: array  # the matched prefix's page table (packed page ids)
    length: int  # tokens matched, a multiple of page_size
    node: RadixNode  # deepest node of the match (a root when nothing matched)


@dataclass(slots=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were cached before this insert
    dup_pages: array  # caller's pages duplicating cached ones (caller still holds them)
    node: RadixNode  # node ending at the last inserted token
