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

Tiers (kv/hiradix_cache.py, off unless the host tier is on): a node's KV is
on the device (``pages``), on the host (``host``: host page ids), or both.
``pages`` is None for a host-only node, ``host`` None for a node without a
host copy; never both None. The file tier is no node state: it is an
index of block hashes (kv/storage_tier.py).
Without the host tier ``host`` stays None and the other tier fields unused.
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
        "hit_count",
        "host",
        "host_heap_seq",
        "host_ref",
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
        # The host tier (kv/hiradix_cache.py): the host copy's page ids (None:
        # no host copy); transfers in flight that read or fill it (it must
        # stay); its host-LRU heap entry (-1: none); matches and inserts that
        # reached it (write_through_selective).
        self.host: array | None = None
        self.host_ref = 0
        self.host_heap_seq = -1
        self.hit_count = 0

    def __repr__(self) -> str:
        tiers = ("D" if self.pages is not None else "") + ("H" if self.host is not None else "")
        return (
            f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)}, "
            f"tiers={tiers})"
        )


class MatchResult(NamedTuple):
    pages: array  # the matched prefix's page table (packed page ids)
    length: int  # tokens matched, a multiple of page_size
    node: RadixNode  # deepest node of the match (a root when nothing matched)
    swa: array | None = None  # the prefix's sliding entries (a sliding pool only)
    # The host tier: tokens matched past ``length`` whose KV is only on the
    # host (they must be loaded), and the deepest node of the whole match.
    host_len: int = 0
    host_node: RadixNode | None = None


@dataclass(slots=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were cached before this insert
    dup_pages: array  # caller's pages duplicating cached ones (caller still holds them)
    node: RadixNode  # node ending at the last inserted token
