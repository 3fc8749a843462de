"""The stop-string rule on a request's newest text (SGLang's
check_match_stop_str_prefix and the string half of its finish check).

A stop string in the text ends the request. Text that ends with the start of
a stop string may still become one: a streaming client is not shown it
until the next tokens settle it either way, so it never sees text that is
then cut.
"""

from __future__ import annotations

from typing import NamedTuple


class StopCheck(NamedTuple):
    """What the newest text says: the stop string in it, or whether it ends
    with a proper prefix of one (``partial``)."""

    matched: str | None
    partial: bool


NO_STOP = StopCheck(matched=None, partial=False)
PARTIAL_STOP = StopCheck(matched=None, partial=True)


def check_stop_text(text: str, stops: tuple[str, ...]) -> StopCheck:
    """``text`` against ``stops``: a match wins over a partial one."""
    partial = False
    for stop in stops:
        if stop in text:
            return StopCheck(matched=stop, partial=False)
        if not partial:
            partial = ends_with_prefix(text, stop)
    return PARTIAL_STOP if partial else NO_STOP


def ends_with_prefix(text: str, stop: str) -> bool:
    """Whether some non-empty suffix of ``text`` begins ``stop``. Only the
    places where ``stop``'s first character occurs in the last len(stop) - 1
    characters can start one, usually none."""
    first = stop[0]
    at = text.find(first, max(0, len(text) - len(stop) + 1))
    while at >= 0:
        if stop.startswith(text[at:]):
            return True
        at = text.find(first, at + 1)
    return False
