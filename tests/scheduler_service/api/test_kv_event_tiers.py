"""The core's KV events as the gateway's messages: each medium its tier
(the host tier's stores and removals are not device ones), the namespace's
adapter and salt, the chain's parent."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_service.api.convert.kv_events import kv_event
from scheduler_service.core.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Medium,
)


def test_each_medium_is_its_tier() -> None:
    for medium, tier in (
        (Medium.DEVICE, cpb.KV_CACHE_TIER_DEVICE),
        (Medium.HOST, cpb.KV_CACHE_TIER_HOST),
        (Medium.STORAGE, cpb.KV_CACHE_TIER_DISK),
    ):
        stored = kv_event(1, BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None, medium))
        assert stored.stored.tier == tier
        assert [b.block_hash for b in stored.stored.blocks] == [11, 12]
        assert [list(b.token_ids) for b in stored.stored.blocks] == [[1, 2], [3, 4]]
        removed = kv_event(2, BlockRemoved([11], medium))
        assert removed.removed.tier == tier and list(removed.removed.block_hashes) == [11]


def test_device_is_the_default_and_the_namespace_is_split() -> None:
    e = kv_event(3, BlockStored([5], None, [7], 1, "lora:ada|s1"))
    assert e.event_id == 3 and e.stored.tier == cpb.KV_CACHE_TIER_DEVICE
    assert e.stored.lora_name == "ada" and e.stored.cache_salt == "s1"
    assert not e.stored.HasField("parent_block_hash")
    assert kv_event(4, AllBlocksCleared()).HasField("cleared")
