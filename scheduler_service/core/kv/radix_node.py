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

from array import array
from dataclasses import dataclass
from typing import Any, NamedTuple

HASH_TYPE = "q"  # 64-bit signed: block hashes (Python's hash() range)


class RadixCacheError(RuntimeError):
    pass


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
        "swa",
    )

    def __init__(
        self,
        key: array,
        pages: array,
        parent: RadixNode | None,
        namespace: str | None,
        *,
        swa: array | None = None,
    ) -> None:
        self.key = key
        self.pages = pages
        # Sliding-window pages parallel to ``pages`` (a model with a sliding
        # pool only, else None); 0: a tombstone (kv/sliding.py).
        self.swa = swa
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
    swa: array | None = None  # the prefix's sliding entries (a sliding pool only)


@dataclass(slots=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were cached before this insert
    dup_pages: array  # caller's pages duplicating cached ones (caller still holds them)
    node: RadixNode  # node ending at the last inserted token
