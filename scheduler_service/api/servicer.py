"""The public API: sglang.grpc.scheduler.SglangScheduler (smg-grpc-proto's stubs).

Thin: requests are converted in convert/public.py, responses built in
convert/responses.py, execution happens in the core process behind the
CoreClient; the information and admin RPCs are answered by ``AdminRpcs``
(admin.py), Embed by ``EmbedRpc`` (embed.py). RPCs radixserve does not
implement answer UNIMPLEMENTED with a message.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import grpc
import structlog
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from scheduler_service import ipc
from scheduler_service.api.admin import AdminRpcs
from scheduler_service.api.call_observer import CallObserver
from scheduler_service.api.convert.public import GenerateCall, generate_call
from scheduler_service.api.convert.responses import (
    SampleState,
    accepted_chunk,
    chunk,
    complete,
    wants_input_logprobs,
)
from scheduler_service.api.core_client import (
    Call,
    CoreClient,
    CoreRestarting,
    CoreUnavailable,
    DrainEnded,
    Evicted,
    QueueFull,
)
from scheduler_service.api.decode_guard import Undecodable, refuse_undecodable
from scheduler_service.api.embed import EmbedRpc
from scheduler_service.api.grammar_check import (
    GrammarBusy,
    GrammarChecker,
    GrammarUnavailable,
    client_of,
)
from scheduler_service.api.lora_rpcs import LoraRpcs
from scheduler_service.api.metrics import SchedulerMetrics
from scheduler_service.api.model_info import ModelContext
from scheduler_service.api.readiness import WORKERS_LOST
from scheduler_service.core.intake import Submission
from scheduler_service.core.sampling import InvalidRequestError, SamplingParams

logger = structlog.get_logger(__name__)

# How long a new call waits for a cancelled call with the same request id to
# let it go (the cancel may reach the old call's coroutine after the new call).
RID_REUSE_GRACE_S = 1.0

SHUTTING_DOWN = "the server is shutting down and takes no new requests; retry on another server"


def _status_of(e: BaseException) -> str:
    """The gRPC status name an exception ends a call with."""
    code = getattr(e, "code", None)
    if callable(code):
        try:
            value = code()
            if isinstance(value, grpc.StatusCode):
                return value.name
        except Exception:
            pass
    return "INTERNAL"


def _core_failure(e: CoreUnavailable) -> tuple[str, str]:
    """(status name, message) for a call that met a failed core."""
    if isinstance(e, (DrainEnded, CoreRestarting)):
        return "UNAVAILABLE", str(e)
    if e.code == "INTERNAL":
        return "INTERNAL", f"internal error, the scheduler stopped: {e}"
    return "UNAVAILABLE", f"no worker can serve: {e}"


def chunk_deadline(now: float, interval_s: float) -> float:
    """When a paced stream that sent a chunk at ``now`` may send the next:
    the next point past ``now`` of a grid whose spacing is ``interval_s``
    rounded up to a power of two milliseconds. Every stream shares the grid,
    so the paced streams write in the same loop iteration and gRPC reports
    their writes done together: a gRPC message written alone costs several
    times its share of a burst (each completion crosses from gRPC's poller
    thread to the event loop)."""
    spacing = 2.0 ** math.ceil(math.log2(max(interval_s * 1e3, 1.0))) / 1e3
    return (math.floor(now / spacing) + 1) * spacing


def _observe_tokens(
    obs: CallObserver, samples: dict[str, SampleState], counts: dict[str, int], now: float
) -> None:
    for rid, n in counts.items():
        obs.tokens(rid, n, samples[rid].cached_tokens, now)


class SchedulerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(
        self,
        core: CoreClient,
        model: ModelContext,
        metrics: SchedulerMetrics | None = None,
        grammars: GrammarChecker | None = None,
    ) -> None:
        self.core = core
        self.model = model
        self.metrics = metrics
        self.grammars = grammars
        self.admin = AdminRpcs(core, model)
        self._prefill_unit = core.config.scheduler.disaggregation_mode == "prefill"
        self.lora = LoraRpcs(core)
        self.embeds = EmbedRpc(core, model, rid_grace_s=RID_REUSE_GRACE_S)
        self.shutting_down = False
        self.streamed_samples = 0  # samples of the streaming calls in flight

    async def _check_grammar(self, g: GenerateCall, context: grpc.aio.ServicerContext) -> None:
        """A constrained call reaches the core only once its grammar compiled
        (the samples of a call share one grammar)."""
        grammar = g.samples[0].sampling.grammar
        if grammar is None:
            return
        if self.grammars is None:
            raise InvalidRequestError("structured generation is not available on this server")
        verdict = await self.grammars.check(*grammar, client_of(context))
        if verdict:
            raise InvalidRequestError(verdict)

    def begin_shutdown(self) -> None:
        """From now on HealthCheck says the server is going away and new
        Generate calls end UNAVAILABLE (a gateway retries them elsewhere)."""
        self.shutting_down = True
        self.core.stop_holding()

    # ------------------------------------------------------------ Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        if isinstance(request, Undecodable):  # bytes that did not parse (decode_guard.py)
            await refuse_undecodable(request, self.metrics, context)
        obs = CallObserver(
            self.metrics,
            self.model.served_model_name,
            request.request_id,
            context.invocation_metadata(),
        )
        code, message = None, ""
        try:
            if self.shutting_down:
                code, message = "UNAVAILABLE", SHUTTING_DOWN
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            try:
                if self.model.scoring is not None:
                    raise InvalidRequestError(
                        f"the served model ({self.model.ready.architecture}) is a sequence "
                        "classifier: a score head and no LM head, so it cannot generate; "
                        "it scores prompts through Embed (rerank: is_cross_encoder)"
                    )
                g = generate_call(
                    request,
                    self.model.limits,
                    self.model.encode,
                    has_tokenizer=self.model.has_tokenizer,
                    adapters=self.core.adapter_ids(),
                    defaults=self.model.defaults,
                )
                g = g.traced(obs.accepted(g))
                await self._check_grammar(g, context)
                await self.core.wait_free([s.rid for s in g.samples], RID_REUSE_GRACE_S)
                await self.core.wait_restart(len(g.samples))
                if self.shutting_down:  # it began while the call waited
                    code, message = "UNAVAILABLE", SHUTTING_DOWN
                    await context.abort(grpc.StatusCode.UNAVAILABLE, message)
                call = self.core.submit(g.samples)
            except (InvalidRequestError, ValueError) as e:
                code, message = "INVALID_ARGUMENT", str(e)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            except (QueueFull, GrammarBusy) as e:
                code, message = "RESOURCE_EXHAUSTED", str(e)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            except CoreUnavailable as e:
                code, message = _core_failure(e)
                await context.abort(grpc.StatusCode[code], message)
            except GrammarUnavailable as e:
                code, message = "UNAVAILABLE", str(e)
                await context.abort(grpc.StatusCode.UNAVAILABLE, message)
            try:
                if self._prefill_unit and g.samples[0].bootstrap is not None:
                    # smg 1.13 gives up on a PD request's prefill leg that
                    # says nothing for 3 s while its unit answers no other
                    # leg; a CPU prefill unit's long prompt (and its queue)
                    # takes longer: an empty chunk says the call is taken.
                    yield accepted_chunk(g.rid, len(g.samples[0].prompt_ids))
                async for response in self._responses(g, call, context, obs):
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                code, message = code or "CANCELLED", message or "client disconnected"
                self.core.abort(call.rids, "client disconnected")
                raise
            except BaseException as e:
                # e.g. one sample refused: its siblings must not run on alone
                if code is None and obs.abort_code is None:
                    code, message = _status_of(e), str(e)
                self.core.abort(call.rids, "the call ended with an error")
                raise
            finally:
                self.core.forget(call)
        finally:
            code = code or obs.abort_code
            obs.end(code, message or obs.abort_message)

    async def _responses(
        self,
        g: GenerateCall,
        call: Call,
        context: grpc.aio.ServicerContext,
        obs: CallObserver,
    ) -> AsyncIterator[pb.GenerateResponse]:
        start = g.logprobs.logprob_start_len if g.logprobs.return_logprob else -1
        prompt = g.samples[0].prompt_ids
        end = g.samples[0].sampling.reasoning_end_token
        first = SampleState(call.rids[0], 0, prompt, start, reasoning_end=end)
        samples = {first.rid: first}
        for i, rid in enumerate(call.rids[1:], 1):
            # Siblings share the first sample's prompt logprobs (only it
            # computes them: generate_call).
            samples[rid] = SampleState(
                rid, i, prompt, start, prompt_logprobs=first.prompt_logprobs, reasoning_end=end
            )
        open_samples = set(samples)
        prompt_ready = len(samples) == 1 or start < 0
        with_lp = g.logprobs.return_logprob
        stream = g.stream
        deferred: dict[str, None] = {}
        rate = self.core.config.api.stream_chunks_per_s
        loop = asyncio.get_running_loop()
        if stream:
            self.streamed_samples += len(samples)
        try:
            not_before = 0.0  # loop time: the pace of chunks (--stream-chunks-per-s)
            single = first if len(samples) == 1 else None
            while open_samples:
                # everything that came: a paced reader, or one that fell
                # behind, sends fewer, bigger chunks
                items = await call.queue.take(not_before)
                now = time.perf_counter()
                touched: dict[str, None] = {}  # samples with news, in order
                counts: dict[str, int] = {}  # token news not yet told to the observer
                if single is not None and call.queue.news_only:  # the hottest path
                    news = [item[1] for item in items]
                    single.add_news(news, items[-1][2])
                    if stream:
                        single.unsent_tokens += news
                    obs.tokens(single.rid, len(news), single.cached_tokens, now)
                    touched[single.rid] = None
                    items = ()
                for item in items:
                    if type(item) is tuple:  # token news (inbox.py): the hot path
                        rid, token, cached = item
                        s = samples[rid]
                        s.add_news([token], cached)
                        if stream:
                            s.unsent_tokens.append(token)
                        counts[rid] = counts.get(rid, 0) + 1
                        touched[rid] = None
                        continue
                    if counts:  # the observer hears tokens before a finish after them
                        _observe_tokens(obs, samples, counts, now)
                        counts = {}
                    if isinstance(item, CoreUnavailable):
                        obs.failed(*_core_failure(item))
                        await context.abort(grpc.StatusCode[obs.abort_code], obs.abort_message)
                    if isinstance(item, ipc.Rejected):
                        obs.failed("INVALID_ARGUMENT", item.message)
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.message)
                    if isinstance(item, Evicted):
                        obs.failed("RESOURCE_EXHAUSTED", str(item))
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(item))
                    obs.delta(item, now)
                    finish = item.finish
                    if finish is not None and finish.code:
                        # The service's own abort (out of memory, an adapter
                        # lost): as SGLang's servicer, the call ends with its
                        # status and message, not a completion that drops both.
                        obs.failed(finish.code, finish.message)
                        await context.abort(grpc.StatusCode[finish.code], finish.message)
                    s = samples[item.rid]
                    tokens, lps = s.add(item)
                    if stream:
                        s.unsent_tokens += tokens
                        s.unsent_logprobs += lps
                    touched[item.rid] = None
                if counts:
                    _observe_tokens(obs, samples, counts, now)
                if not prompt_ready:
                    prompt_ready = first.finish is not None or first.has_prompt_logprobs()
                sent = False
                # Siblings whose answer waits for the first sample's prompt logprobs
                # (its prefill result normally arrives before any sibling's token; a
                # requeue after a worker loss can reorder them) are ``deferred``.
                for rid in dict.fromkeys([*deferred, *touched]) if deferred else touched:
                    s = samples[rid]
                    deferred.pop(rid, None)
                    if s is not first and wants_input_logprobs(s) and not prompt_ready:
                        deferred[rid] = None
                        continue
                    if stream:
                        if not s.chunk_due(g.stream_interval):
                            continue
                        tokens, lps = s.take_unsent()
                        if tokens or s.finish is not None:
                            sent = True
                            yield chunk(s, g.rid, tokens, lps, with_logprobs=with_lp)
                        if s.finish is not None:
                            yield complete(s, g.rid, tokens, lps, with_logprobs=with_lp)
                    elif s.finish is not None:
                        yield complete(s, g.rid, s.output_ids, s.logprobs, with_logprobs=with_lp)
                    if s.finish is not None:
                        open_samples.discard(rid)
                if rate > 0:
                    # Each stream's share of the chunk budget: the next chunk waits
                    # for it, gathering the tokens that come meanwhile. A call that
                    # does not stream answers once, at its end: only that wakes it
                    # (after its first tokens, which time the first-token latency).
                    if not stream:
                        if any(s.output_ids for s in samples.values()):
                            not_before = math.inf
                    elif sent:
                        not_before = chunk_deadline(loop.time(), self.streamed_samples / rate)
        finally:
            if stream:
                self.streamed_samples -= len(samples)

    # --------------------------------------------------------------- Embed
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        if isinstance(request, Undecodable):
            await refuse_undecodable(request, self.metrics, context)
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        return await self.embeds.embed(request, context)

    # --------------------------------------------------------------- Abort
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        call = self.core.find(request.request_id)
        if call is not None:
            self.core.abort(call.rids, request.reason or "aborted by the client")
            self.core.release(call)  # the id is free for a new call at once
        # Like SGLang: success whether or not the id was known.
        return pb.AbortResponse(success=True, message=f"Request {request.request_id} aborted")

    # --------------------------------------------------------- HealthCheck
    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        if self.shutting_down:
            return pb.HealthCheckResponse(healthy=False, message="Server is shutting down")
        if self.core.failed:
            return pb.HealthCheckResponse(healthy=False, message=self.core.failed)
        load = self.core.load
        if load is not None and not load.worker_connected:
            # No probe: it would only wait for the workers (readiness.py).
            return pb.HealthCheckResponse(healthy=False, message=WORKERS_LOST)
        probe = pb.GenerateRequest(
            request_id=f"HEALTH_CHECK_{time.time_ns()}",
            tokenized=pb.TokenizedInput(input_ids=[0]),
            sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=1),
            logprob_start_len=-1,
        )
        try:
            if self.model.scoring is not None:
                # A classifier cannot generate: its probe scores one token, as
                # SGLang's servicer probes an embedding model with an embedding.
                sub = Submission(
                    probe.request_id,
                    [0],
                    SamplingParams(max_new_tokens=0),
                    embed=self.embeds.options,
                )
                samples = [sub]
            else:
                g = generate_call(probe, self.model.limits, self.model.encode, has_tokenizer=False)
                samples = g.samples
            call = self.core.submit(samples, bounded=False)
        except (CoreUnavailable, ValueError) as e:
            return pb.HealthCheckResponse(healthy=False, message=f"Health check failed: {e}")
        try:
            while True:
                item = await asyncio.wait_for(call.queue.get(), self.model.health_timeout_s)
                if isinstance(item, ipc.DeltaOut) and (item.token_ids or item.finish):
                    return pb.HealthCheckResponse(healthy=True, message="Health check passed")
                if not isinstance(item, ipc.DeltaOut):
                    return pb.HealthCheckResponse(
                        healthy=False, message="Health check probe failed"
                    )
        except TimeoutError:
            self.core.abort(call.rids, "health check timed out")
            return pb.HealthCheckResponse(
                healthy=False,
                message=f"Health check timeout after {self.model.health_timeout_s:g}s",
            )
        finally:
            self.core.forget(call)

    # ------------------------------------------------- information and admin
    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        return self.admin.model_info()

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        return self.admin.server_info()

    async def GetLoads(self, request, context) -> pb.GetLoadsResponse:
        return await self.admin.loads(request, context)

    async def FlushCache(self, request, context) -> cpb.FlushCacheResponse:
        return await self.admin.flush_cache(request, context)

    async def GetTokenizer(self, request, context) -> AsyncIterator[cpb.GetTokenizerChunk]:
        async for piece in self.admin.tokenizer(context):
            yield piece

    async def SubscribeKvEvents(self, request, context) -> AsyncIterator[cpb.KvEventBatch]:
        async for batch in self.admin.kv_events(request, context):
            yield batch

    # ------------------------------------------------------- unimplemented
    async def _unimplemented(self, name: str, context) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"radixserve does not implement {name}")

    async def StartProfile(self, request, context) -> cpb.ProfileResponse:
        await self._unimplemented("StartProfile", context)

    async def StopProfile(self, request, context) -> cpb.ProfileResponse:
        await self._unimplemented("StopProfile", context)

    # ---------------------------------------------------------------- LoRA
    async def LoadLoRAAdapter(self, request, context) -> pb.LoadLoRAAdapterResponse:
        return await self.lora.load(request, context)

    async def UnloadLoRAAdapter(self, request, context) -> pb.UnloadLoRAAdapterResponse:
        return await self.lora.unload(request, context)

    async def ListLoadedLoRAAdapters(self, request, context) -> pb.ListLoadedLoRAAdaptersResponse:
        return await self.lora.list(request, context)
