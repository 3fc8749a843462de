"""What the benchmark sends and what it records per request."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload. ``prompt_ids`` are token ids of the served
    model's vocabulary; ``arrival_s`` is a trace's send time (None: the
    runner's arrival process decides). Text workloads also keep the words:
    ``text`` is what the user asked (the chat message; vLLM's custom dataset
    line) and ``prompt_text`` the whole prompt the ids encode (chat template
    included), which a text-only API is sent as it is. ``seed`` is the
    request's sampling seed in sampled runs."""

    index: int
    prompt_ids: list[int]
    output_len: int
    group: int = -1
    arrival_s: float | None = None
    text: str | None = None
    prompt_text: str | None = None
    seed: int | None = None


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds since the run began;
    ``token_times`` has one entry per output token (tokens that arrive in one
    message share its time)."""

    index: int
    prompt_tokens: int
    start_s: float
    token_times: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)  # when the driver sees ids
    error: str | None = None
    # Speculative decoding (radixserve's GenerateComplete): drafted and
    # accepted tokens.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    output_text: str = ""  # when the driver sees text (an OpenAI endpoint)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float:
        return self.token_times[0] - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.token_times[-1] - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for one-token outputs)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    def itls_s(self) -> list[float]:
        """Gaps between successive messages (tokens of one message count once)."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t) if b > a]
