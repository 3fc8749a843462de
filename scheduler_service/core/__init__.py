"""The scheduler's brain as a pure-Python library (no torch, no grpc).

The request table and its places, the radix prefix cache and KV-page
metadata (kv/), scheduling policies and admission (admission/), speculative
decoding (spec/), and the Scheduler, which turns requests into
transport-neutral step plans and applies their results. Its test oracle, the
in-process simulated worker, lives apart in scheduler_service/testing/.
"""

from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.intake import Submission
from scheduler_service.core.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from scheduler_service.core.kv.page_pool import PagePool
from scheduler_service.core.kv.radix_cache import RadixCache
from scheduler_service.core.outputs import RequestDelta, SchedulerStats
from scheduler_service.core.plan import (
    ForwardMode,
    Join,
    PlanEntry,
    ProtocolError,
    RequestOutput,
    StepPlan,
    StepResult,
    TokenLogprobs,
)
from scheduler_service.core.request import (
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    Place,
    Request,
)
from scheduler_service.core.results import StopStringChecker
from scheduler_service.core.sampling import InvalidRequestError, LogprobOptions, SamplingParams
from scheduler_service.core.scheduler import ENGINE_INTERFACE, Scheduler
from scheduler_service.core.stop_check import StopCheck, check_stop_text

__all__ = [
    "ENGINE_INTERFACE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "FinishAbort",
    "FinishLength",
    "FinishReason",
    "FinishStop",
    "ForwardMode",
    "InvalidRequestError",
    "Join",
    "KvEvent",
    "LogprobOptions",
    "PagePool",
    "Place",
    "PlanEntry",
    "ProtocolError",
    "RadixCache",
    "Request",
    "RequestDelta",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "StepResult",
    "StopCheck",
    "StopStringChecker",
    "Submission",
    "TokenLogprobs",
    "check_stop_text",
]
