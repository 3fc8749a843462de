"""The keys radixserve reads from ``SamplingParams.custom_params`` (a JSON
object, google.protobuf.Struct): the public API (SGLang's proto) has no
field for them.

- ``seed`` (integer in [0, 2^64)): the sampling seed.
- ``priority`` (integer in [-2^31, 2^31)): the request's priority; it orders
  the queue and preempts with ``--enable-priority-scheduling`` (higher runs
  first unless ``--schedule-low-priority-values-first``), else it is unused.
- ``routing_key`` (non-empty string, at most 256 characters): the
  ``routing-key`` policy runs requests whose key is common in the running
  batch first.
- ``speculative`` (boolean): false turns speculative decoding off for this
  request (it is on wherever the service's ``--speculative-ngram`` is).

Any other key is refused by name (INVALID_ARGUMENT). SGLang hands the
object to custom logit processors, which radixserve does not run, so another
key would have no effect; the SMG gateway never sets custom_params.
"""

from __future__ import annotations

import math

from google.protobuf.struct_pb2 import Struct, Value

from scheduler_service.core.sampling import InvalidRequestError

SEED_LIMIT = 1 << 64  # the worker protocol's seed is a uint64
PRIORITY_LIMIT = 1 << 31
MAX_ROUTING_KEY_LEN = 256
KNOWN_KEYS = ("seed", "priority", "routing_key", "speculative")


def check_keys(params: Struct) -> None:
    """Refuse a key no reader below takes: it would be dropped without a word."""
    unknown = sorted(set(params.fields) - set(KNOWN_KEYS))
    if unknown:
        raise InvalidRequestError(
            f"custom_params: unknown keys {unknown[:5]}; radixserve reads only "
            f"{', '.join(KNOWN_KEYS)} (it runs no custom logit processors)"
        )


def _integer(name: str, value: Value, low: int, high: int, *, shown: str) -> int:
    number = value.number_value
    if value.WhichOneof("kind") != "number_value" or not math.isfinite(number):
        got = value.WhichOneof("kind") or "nothing"
        raise InvalidRequestError(
            f"custom_params.{name} must be a finite number, got {got}: {number}"
        )
    if not (low <= number < high and number == int(number)):
        raise InvalidRequestError(
            f"custom_params.{name} must be an integer in {shown}, got {number}"
        )
    return int(number)


def _of_kind(name: str, value: Value, kind: str, shown: str) -> str | bool:
    """The value of a non-numeric key, refused unless it is of ``kind``."""
    if value.WhichOneof("kind") != kind:
        got = value.WhichOneof("kind") or "nothing"
        raise InvalidRequestError(f"custom_params.{name} must be {shown}, got {got}")
    return getattr(value, kind)


def seed(params: Struct) -> int | None:
    if "seed" not in params.fields:
        return None
    return _integer("seed", params.fields["seed"], 0, SEED_LIMIT, shown="[0, 2^64)")


def priority(params: Struct) -> int:
    """0 when not given (SGLang's default)."""
    if "priority" not in params.fields:
        return 0
    return _integer(
        "priority",
        params.fields["priority"],
        -PRIORITY_LIMIT,
        PRIORITY_LIMIT,
        shown="[-2^31, 2^31)",
    )


def routing_key(params: Struct) -> str | None:
    if "routing_key" not in params.fields:
        return None
    key = _of_kind("routing_key", params.fields["routing_key"], "string_value", "a string")
    if not key or len(key) > MAX_ROUTING_KEY_LEN:
        raise InvalidRequestError(
            f"custom_params.routing_key must have 1 to {MAX_ROUTING_KEY_LEN} characters, "
            f"got {len(key)}"
        )
    return key


def speculative(params: Struct) -> bool:
    """True when not given: the service's --speculative-ngram decides."""
    if "speculative" not in params.fields:
        return True
    return _of_kind("speculative", params.fields["speculative"], "bool_value", "a boolean")
