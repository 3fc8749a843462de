"""Bootstrap: how the two units of a disaggregated request find each other.

The gateway sends a request to a prefill unit and a decode unit at once, both
with the same ``disaggregated_params`` (SGLang's bootstrap host, port and
room). The room names the transfer: the decode unit claims it, the prefill
unit sends that room's KV pages to whoever claimed it. The core keys a
request's transfer by its room (one live request per room) and reads nothing
else of it; host and port are the engine's, which dials the prefill unit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bootstrap:
    host: str
    port: int
    room: int


__all__ = ["Bootstrap"]
