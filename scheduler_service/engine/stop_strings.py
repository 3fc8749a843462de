"""Stop strings matched on text (the Scheduler's StopStringChecker).

A stop string that completes with the newest token lies within the last few
tokens: every token spells at least one character except a few special ones,
so decoding the last len(stop) + 8 tokens finds it, at a cost independent of
the output's length.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from scheduler_service.core.request import Request

EXTRA_TOKENS = 8


class StopStringMatcher:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, req: Request) -> str | None:
        stops = req.sampling.stop_strs
        window = max(len(s) for s in stops) + EXTRA_TOKENS
        text = self.tokenizer.decode(
            req.output_ids[-window:], skip_special_tokens=req.sampling.skip_special_tokens
        )
        for s in stops:
            if s in text:
                return s
        return None
