"""Stop strings matched on text (the Scheduler's StopStringChecker).

A stop string that completes with the newest token lies within the last few
tokens: every token spells at least one character (special tokens their
names; a character split over byte tokens at worst four per character), so
decoding the last len(stop) + 8 tokens finds it, and any start of one at the
end, at a cost independent of the output's length.

The tail is decoded with special tokens kept, whatever the request's
skip_special_tokens says (SGLang's tail_str): that flag shapes the client's
text, and a stop string such as "<|im_end|>" must match under the gateway's
default skip_special_tokens=true.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from scheduler_service.core.request import Request
from scheduler_service.core.stop_check import StopCheck, check_stop_text

EXTRA_TOKENS = 8


class StopStringMatcher:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, req: Request) -> StopCheck:
        stops = req.sampling.stop_strs
        window = max(len(s) for s in stops) + EXTRA_TOKENS
        text = self.tokenizer.decode(req.output_ids[-window:], skip_special_tokens=False)
        return check_stop_text(text, stops)
