"""Finish checks on newly sampled tokens (SGLang's update_finish_state order).

Order, for the token just appended: the end of its grammar (structured
generation), stop string, then EOS / stop token id, then length. Stop
conditions only count once more than ``min_new_tokens`` tokens exist: the
worker masks EOS and stop ids while fewer than ``min_new_tokens`` have been
generated, and the scheduler enforces the same rule for stop strings and for
workers that do not mask (the simulated one).
"""

from __future__ import annotations

from typing import Protocol

from scheduler_service.core.request import FinishLength, FinishReason, FinishStop, Request


class StopStringChecker(Protocol):
    """Detokenizes and looks for the request's stop strings in its new text.

    Called after each token appended to a request that has stop strings;
    returns the stop string that matched, or None. The service implements it
    with its incremental detokenizer.
    """

    def __call__(self, req: Request) -> str | None: ...


def check_finish(
    req: Request,
    token: int,
    eos_token_ids: frozenset[int],
    stop_strings: StopStringChecker | None,
    grammar_ended: bool = False,
) -> FinishReason | None:
    sp = req.sampling
    n = len(req.output_ids)
    if grammar_ended:
        # The grammar admits nothing after this token (it is usually EOS, which
        # the grammar allows only where it can end): done, whatever
        # ignore_eos or min_new_tokens say, unless the length ran out with it.
        return FinishLength(sp.max_new_tokens) if n >= sp.max_new_tokens else FinishStop(token)
    if n > sp.min_new_tokens:
        if sp.stop_strs and stop_strings is not None:
            matched = stop_strings(req)
            if matched is not None:
                return FinishStop(matched)
        if not sp.ignore_eos and (token in sp.stop_token_ids or token in eos_token_ids):
            return FinishStop(token)
    if n >= sp.max_new_tokens:
        return FinishLength(sp.max_new_tokens)
    return None
