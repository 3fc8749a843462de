"""A disaggregated unit's side of the KV transfers, built at start (prefill
unit: the bootstrap server, the send carrier; decode unit: the claims)."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from common.worker_token import metadata as worker_token_metadata
from protos import worker_pb2 as pb
from scheduler_service.config import ServiceConfig
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.bootstrap_server import ClaimInbox, start_bootstrap_server
from scheduler_service.engine.decode_transfers import DecodeTransfers
from scheduler_service.engine.kv_sends import KvSendCarrier
from scheduler_service.engine.prefill_transfers import PrefillTransfers
from scheduler_service.engine.wakeup import Wakeup
from scheduler_service.engine.worker_group import WorkerGroup
from scheduler_service.grammar_proto import grammar_to_proto

logger = structlog.get_logger(__name__)


def build_transfers(
    config: ServiceConfig,
    sched: Scheduler,
    group: WorkerGroup,
    *,
    info: pb.WorkerInfo,
    token: str | None,
) -> tuple[PrefillTransfers | DecodeTransfers | None, Wakeup | None, list[Callable[[], None]]]:
    """A disaggregated unit's side of the transfers (None when it serves
    alone), the wakeup its gRPC threads ring, and what to close at the end."""
    disagg = sched.disagg
    if disagg is None:
        return None, None, []
    # The gateway gives a PD request's prefill leg a few seconds of silence
    # (smg 1.13: 3 s for a short prompt) before giving up on it; the first
    # grammar would spend them starting the worker's compile processes.
    warm = pb.CompileGrammarRequest()
    grammar_to_proto(("json_schema", '{"type": "object"}'), warm.grammar)
    warming = group.ranks[0].stub.CompileGrammar.future(
        warm, timeout=120, metadata=worker_token_metadata(token)
    )  # held (a dropped future cancels its call) until the end
    scfg = sched.config
    wakeup = Wakeup()
    if disagg.prefill:
        inbox = ClaimInbox(wakeup)
        server, port = start_bootstrap_server(
            inbox,
            host=config.api.host,
            port=config.engine.disaggregation_bootstrap_port,
            token=token,
            max_claims=scfg.max_running_requests + 16,
            wait_s=scfg.disaggregation_bootstrap_timeout_s + scfg.disaggregation_waiting_timeout_s,
        )
        carrier = KvSendCarrier(
            [rank.stub for rank in group.ranks],
            token=token,
            timeout_s=scfg.disaggregation_waiting_timeout_s,
            on_done=wakeup.set,
        )
        prefill = PrefillTransfers(
            disagg,
            carrier,
            inbox,
            page_size=info.page_size,
            model=info.model.name,
            clock=time.monotonic,
            claim_ttl_s=scfg.disaggregation_bootstrap_timeout_s,
        )
        logger.info("prefill unit: serving bootstrap rooms", port=port)
        return (
            prefill,
            wakeup,
            [prefill.close, lambda: server.stop(0), wakeup.close, warming.cancel],
        )
    targets = config.engine.disaggregation_worker_addresses or tuple(
        rank.address for rank in group.ranks
    )
    if len(targets) != len(group.ranks):
        raise OSError(
            f"--disaggregation-worker-addresses names {len(targets)} workers for "
            f"{len(group.ranks)} ranks"
        )
    decode = DecodeTransfers(
        disagg,
        targets,
        page_size=info.page_size,
        model=info.model.name,
        token=token,
        timeout_s=scfg.disaggregation_bootstrap_timeout_s + scfg.disaggregation_waiting_timeout_s,
        wakeup=wakeup,
        clock=time.monotonic,
    )
    logger.info("decode unit: claims go to the prefill units named per request", workers=targets)
    return decode, wakeup, [decode.close, wakeup.close, warming.cancel]
