"""The worker's gRPC thread budget: every kind of call that can hold one of
gRPC's threads for long is bounded, so the pool always keeps threads for the
quick calls (GetInfo, UnloadAdapter, refusals) whoever reaches the port.

gRPC's synchronous server runs each call on a pool thread from its start to
its end, and a call past the pool's size waits for a thread (GetInfo waited
9 s behind ten Execute streams that never opened a session). A bounded call
past its bound is refused at once with RESOURCE_EXHAUSTED: queueing it would
hold a thread just the same. docs/design.md, section 8 ("The worker's
threads"), lists the budget.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import OrderedDict

# An Execute stream that has not sent its opening by then is refused: the
# scheduler sends it with the call itself.
OPEN_TIMEOUT_S = 3.0
# Execute streams that have not taken the worker over yet (waiting for their
# opening, for the step lock, or for the stream they replace to end).
UNOPENED_STREAMS = 4
EVICTED = object()  # put on an evicted stream's plan queue in place of a plan
# A replaced session whose caller does not read its results is stuck sending
# one (flow control): it is cancelled this long after being told to end.
REPLACED_GRACE_S = 1.0
TOKENIZER_STREAMS = 2  # GetTokenizer: a caller that stops reading holds its thread
ADAPTER_LOADS = 4  # LoadAdapter: reads files, which can be slow or never end (a FIFO)
QUICK_CALLS = 8  # the rest: GetInfo, UnloadAdapter, refusals of every kind


def worker_threads(grammar_compiles: int) -> int:
    """gRPC's pool: every bounded kind of call at its bound, plus the quick
    calls. ``grammar_compiles``: the CompileGrammar calls that may wait
    (--grammar-compile-queue; the grammar pool refuses the next one). Each
    unopened stream may pin one replaced stream for REPLACED_GRACE_S, and one
    session is active."""
    return (
        2 * UNOPENED_STREAMS
        + 1
        + TOKENIZER_STREAMS
        + ADAPTER_LOADS
        + grammar_compiles
        + QUICK_CALLS
    )


class CallSlots:
    """At most ``limit`` holders at once (thread-safe); past it a caller is
    refused, never queued."""

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def try_take(self) -> bool:
        with self._lock:
            if self._held >= self.limit:
                return False
            self._held += 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self._held -= 1

    def refusal(self) -> str:
        return (
            f"this worker already serves {self.limit} {self.what}, the most it takes at once; "
            "retry later"
        )


class UnopenedStreams:
    """Execute streams that have not taken the worker over yet, at most
    ``limit`` (thread-safe). Past it, a new stream takes the place of the
    oldest one still waiting for its opening message: a scheduler sends its
    opening with the call, so the oldest waiter is the likeliest stranger, and
    strangers' silent streams cannot keep a scheduler from opening. Only if
    every unopened stream has its opening (they are taking over) is the new
    one refused."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: set[int] = set()
        self._waiting: OrderedDict[int, queue.SimpleQueue] = OrderedDict()
        self._ids = itertools.count()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return len(self._held)

    def enter(self, plans: queue.SimpleQueue) -> int | None:
        """A place for the stream whose plans arrive on ``plans`` (its id), or
        None if every place is held by a stream that has its opening."""
        with self._lock:
            if len(self._held) >= self.limit:
                if not self._waiting:
                    return None
                oldest, its_plans = self._waiting.popitem(last=False)
                self._held.discard(oldest)
                its_plans.put(EVICTED)  # wakes it at once: its thread is freed
            stream = next(self._ids)
            self._held.add(stream)
            self._waiting[stream] = plans
            return stream

    def opened(self, stream: int) -> bool:
        """The stream's opening arrived; False if it was evicted before."""
        with self._lock:
            return self._waiting.pop(stream, None) is not None

    def leave(self, stream: int) -> None:
        with self._lock:
            self._waiting.pop(stream, None)
            self._held.discard(stream)

    def refusal(self) -> str:
        return (
            f"{self.limit} Execute streams are taking this worker over already, the most it "
            "takes at once; retry later"
        )

    def eviction(self) -> str:
        return (
            f"this worker holds at most {self.limit} Execute streams that have not sent their "
            "opening message; a newer stream took this one's place (a scheduler sends its "
            "opening with the call)"
        )
