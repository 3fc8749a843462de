"""The scheduler's brain as a pure-Python library (no torch, no grpc).

Queues, the radix prefix cache, KV-page metadata, scheduling policies,
admission, the running batch, and the step/update loop body that turns
requests into transport-neutral step plans. Its test oracle, the in-process
simulated worker, lives apart in scheduler_service/testing/.
"""

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.finish import StopStringChecker
from scheduler_service.core.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import (
    ForwardMode,
    JoinRequest,
    RequestOutput,
    ScheduledRequest,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from scheduler_service.core.request import (
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    Request,
    RequestState,
)
from scheduler_service.core.sampling import InvalidRequestError, LogprobOptions, SamplingParams
from scheduler_service.core.scheduler import ProtocolError, Scheduler

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "FinishAbort",
    "FinishLength",
    "FinishReason",
    "FinishStop",
    "ForwardMode",
    "InvalidRequestError",
    "JoinRequest",
    "KvEvent",
    "LogprobOptions",
    "PagePool",
    "ProtocolError",
    "RadixCache",
    "Request",
    "RequestDelta",
    "RequestOutput",
    "RequestState",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "StepResult",
    "StopStringChecker",
    "TokenLogprobs",
]
