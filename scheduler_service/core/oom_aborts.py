"""Out-of-memory aborts: the requests the KV pool cannot hold, why, and
the warning logged for each."""

from __future__ import annotations

import structlog

from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.request import FinishAbort, Request

logger = structlog.get_logger(__name__)


def oom_after_retraction(req: Request) -> FinishAbort:
    """Why ``req`` is aborted: it cannot fit even alone."""
    logger.warning(
        "out of memory even after retraction",
        request_id=req.rid,
        trace_id=req.trace_id,
        tokens=req.num_tokens,
    )
    return FinishAbort(
        "out of memory: the KV cache cannot hold this request even after retracting all others"
    )


def unfit_head(
    chunked: Request | None, waiting: list[Request], pool: PagePool
) -> tuple[Request, FinishAbort] | None:
    """When nothing runs and nothing is in flight, yet nothing was admitted:
    an idle scheduler admits any request that fits, so the one first in line
    cannot fit even in an empty pool (a retracted request that grew), and
    waiting longer cannot help. That request and why it is aborted."""
    head = chunked if chunked is not None else (waiting or [None])[0]
    if head is None:
        return None
    capacity = pool.num_pages * pool.page_size
    logger.warning(
        "request does not fit the KV pool",
        request_id=head.rid,
        trace_id=head.trace_id,
        tokens=head.num_tokens,
    )
    return head, FinishAbort(
        f"out of memory: the request needs {head.num_tokens + 1} tokens of KV cache "
        f"and the pool holds {capacity}"
    )
