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

Compilation is cached (kind and text, bounded, for this model's vocabulary)
and happens off the step loop: the scheduler's API process asks for it
(``CompileGrammar``, a gRPC thread) before the request reaches the scheduler,
and xgrammar releases the GIL while it compiles. A grammar missing from the
cache at join (evicted, or a worker restarted) is compiled there, once.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

KINDS = ("regex", "json_schema", "ebnf", "structural_tag")
CACHE_GRAMMARS = 256  # compiled grammars kept per worker
# The simulated model's tokenizer: token t < 256 is the byte t, 256 is its end.
SIMULATED_EOS = 256

_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


class GrammarError(ValueError):
    """The grammar does not compile; the message is xgrammar's."""


def _xgr() -> Any:
    import xgrammar  # imported on first use: it brings transformers along

    return xgrammar


def _clean(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGR_LOCATION.sub("", text)


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary and caches them (LRU)."""

    def __init__(self, tokenizer_info: Callable[[], Any], capacity: int = CACHE_GRAMMARS) -> None:
        self._make_info = tokenizer_info
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()  # the cache and the compiler's creation
        self.vocab_size = 0

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = self._make_info()
                self.vocab_size = info.vocab_size
                # Each compile may use a few threads; compiles run on gRPC threads.
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def cached(self, kind: str, text: str) -> bool:
        with self._lock:
            return (kind, text) in self._cache

    def compile(self, kind: str, text: str) -> tuple[Any, float]:
        """(compiled grammar, milliseconds spent compiling: 0 if cached)."""
        key = (kind, text)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit, 0.0
        compiler = self._get_compiler()
        t0 = time.perf_counter()
        try:
            if kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "json_schema":
                compiled = compiler.compile_json_schema(text)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(text)
            elif kind == "structural_tag":
                compiled = compiler.compile_structural_tag(text)
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}; one of {KINDS}")
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own
            raise GrammarError(f"{kind}: {_clean(e)}") from None
        ms = (time.perf_counter() - t0) * 1e3
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return compiled, ms

    def matcher(self, kind: str, text: str, accepted: Sequence[int]) -> GrammarState:
        """A request's matcher, advanced over the tokens it already generated."""
        compiled, _ = self.compile(kind, text)
        state = GrammarState(_xgr().GrammarMatcher(compiled), self.vocab_size)
        for token in accepted:
            if not state.accept(token):
                raise GrammarError(f"token {token} of the request's output breaks its grammar")
        return state


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def ended(self) -> bool:
        """Nothing can follow: the grammar accepted its end (a stop token)."""
        return self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        if self.ended:
            return True  # an extra step planned before the end was known: discarded
        return bool(self.matcher.accept_token(token))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into row ``row`` of an xgrammar bitmask;
        after the end, every token (the step's token is discarded anyway)."""
        if self.ended:
            bitmask[row].fill_(-1)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask (int32, 32 tokens a word) for ``rows`` rows."""
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of rows ``rows`` of ``logits`` (on any device) to -inf."""
    mask = bitmask.to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)


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
