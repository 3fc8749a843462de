"""Plans as wire bytes that Python's protobuf will not build, for the worker's
decoding to meet."""

from __future__ import annotations

from protos import worker_pb2 as pb


def negative_epoch_opening() -> bytes:
    """An opening whose epoch is int64 -1 on the wire: Python's protobuf cannot
    set a negative uint64, so the varint is written by hand (ten bytes)."""
    session_open = b"\x0a\x01x" + b"\x10" + b"\xff" * 9 + b"\x01"  # session_id "x", epoch -1
    field = pb.StepPlan.DESCRIPTOR.fields_by_name["session"].number
    return bytes([field << 3 | 2, len(session_open)]) + session_open
