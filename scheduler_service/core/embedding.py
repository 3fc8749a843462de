"""Embedding requests: how their vector is pooled from the final-norm hidden
states. An embedding request is a prefill-only request (max_new_tokens 0):
it is admitted, chunked and batched like any other, never samples, and
finishes with the result of its last prompt chunk, which carries its vector.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Pooling = Literal["last", "mean"]
POOLINGS: tuple[Pooling, ...] = ("last", "mean")


@dataclass(frozen=True, slots=True)
class EmbedOptions:
    pooling: Pooling = "last"
    normalize: bool = True  # L2-normalize the pooled vector

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, not {self.pooling!r}")

    @property
    def reads_cache(self) -> bool:
        """Whether the prompt may come from the prefix cache. Mean pooling
        needs the hidden state of every prompt position, and the cache keeps
        only KV: it computes the whole prompt (its pages still enter the
        cache for others). Last-token pooling computes the last position only."""
        return self.pooling == "last"
