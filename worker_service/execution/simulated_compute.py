"""The simulated model (``--model simulated``): no weights, a fixed time per
step, and tokens that follow the simulated model's rule (a hash of each
request's whole context, common/simulated_model.py), the same rule as the
scheduler tests' in-process oracle.

It exercises everything around the model (the protocol, the scheduler, the
engine's overlap, clients) at a cost the benchmark chooses, and its tokens
are reproducible whatever the batching, caching or retraction. A request
of a LoRA adapter starts its hash from ``initial_state(name)`` (each adapter,
by the name it was loaded under, is another simulated model); LoadAdapter
reads only the adapter's config (lora/loaders.py). A request
with a grammar picks by the same hash among the tokens its grammar allows
(the simulated vocabulary: byte t is token t, 256 ends a grammar).

An embedding request gets the simulated model's vector
(``simulated_embedding``) with the chunk that ends its prompt.

A drafted extend (speculative decoding) samples after its last known token
and after each draft by the same rule, and the runner keeps the drafts that
equal their samples, so the simulated output never depends on the drafts.

For fault tests, ``fail_token`` makes every step that computes that token as
an input fail (an exception, as a model that crashes on some input would):
the worker answers the step with an error.
"""

from __future__ import annotations

import time

import numpy as np

from common.simulated_model import (
    SIMULATED_VOCAB,
    absorb,
    initial_state,
    simulated_embedding,
    token_of,
)
from worker_service.execution.step_work import SeqWork
from worker_service.sampling.grammar import allocate_bitmask
from worker_service.sampling.rows import PooledEmbedding, SampleOutput


class SimulatedFault(RuntimeError):
    """The failure ``--simulated-fail-token`` asks for."""


class SimulatedCompute:
    def __init__(
        self,
        step_time_s: float = 0.0,
        vocab_size: int = SIMULATED_VOCAB,
        fail_token: int | None = None,
    ) -> None:
        self.step_time_s = step_time_s
        self.vocab_size = vocab_size
        self.fail_token = fail_token
        # slot -> (rid, tokens hashed, hash so far): contexts only grow, so each
        # step hashes the new tokens only.
        self._hashes: dict[int, tuple[str, int, int]] = {}

    def _allowed(self, w: SeqWork) -> list[int]:
        bitmask = allocate_bitmask(1, self.vocab_size)
        w.state.grammar.fill(bitmask, 0)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab_size]).tolist()

    def _context_hash(self, w: SeqWork) -> int:
        tokens = w.state.tokens
        rid, done, value = self._hashes.get(w.slot, ("", 0, 0))
        if rid != w.state.rid or done > len(tokens):
            adapter = w.state.adapter
            done, value = 0, initial_state(None if adapter is None else adapter.name)
        value = absorb(value, tokens[done:])
        self._hashes[w.slot] = (w.state.rid, len(tokens), value)
        return value

    def run(self, work: list[SeqWork], num_extends: int) -> SampleOutput:
        t0 = time.perf_counter()
        if self.fail_token is not None and any(self.fail_token in w.inputs for w in work):
            raise SimulatedFault(f"the simulated model fails on token {self.fail_token}")
        out = SampleOutput()
        for w in work[:num_extends]:
            state = w.state
            if state.pooling and w.start + len(w.inputs) == state.prompt_len:
                adapter = None if state.adapter is None else state.adapter.name
                vec = simulated_embedding(
                    state.tokens[: state.prompt_len],
                    state.pooling,
                    normalize=state.normalize,
                    adapter=adapter,
                )
                out.embeddings.append(PooledEmbedding(w.slot, vec))
        for w in work:
            if w.sample:
                state = self._context_hash(w)
                if w.state.grammar is None:
                    token = token_of(state, self.vocab_size)
                else:  # the same rule, over the tokens the grammar allows
                    allowed = self._allowed(w)
                    token = allowed[token_of(state, len(allowed))]
                _emit(out, token)
                # A drafted extend: a sample after each draft, as if the drafts
                # before it were accepted (the runner accepts them,
                # sampling/draft_acceptance.py).
                if w.draft_len:
                    for draft in w.inputs[len(w.inputs) - w.draft_len :]:
                        state = absorb(state, (draft,))
                        _emit(out, token_of(state, self.vocab_size))
        remaining = self.step_time_s - (time.perf_counter() - t0)
        if remaining > 0:
            time.sleep(remaining)
        return out


def _emit(out: SampleOutput, token: int) -> None:
    out.token_ids.append(token)
    out.logprobs.append(0.0)
    out.top_ids.append([])
    out.top_logprobs.append([])
    out.ids_logprobs.append([])
