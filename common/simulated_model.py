"""The simulated model's one rule: the next token is a hash of the whole
context (prompt and output so far), so any request's correct output is known
in advance whatever the batching, caching, chunking or retraction.

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
