"""Structured generation on the worker: grammars compiled with xgrammar, one
matcher per constrained request, and the token bitmask that confines each
sampled token to what the grammar allows.

The mask is applied where the logits are (here); the matcher advances with
every token the request samples, so it needs the token's value before the
request's next mask: a constrained request's next step is never queued
before its previous one's tokens are back (ModelRunner does not overlap it).
A request that re-joins (retracted, or re-prefilled on a worker that replaced
a lost one) rebuilds its matcher by replaying the tokens it already has, so
its output continues exactly as an undisturbed run's would.

A reasoning request (``require_reasoning``) thinks first, unconstrained: its
grammar applies only after the end-of-reasoning token (``</think>``) first
appears in its output, as SGLang's reasoner grammar defers it. Whether that
token came is read from the output itself, so a replay after retraction or a
worker loss finds the section ended exactly where it had.

Compiled grammars are cached (kind and text, bounded by count and by bytes,
for this model's vocabulary). The scheduler's API process asks for each
constrained request's grammar (``CompileGrammar``) before the request reaches
the scheduler: a miss is compiled in the compile pool's child processes
(grammar_pool.py), bounded, at lower CPU priority, killed when nobody waits
for it any more, and the result loaded into the cache. A grammar missing from
the cache at join (evicted since, or a worker restarted) is compiled there,
in this process, once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from worker_service.device.transfer import to_device
from worker_service.sampling.grammar_compile import KINDS, GrammarError, compile_grammar
from worker_service.sampling.grammar_pool import CompilePool

CACHE_GRAMMARS = 256  # compiled grammars kept per worker
# ... and their memory (xgrammar's memory_size_bytes; a JSON schema nested 300
# deep takes 1.9 MB): a flood of big grammars does not pin memory.
CACHE_BYTES = 512 << 20
# A CompileGrammar call without a deadline waits at most this long.
MAX_COMPILE_S = 300.0
# The simulated model's tokenizer: token t < 256 is the byte t, 256 is its end.
SIMULATED_EOS = 256


class CompileTimeout(RuntimeError):
    """The grammar did not compile before its deadline (no verdict)."""


class CompileFailed(RuntimeError):
    """The compile ended without a verdict (its process died, the pool closed)."""


def _xgr() -> Any:
    import xgrammar  # imported on first use: it brings transformers along

    return xgrammar


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary and caches them (LRU)."""

    def __init__(
        self,
        tokenizer_info: Callable[[], Any],
        *,
        capacity_bytes: int = CACHE_BYTES,
        processes: int = 2,
        max_waiting: int = 16,
    ) -> None:
        self._make_info = tokenizer_info
        self._info: Any = None
        self._info_lock = threading.Lock()  # building the info takes seconds
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._cache_bytes = 0
        self._capacity_bytes = capacity_bytes
        self._loading: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()  # the cache, _loading, the pool's creation
        self._pool_size = (processes, max_waiting)
        self._pool: CompilePool | None = None
        self.vocab_size = 0

    def _tokenizer_info(self) -> Any:
        with self._info_lock:
            if self._info is None:
                self._info = self._make_info()
                self.vocab_size = self._info.vocab_size
            return self._info

    def _get_compiler(self) -> Any:
        info = self._tokenizer_info()
        with self._lock:
            if self._compiler is None:
                # Only the join fallback compiles here (pool children compile the rest).
                self._compiler = _xgr().GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def _get_pool(self) -> CompilePool:
        with self._lock:
            if self._pool is None:
                processes, max_waiting = self._pool_size
                self._pool = CompilePool(
                    lambda: self._tokenizer_info().serialize_json(), processes, max_waiting
                )
            return self._pool

    def _hit(self, key: tuple[str, str]) -> Any:  # under the lock
        hit = self._cache.get(key)
        if hit is None:
            return None
        self._cache.move_to_end(key)
        return hit[0]

    def _store(self, key: tuple[str, str], compiled: Any) -> None:  # under the lock
        if key in self._cache:
            return
        size = int(compiled.memory_size_bytes)
        self._cache[key] = (compiled, size)
        self._cache_bytes += size
        while len(self._cache) > 1 and (
            len(self._cache) > CACHE_GRAMMARS or self._cache_bytes > self._capacity_bytes
        ):
            _, (_, evicted) = self._cache.popitem(last=False)
            self._cache_bytes -= evicted

    def cached(self, kind: str, text: str) -> bool:
        with self._lock:
            return (kind, text) in self._cache

    def compile(self, kind: str, text: str) -> tuple[Any, float]:
        """(compiled grammar, milliseconds spent compiling: 0 if cached), compiled
        in this process: the join fallback."""
        key = (kind, text)
        with self._lock:
            hit = self._hit(key)
        if hit is not None:
            return hit, 0.0
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        compiled = compile_grammar(compiler, kind, text)
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._store(key, compiled)
        return compiled, ms

    def compile_in_pool(
        self,
        kind: str,
        text: str,
        timeout_s: float | None,
        on_cancel: Callable[[Callable[[], None]], object] | None = None,
    ) -> float:
        """Have ``(kind, text)`` compiled in the compile pool and cached here,
        waiting at most ``timeout_s``; the milliseconds it took in the compile
        process (0 if cached). GrammarError: it does not compile; PoolFull,
        CompileTimeout, CompileFailed: no verdict. ``on_cancel`` registers a
        callback for the caller's cancellation (gRPC's ``add_callback``)."""
        key = (kind, text)
        with self._lock:
            if self._hit(key) is not None:
                return 0.0
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; one of {KINDS}")
        timeout_s = MAX_COMPILE_S if timeout_s is None else min(timeout_s, MAX_COMPILE_S)
        deadline = time.monotonic() + timeout_s
        pool = self._get_pool()
        ticket = pool.submit(kind, text, deadline)
        try:
            if on_cancel is not None:
                on_cancel(lambda: pool.release(ticket))
            outcome = ticket.wait(deadline - time.monotonic())
            if outcome is None or outcome.timed_out:
                raise CompileTimeout(f"{kind}: not compiled within {timeout_s:g} s")
            if outcome.error:
                raise GrammarError(outcome.error)
            if outcome.failure:
                raise CompileFailed(f"{kind}: {outcome.failure}")
            self._load(key, outcome.payload)
            return outcome.ms
        finally:
            pool.release(ticket)

    def _load(self, key: tuple[str, str], payload: bytes) -> None:
        """A compiled grammar from the pool into the cache, deserialized once
        however many callers got it."""
        with self._lock:
            if self._hit(key) is not None:
                return
            lock = self._loading.setdefault(key, threading.Lock())
        with lock:
            try:
                with self._lock:
                    if self._hit(key) is not None:
                        return
                info = self._tokenizer_info()
                compiled = _xgr().CompiledGrammar.deserialize_json(payload.decode(), info)
                with self._lock:
                    self._store(key, compiled)
            finally:
                with self._lock:
                    self._loading.pop(key, None)

    def pool_process_ids(self) -> tuple[int | None, list[int]]:
        """The compile pool's processes (zygote, children): for tests."""
        with self._lock:
            pool = self._pool
        return (None, []) if pool is None else pool.process_ids()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def matcher(
        self,
        kind: str,
        text: str,
        accepted: Sequence[int],
        reasoning_end_token: int | None = None,
    ) -> GrammarState:
        """A request's matcher, advanced over the tokens it already generated;
        with ``reasoning_end_token``, the grammar starts after that token."""
        compiled, _ = self.compile(kind, text)
        state = GrammarState(
            _xgr().GrammarMatcher(compiled), self.vocab_size, waits_for=reasoning_end_token
        )
        for token in accepted:
            if not state.accept(token):
                raise GrammarError(f"token {token} of the request's output breaks its grammar")
        return state


class GrammarState:
    """One request's position in its grammar. ``waits_for``: a token (the end
    of a reasoning section) before which the grammar does not apply yet."""

    def __init__(self, matcher: Any, vocab_size: int, *, waits_for: int | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.waits_for = waits_for

    @property
    def constraining(self) -> bool:
        """The grammar applies to the next token (the reasoning section, if
        any, has ended)."""
        return self.waits_for is None

    @property
    def ended(self) -> bool:
        """Nothing can follow: the grammar accepted its end (a stop token)."""
        return self.waits_for is None and self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.waits_for is not None:
            if token == self.waits_for:
                self.waits_for = None  # the grammar starts with the next token
            return True
        if self.ended:
            return True  # an extra step planned before the end was known: discarded
        return bool(self.matcher.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into row ``row`` of an xgrammar bitmask;
        every token while the grammar waits and after its end (the step's
        token is discarded then anyway)."""
        if not self.constraining or self.ended:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask (int32, 32 tokens a word) for ``rows`` rows."""
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def bitmask_backend(device_type: str) -> str:
    """How the mask reaches logits on ``device_type``, decided once at start (the
    Sampler's): "cpu" is xgrammar's C++ loop over CPU tensors; everywhere else
    "torch", our few torch ops. xgrammar's own GPU paths compile at first use:
    "triton" (its default) a Triton kernel, whose launcher Triton builds with the
    host's C compiler, "cuda" a torch extension with nvcc, "torch_compile" goes
    through Triton; the CUDA image has no compiler. Its "torch_native" compiles
    nothing but indexes with Python lists, copied over from pageable memory
    (blocking) on every call."""
    return "cpu" if device_type == "cpu" else "torch"


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], *, backend: str
) -> None:
    """Disallowed tokens of rows ``rows`` of ``logits`` to -inf (``backend``:
    ``bitmask_backend``'s for the logits' device; ``bitmask`` on the host)."""
    if backend == "cpu":
        _xgr().apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=logits.shape[1], indices=rows, backend="cpu"
        )
    elif backend == "torch":
        _apply_with_torch(logits, bitmask, rows)
    else:
        raise ValueError(f"unknown bitmask backend {backend!r}")


def _apply_with_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The constrained rows' words and their indices go over in one pinned copy;
    token t is allowed iff bit t % 32 of word t // 32 is set (an arithmetic shift
    of the int32 word keeps that bit for the sign bit too). No host sync."""
    if not rows:
        return
    index = np.asarray(rows, np.int32)
    words, index_dev = to_device([bitmask.numpy()[index], index], logits.device)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # (rows, words, 32)
    allowed = bits.view(len(rows), -1)[:, :vocab].bool()
    index_dev = index_dev.long()
    block = logits.index_select(0, index_dev)
    block.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index_dev, block)


def huggingface_tokenizer_info(
    files: dict[str, bytes], vocab_size: int, stop_token_ids: Sequence[int]
) -> Any:
    """xgrammar's view of a model's vocabulary, from its tokenizer files."""
    import tempfile
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(tmp) / "tokenizer.json"))
    return _xgr().TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )


def simulated_tokenizer_info(vocab_size: int) -> Any:
    """The simulated model's vocabulary for grammars: bytes 0..255, then its end
    token, then tokens no grammar ever allows."""
    xgr = _xgr()
    vocab = [bytes([i]) for i in range(256)] + [b""] * (vocab_size - 256)
    return xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[SIMULATED_EOS]
    )
