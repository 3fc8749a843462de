"""The simulated model's one rule: the next token is a hash of the whole
context (prompt and output so far), so any request's correct output is known
in advance whatever the batching, caching, chunking or retraction. Its
"hidden state" at a position (embeddings) is likewise a function of the
context up to that position (``position_vector``).

Both simulated workers follow it: the worker service's ``--model simulated``
(worker_service/execution/simulated_compute.py) and the in-process oracle of the scheduler's
tests and benchmarks (scheduler_service/testing/simulated_worker.py). The hash
is crc32 over the tokens as 4-byte little-endian words, so a context that
grows is hashed incrementally, at C speed.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Callable, Sequence

SIMULATED_VOCAB = 32000  # the simulated model's vocabulary unless told otherwise
SIMULATED_HIDDEN = 8  # the simulated model's hidden size (its embeddings' length)

_LITTLE = sys.byteorder == "little"


def initial_state(adapter: str | None = None) -> int:
    """The hash of the empty context: 0 for the base model; a LoRA adapter's
    requests start from a hash of its name, so each adapter (by the name the
    scheduler loaded it under) is a different simulated model."""
    return 0 if adapter is None else zlib.crc32(b"lora:" + adapter.encode())


def absorb(state: int, tokens: Sequence[int]) -> int:
    """The context hash after ``tokens`` follow a context whose hash is ``state``
    (0 for the empty context)."""
    words = array("I", tokens)
    if not _LITTLE:
        words.byteswap()
    return zlib.crc32(words.tobytes(), state)


def token_of(state: int, vocab_size: int) -> int:
    """The token the simulated model samples after a context of hash ``state``."""
    return ((state * 0x9E3779B1) & 0xFFFFFFFF) % vocab_size


def simulated_token(context: Sequence[int], vocab_size: int, adapter: str | None = None) -> int:
    return token_of(absorb(initial_state(adapter), context), vocab_size)


def expected_output(
    prompt: Sequence[int],
    max_new_tokens: int,
    vocab_size: int,
    stop_ids: frozenset[int] = frozenset(),
    *,
    min_new_tokens: int = 0,
    stops: Callable[[list[int]], bool] | None = None,
    adapter: str | None = None,
) -> list[int]:
    """What any correct scheduler makes the simulated model generate for a
    prompt: it stops after a stop id once more than min_new_tokens tokens
    exist, or as soon as ``stops(output)`` holds (a stop string showed up:
    min_new_tokens holds back stop ids only, as in SGLang)."""
    state = absorb(initial_state(adapter), prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        tok = token_of(state, vocab_size)
        out.append(tok)
        state = absorb(state, (tok,))
        if (len(out) > min_new_tokens and tok in stop_ids) or (stops is not None and stops(out)):
            break
    return out


def position_vector(state: int) -> list[float]:
    """The simulated hidden state at a position whose context (up to and with
    it) hashes to ``state``: SIMULATED_HIDDEN values in [-1, 1)."""
    out = []
    for i in range(SIMULATED_HIDDEN):
        h = token_of(zlib.crc32(i.to_bytes(4, "little"), state), 1 << 31)
        out.append(h / (1 << 30) - 1.0)
    return out


def hidden_sum(state: int, tokens: Sequence[int], into: list[float]) -> int:
    """Add the hidden state of each of ``tokens`` (following a context of hash
    ``state``) to ``into``; the hash after them."""
    for tok in tokens:
        state = absorb(state, (tok,))
        for i, x in enumerate(position_vector(state)):
            into[i] += x
    return state


def pool(total: list[float], count: int, *, normalize: bool) -> list[float]:
    """``total`` / ``count``, L2-normalized if asked (the real worker's rule)."""
    vec = [x / count for x in total]
    if normalize:
        norm = sum(x * x for x in vec) ** 0.5
        vec = [x / max(norm, 1e-12) for x in vec]
    return vec


def simulated_embedding(
    prompt: Sequence[int], pooling: str, *, normalize: bool, adapter: str | None = None
) -> list[float]:
    """What the simulated model embeds ``prompt`` as: the hidden state of its
    last position ("last") or the mean over all of them ("mean")."""
    state = initial_state(adapter)
    if pooling == "last":
        return pool(position_vector(absorb(state, prompt)), 1, normalize=normalize)
    total = [0.0] * SIMULATED_HIDDEN
    hidden_sum(state, prompt, total)
    return pool(total, len(prompt), normalize=normalize)
