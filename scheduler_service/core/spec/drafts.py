"""Draft sources for speculative decoding: guesses of a running request's
next tokens, which the worker verifies (docs/design.md, "Speculative
decoding"). A wrong guess costs compute, never correctness.

Two n-gram sources, tried in this order:

1. The radix cache's other sequences: if the request's whole sequence
   (prompt + outputs) is a path in the cache, in its own namespace, and the
   tree goes on, what another sequence continued with after exactly these
   tokens (the same prompt answered before, a shared document quoted on).
2. The request's own tokens (prompt lookup): the most recent earlier
   occurrence of the sequence's last 3 tokens, else of its last 2, and the
   tokens that followed it. Unigrams are not used: in natural text almost
   every token occurred before, so a unigram source always "has a match"
   and keeps a request drafting at a low acceptance rate.

Both are cheap per step: the n-gram index is a dict per n updated with the
tokens that arrived since the last call (bulk, C-level construction), built
only once the sequence's last bigram repeats (a C scan until then: text
that never repeats costs no index and no memory), and
the cache walk is cached as a cursor (the continuation's tokens) that later
steps advance without walking again; a walk that finds nothing is retried
only after the sequence grew by a backoff that doubles.
"""

from __future__ import annotations

from array import array
from itertools import repeat
from operator import lshift, or_
from typing import Protocol

from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import Request
from scheduler_service.core.spec.state import SpecState

# The longest continuation copied from the cache per walk (later steps
# advance through it without walking again).
RADIX_WINDOW = 64
RADIX_RETRY_MIN = 4  # tokens the sequence grows before a failed walk is retried
RADIX_RETRY_MAX = 256


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``req``'s known tokens (prompt +
    output_ids); ``state`` is the request's own scratch (SpecState)."""

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]: ...


class PromptLookup:
    """Incremental index of a sequence's bigrams and trigrams: each n-gram
    maps to the position of its last token at its most recent occurrence.
    Positions are indexed up to the one before the sequence's last, so the
    lookup of the current suffix finds an earlier occurrence, never itself."""

    __slots__ = ("bigrams", "indexed", "trigrams")

    def __init__(self) -> None:
        self.bigrams: dict[int, int] = {}
        self.trigrams: dict[int, int] = {}
        self.indexed = 0  # positions [0, indexed) are in the index

    def _index(self, t: array, end: int) -> None:
        start = self.indexed
        if end <= start:
            return
        bigrams, trigrams = self.bigrams, self.trigrams
        if end - start <= 16:  # the usual step: a token or a few, one by one
            for i in range(max(start, 1), end):
                key2 = (t[i - 1] << 32) | t[i]
                bigrams[key2] = i
                if i >= 2:
                    trigrams[(t[i - 2] << 64) | key2] = i
        else:  # a prompt: in bulk, in C (map/zip), later positions overwriting
            lo = max(start - 2, 0)
            ids = t[lo:end].tolist()
            high = list(map(lshift, ids, repeat(32, len(ids))))
            keys2 = list(map(or_, high, ids[1:]))  # keys2[j] ends at lo + 1 + j
            s2 = max(start, 1)
            bigrams.update(zip(keys2[s2 - lo - 1 :], range(s2, end), strict=True))
            s3 = max(start, 2)
            high3 = map(lshift, high[s3 - lo - 2 :], repeat(32))
            keys3 = map(or_, high3, keys2[s3 - lo - 1 :])  # as long as keys2[s3 - lo - 1 :]
            trigrams.update(zip(keys3, range(s3, end), strict=True))
        self.indexed = end

    @staticmethod
    def repeats_suffix(t: array) -> bool:
        """Whether the last two tokens occurred together before: a scan in C
        (bytes.rfind), so a request whose text never repeats (say random
        text) needs no index at all; the index is built at its first match."""
        n = len(t)
        if n < 3:
            return False
        raw = t.tobytes()
        width = t.itemsize
        pattern = raw[-2 * width :]
        end = (n - 1) * width  # an occurrence ending before the last token
        while True:
            at = raw.rfind(pattern, 0, end)
            if at < 0:
                return False
            if at % width == 0:
                return True
            end = at + len(pattern) - 1  # a match across token boundaries

    def propose(self, t: array, k: int) -> list[int]:
        n = len(t)
        if n < 3:
            return []
        self._index(t, n - 1)
        key2 = (t[n - 2] << 32) | t[n - 1]
        at = self.trigrams.get((t[n - 3] << 64) | key2)
        if at is None:
            at = self.bigrams.get(key2)
            if at is None:
                return []
        return t[at + 1 : at + 1 + k].tolist()


class NgramDrafter:
    """The service's drafter: the radix cache's continuation, else prompt lookup."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache

    def propose(self, req: Request, state: SpecState, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = req.token_array()
        drafts = self._from_cache(req, state, tokens, k)
        if drafts:
            return drafts
        lookup = state.lookup
        if lookup is None:
            if not PromptLookup.repeats_suffix(tokens):
                return []
            lookup = state.lookup = PromptLookup()
        return lookup.propose(tokens, k)

    def _from_cache(self, req: Request, state: SpecState, tokens: array, k: int) -> list[int]:
        n = len(tokens)
        cont = state.radix_cont
        if cont is not None:
            # Advance the cursor over the tokens that arrived since the walk.
            done = n - state.radix_base
            if 0 <= done < len(cont) and tokens[state.radix_base :] == cont[:done]:
                return cont[done : done + k].tolist()
            state.radix_cont = None
        if n < state.radix_retry_at:
            return []
        node = req.last_node  # the end of its locked cached prefix: walk from there
        if node is not None and node.parent is not None and not node.children:
            return []  # nothing in the tree goes on past its own prefix
        cont = self.cache.continuation(tokens, req.extra_key, RADIX_WINDOW, node)
        if cont is None:
            state.radix_retry_at = n + state.radix_backoff
            state.radix_backoff = min(2 * state.radix_backoff, RADIX_RETRY_MAX)
            return []
        state.radix_backoff = RADIX_RETRY_MIN
        state.radix_cont, state.radix_base = cont, n
        return cont[:k].tolist()


__all__ = ["Drafter", "NgramDrafter", "PromptLookup"]
