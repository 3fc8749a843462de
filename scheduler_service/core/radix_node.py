"""A radix tree node and the results of tree lookups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


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
    )

    def __init__(
        self,
        key: list[int],
        pages: list[int],
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
        self.hashes: list[int] | None = None
        self.namespace = namespace

    def __repr__(self) -> str:
        return f"RadixNode(len={len(self.key)}, lock={self.lock_ref}, kids={len(self.children)})"


class MatchResult(NamedTuple):
    pages: list[int]
    length: int  # tokens matched, a multiple of page_size
    node: RadixNode  # deepest node of the match (a root when nothing matched)


@dataclass(slots=True)
class InsertResult:
    prefix_len: int  # tokens of the key that were cached before this insert
    dup_pages: list[int]  # caller's pages duplicating cached ones (caller still holds them)
    node: RadixNode  # node ending at the last inserted token
    conflict: bool = False  # stopped at the first duplicate (stop_on_conflict)
