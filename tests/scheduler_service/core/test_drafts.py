"""The n-gram draft sources: prompt lookup's incremental index and the radix
cache's continuation of a whole sequence."""

from __future__ import annotations

import random
import sys

from scheduler_service.core.ids import id_array
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.request import Request
from scheduler_service.core.spec.drafts import NgramDrafter, PromptLookup
from scheduler_service.core.spec.state import SpecState


def _scan(tokens: list[int], k: int) -> list[int]:
    """Prompt lookup by a full scan: the most recent earlier trigram, else bigram."""
    n = len(tokens)
    for size in (3, 2):
        if n <= size:
            continue
        suffix = tokens[n - size :]
        for end in range(n - 2, size - 2, -1):
            if tokens[end - size + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_prompt_lookup_matches_a_full_scan_as_tokens_arrive():
    rng = random.Random(0)
    for vocab in (3, 6, 40):
        tokens = [rng.randrange(vocab) for _ in range(30)]
        lookup = PromptLookup()
        for _ in range(60):
            k = rng.randint(1, 6)
            assert lookup.propose(id_array(tokens), k) == _scan(tokens, k), tokens
            tokens.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 2, 3, 17, 40])))


def test_prompt_lookup_prefers_trigrams_and_the_latest_occurrence():
    lookup = PromptLookup()
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [9, 1, 2, 5, 1, 2, 6, 7, 3, 1, 2, 8, 1]
    assert lookup.propose(id_array(tokens + [2]), 3) == [8, 1, 2]  # latest "1 2"
    tokens = [4, 1, 2, 5, 0, 1, 2, 6, 4, 1, 2]
    assert PromptLookup().propose(id_array(tokens), 2) == [5, 0]  # "4 1 2" beats "1 2"


def _cache(page_size: int, seqs: list[list[int]], extra_key: str | None = None) -> RadixCache:
    pool = PagePool(1000, page_size)
    cache = RadixCache(page_size, pool)
    for seq in seqs:
        n = len(seq) - len(seq) % page_size
        cache.insert(seq[:n], pool.alloc(n // page_size), extra_key)
    return cache


def test_radix_continuation_of_a_whole_sequence():
    base = list(range(100, 120))
    for page_size in (1, 4):
        cache = _cache(page_size, [base + [1, 2, 3, 4, 5, 6, 7, 8], base[:10] + [50] * 12])
        # Ends on a page boundary, inside a page, and inside an edge.
        assert cache.continuation(id_array(base), None, 5).tolist() == [1, 2, 3, 4, 5]
        assert cache.continuation(id_array(base + [1, 2]), None, 3).tolist() == [3, 4, 5]
        assert cache.continuation(id_array(base[:10]), None, 2).tolist() in ([110, 111], [50, 50])
        assert cache.continuation(id_array(base + [1, 9]), None, 3) is None  # diverges
        assert cache.continuation(id_array(base + list(range(1, 9))), None, 3) is None  # the end
        assert cache.continuation(id_array(base), "other", 3) is None  # another namespace


def test_radix_continuation_takes_the_most_recent_branch():
    cache = _cache(1, [[1, 2, 3, 7, 7], [1, 2, 3, 8, 8]])
    assert cache.continuation(id_array([1, 2, 3]), None, 2).tolist() == [8, 8]
    cache.match([1, 2, 3, 7, 7])  # touched: now the most recent
    assert cache.continuation(id_array([1, 2, 3]), None, 2).tolist() == [7, 7]


def test_ngram_drafter_follows_the_cache_cursor_without_walking_again():
    answer = list(range(200, 240))
    prompt = [5, 6, 7, 8]
    cache = _cache(1, [prompt + answer])
    drafter = NgramDrafter(cache)
    req = Request("r", list(prompt))
    state = SpecState(8)
    assert drafter.propose(req, state, 4) == answer[:4]
    walks = []
    cache.continuation = lambda *a: walks.append(a)  # any further walk is seen
    req.output_ids.extend(answer[:3])
    assert drafter.propose(req, state, 4) == answer[3:7]
    assert not walks
    req.output_ids.append(1)  # diverged: the cursor is dropped, the walk retried later
    drafter.propose(req, state, 4)
    assert state.radix_cont is None and len(walks) == 1


def test_repeat_scan_agrees_with_the_index_and_skips_misaligned_bytes():
    rng = random.Random(1)
    for vocab in (4, 50, 1 << 20):
        tokens = [rng.randrange(vocab) for _ in range(5)]
        for _ in range(80):
            found = PromptLookup.repeats_suffix(id_array(tokens))
            assert found == bool(_scan(tokens, 1)), tokens
            tokens.append(rng.randrange(vocab))
    # The last pair's bytes (01 02 03 04 05 06 07 08, little-endian) occur
    # earlier only across token boundaries (at byte 2): no repeat.
    a, b = 0x04030201, 0x08070605
    misaligned = [0x02010000, 0x06050403, 0x00000807, a, b]
    if sys.byteorder == "little":
        pair = a.to_bytes(4, "little") + b.to_bytes(4, "little")
        assert pair in id_array(misaligned).tobytes()[:12]
    assert not PromptLookup.repeats_suffix(id_array(misaligned))
    assert PromptLookup.repeats_suffix(id_array([7, 0x0101, 0x0101, 0x0101]))


def test_random_text_builds_no_index():
    drafter = NgramDrafter(_cache(1, []))
    req = Request("r", list(range(1000, 3000)))
    state = SpecState(8)
    assert drafter.propose(req, state, 4) == []
    assert state.lookup is None
    req.output_ids.extend([1500, 1501])  # "1500 1501" occurred in the prompt
    assert drafter.propose(req, state, 3) == [1502, 1503, 1504]
    assert state.lookup is not None


def test_walk_from_a_requests_locked_prefix_node():
    base = list(range(100, 120))
    for page_size in (1, 4):
        cache = _cache(page_size, [base + [1, 2, 3, 4, 5, 6, 7, 8], base[:12] + [50] * 12])
        node = cache.match(base[:12]).node  # as a request that cached 12 prompt tokens
        for key in (base, base + [1, 2], base[:12], base[:14]):
            got = cache.continuation(id_array(key), None, 5, node)
            want = cache.continuation(id_array(key), None, 5)
            assert got == want, (page_size, key)
        # The drafter does not walk when nothing goes on past the request's node.
        leaf = cache.match(base[:12] + [50] * 12).node
        req = Request("r", base[:12] + [50] * 12)
        req.last_node = leaf
        walks = []
        cache.continuation = lambda *a, walks=walks: walks.append(a)
        assert NgramDrafter(cache).propose(req, SpecState(8), 4) == [50]
        assert not walks  # (prompt lookup: the latest "50 50 50" is one token back)
