"""The simulated model (``--model simulated``): no weights, a fixed time per
step, and tokens that are a deterministic hash of each request's context.

It exercises everything around the model (the protocol, the scheduler, the
engine's overlap, clients) at a cost the benchmark chooses, and its tokens
are reproducible whatever the batching, caching or retraction.
"""

from __future__ import annotations

import time
import zlib

from worker_service.model_runner import SeqWork
from worker_service.sampling.rows import SampleOutput

SIMULATED_VOCAB = 32000


def _crc(tokens: list[int], start: int, value: int) -> int:
    return zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens[start:]), value)


def simulated_token(context: list[int], vocab_size: int) -> int:
    """A hash of the whole context (crc32 of its bytes, mixed), in the vocabulary."""
    return _mix(_crc(context, 0, 0), vocab_size)


def _mix(h: int, vocab_size: int) -> int:
    return ((h * 0x9E3779B1) & 0xFFFFFFFF) % vocab_size


class SimulatedCompute:
    def __init__(self, step_time_s: float = 0.0, vocab_size: int = SIMULATED_VOCAB) -> None:
        self.step_time_s = step_time_s
        self.vocab_size = vocab_size
        # slot -> (rid, tokens hashed, crc so far): contexts only grow, so each
        # step hashes the new tokens only.
        self._crc: dict[int, tuple[str, int, int]] = {}

    def _context_crc(self, w: SeqWork) -> int:
        tokens = w.state.tokens
        rid, done, value = self._crc.get(w.slot, ("", 0, 0))
        if rid != w.state.rid or done > len(tokens):
            done, value = 0, 0
        value = _crc(tokens, done, value)
        self._crc[w.slot] = (w.state.rid, len(tokens), value)
        return value

    def run(self, work: list[SeqWork], num_extends: int) -> SampleOutput:
        t0 = time.perf_counter()
        out = SampleOutput()
        for w in work:
            if w.sample:
                out.token_ids.append(_mix(self._context_crc(w), self.vocab_size))
                out.logprobs.append(0.0)
                out.top_ids.append([])
                out.top_logprobs.append([])
                out.ids_logprobs.append([])
        remaining = self.step_time_s - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return out
