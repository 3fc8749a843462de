"""What the radix cache holds after a sequence: the walk behind
``RadixCache.continuation``, which speculative drafts read (drafts.py).

Read-only: neither the tree nor its LRU clock changes.
"""

from __future__ import annotations

from array import array

from scheduler_service.core.kv.id_runs import common_len
from scheduler_service.core.kv.radix_node import RadixNode


def _last_access(node: RadixNode) -> int:
    return node.last_access


def continuation(
    root: RadixNode | None,
    page_size: int,
    key: array,
    max_tokens: int,
    *,
    start: RadixNode | None = None,
) -> array | None:
    """The tokens that follow all of ``key`` below ``root`` (another sequence
    went on after exactly these tokens), up to ``max_tokens``, taking the
    most recently used branch at forks; None when ``key`` is not wholly a
    path prefix or nothing follows it. ``key`` may end inside a page.
    ``start``: a node whose path is known to spell the start of ``key`` (a
    request's locked prefix), where the walk begins instead of ``root``."""
    pos = 0
    node: RadixNode | None
    if start is not None and start.parent is not None:
        node = start
        while node.parent is not None:
            pos += len(node.key)
            node = node.parent
        node = start
    else:
        node = root
    if node is None or max_tokens <= 0:
        return None
    n = len(key)
    while True:
        rest = n - pos
        if rest >= page_size:
            child = node.children.get(
                key[pos] if page_size == 1 else key[pos : pos + page_size].tobytes()
            )
            if child is None:
                return None
            edge = child.key
            m = min(len(edge), rest)
            if common_len(key, pos, edge, m) < m:
                return None
        else:  # the key ends here or inside the next page: any child that agrees
            tail = key[pos:]
            fits = [c for c in node.children.values() if c.key[:rest] == tail]
            if not fits:
                return None
            child = max(fits, key=_last_access)
            edge = child.key
        if rest < len(edge):
            out = edge[rest : rest + max_tokens]
            node = child
            while len(out) < max_tokens and node.children:
                node = max(node.children.values(), key=_last_access)
                out += node.key[: max_tokens - len(out)]
            return out
        pos += len(edge)
        node = child
