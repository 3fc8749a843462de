"""Comparisons of packed id runs (``array('i')`` slices, radix_node.py) for
the radix cache: the common prefix of a key and an edge, and which of a
caller's pages differ from the cached ones, in C slice operations and big-
integer arithmetic rather than a Python loop per id."""

from __future__ import annotations

from array import array

from scheduler_service.core.ids import ID_TYPE

_lane_masks_cache: dict[int, tuple[int, int]] = {}


def _lane_masks(lanes: int) -> tuple[int, int]:
    """(bit 31 of each of ``lanes`` 32-bit lanes, bit 0 of each), cached by length."""
    masks = _lane_masks_cache.get(lanes)
    if masks is None:
        if len(_lane_masks_cache) >= 256:
            _lane_masks_cache.clear()
        high = int.from_bytes(b"\x00\x00\x00\x80" * lanes, "little")
        masks = _lane_masks_cache[lanes] = (high, high >> 31)
    return masks


def _common_prefix(a: array, pos: int, b: array, limit: int) -> int:
    """Length of the common prefix of a[pos:pos+limit] and b[:limit], given
    that they differ: a binary search over C slice comparisons, each probe
    comparing only the part not yet known to agree (O(limit) in all)."""
    lo, hi = 0, limit  # a[pos:pos+lo] == b[:lo]; a[pos:pos+hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[pos + lo : pos + mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def differing_pages(mine: array, cached: array) -> array:
    """``[p for p, q in zip(mine, cached) if p != q]`` for two differing page
    runs of equal length, in bulk.

    Usually the caller's pages agree with the cached ones up to some point
    (pages it got from a match) and differ everywhere after (its own pages):
    that shape is found with slice comparisons and one XOR of the rest as big
    integers, with no per-page Python work; anything else takes the loop.
    """
    k = _common_prefix(mine, 0, cached, len(mine))
    rest = mine[k:]
    x = int.from_bytes(rest.tobytes(), "little") ^ int.from_bytes(cached[k:].tobytes(), "little")
    high, low = _lane_masks(len(rest))
    # A 32-bit lane of x is nonzero iff its bit 31 survives: (x | high) - low
    # keeps bit 31 of a lane whose low 31 bits are nonzero (no borrow crosses
    # lanes), and ``| x`` adds the lanes whose own bit 31 is set.
    if ((x | high) - low | x) & high == high:
        return rest
    return array(ID_TYPE, [p for p, q in zip(rest, cached[k:], strict=True) if p != q])


def common_len(key: array, pos: int, edge: array, limit: int) -> int:
    """Length of the common prefix of key[pos:pos+limit] and edge[:limit]."""
    if limit == len(edge):
        if key[pos : pos + limit] == edge:
            return limit
    elif key[pos : pos + limit] == edge[:limit]:
        return limit
    return _common_prefix(key, pos, edge, limit)
