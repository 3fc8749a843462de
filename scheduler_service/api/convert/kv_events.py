"""Radix-cache events -> smg.grpc.common KV event messages."""

from __future__ import annotations

from smg_grpc_proto.generated import common_pb2 as cpb

from scheduler_service.core.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    Medium,
)

# The core's media (SGLang's StorageMedium names) as the gateway's tiers: its
# cache-aware routing tells a device hit from one that must be loaded.
TIERS = {
    Medium.DEVICE: cpb.KV_CACHE_TIER_DEVICE,
    Medium.HOST: cpb.KV_CACHE_TIER_HOST,
    Medium.STORAGE: cpb.KV_CACHE_TIER_DISK,
}


def kv_event(event_id: int, e: KvEvent) -> cpb.KvCacheEvent:
    m = cpb.KvCacheEvent(event_id=event_id)
    if isinstance(e, BlockStored):
        stored = m.stored
        bs = e.block_size
        for i, h in enumerate(e.block_hashes):
            stored.blocks.add(
                block_hash=h, token_ids=e.token_ids[i * bs : (i + 1) * bs], block_size=bs
            )
        if e.parent_block_hash is not None:
            stored.parent_block_hash = e.parent_block_hash
        stored.tier = TIERS[e.medium]
        stored.locality = cpb.KV_CACHE_LOCALITY_LOCAL
        if e.extra_key is not None:
            # The core's namespace is "lora:ID" or "lora:ID|SALT" for an
            # adapter's requests, the salt alone otherwise.
            salt = e.extra_key
            if salt.startswith("lora:"):
                lora, _, salt = salt.removeprefix("lora:").partition("|")
                stored.lora_name = lora
            if salt:
                stored.cache_salt = salt
    elif isinstance(e, BlockRemoved):
        m.removed.block_hashes.extend(e.block_hashes)
        m.removed.tier = TIERS[e.medium]
        m.removed.locality = cpb.KV_CACHE_LOCALITY_LOCAL
    elif isinstance(e, AllBlocksCleared):
        m.cleared.SetInParent()
    return m
