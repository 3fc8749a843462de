"""The public API (sglang.grpc.scheduler) <-> the scheduler's dataclasses.

Field semantics follow SGLang's gRPC servicer, where proto3 zero values are
not the defaults: temperature 0 is greedy; top_p 0, top_k 0 and
repetition_penalty 0 mean "unset"; an unset max_new_tokens means "until the
context is full"; logprob_start_len 0 asks for the whole prompt's logprobs
(the gateway sends -1 for outputs only). Booleans are taken as sent (the
gateway sends skip_special_tokens and spaces_between_special_tokens
explicitly), except ``log_metrics``: every call is counted in the metrics
whatever it says, because its false is also proto3's "unset", which is what
the gateway's chat and completions paths send for ordinary traffic (SGLang's
servicer never reads it either). Fields radixserve would otherwise drop are
refused by name (``_refuse_unsupported``, ``custom_params.check_keys``).

An unset field gets the model's default where it declares one
(generation_config.json, as SGLang's --sampling-defaults model), else the
neutral value (top_p 1.0, top_k -1, repetition_penalty 1.0). Temperature
and min_p cannot be unset on the wire (0 is greedy, 0 is off): their
defaults are the gateway's to apply, from GetModelInfo.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Collection
from dataclasses import dataclass

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service.api.convert import custom_params
from scheduler_service.config import LimitsConfig
from scheduler_service.core.bootstrap import Bootstrap
from scheduler_service.core.intake import Submission
from scheduler_service.core.sampling import InvalidRequestError, LogprobOptions, SamplingParams


@dataclass(frozen=True, kw_only=True)
class Limits(LimitsConfig):
    """What a request is checked against: the service's limits and the model's."""

    vocab_size: int
    context_len: int  # the model's context, capped by the KV pool
    # The model's end-of-reasoning token (--think-end-token in its vocabulary);
    # None: the model has none, and require_reasoning is refused.
    reasoning_end_token: int | None = None


# The public API's constraint fields -> our grammar kinds.
_GRAMMAR_KIND_OF_FIELD = {
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf_grammar": "ebnf",
    "structural_tag": "structural_tag",
}


@dataclass(frozen=True)
class ModelDefaults:
    """The model's sampling defaults a request's unset fields take (None:
    the model declares none; ipc.Ready.sampling_defaults)."""

    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def of(cls, declared: dict[str, float | int]) -> ModelDefaults:
        """The declared defaults a request can take: one our checks would
        refuse (say repetition_penalty 3) is left out, so a client is never
        refused for a field it did not send."""
        ok = {
            "top_p": lambda v: 0 < v <= 1,
            "top_k": lambda v: v >= 0 or v == -1,
            "repetition_penalty": lambda v: 0 < v <= 2,
            "max_new_tokens": lambda v: v >= 0,
        }
        return cls(**{k: v for k, v in declared.items() if k in ok and ok[k](v)})


NO_DEFAULTS = ModelDefaults()


@dataclass(frozen=True)
class GenerateCall:
    rid: str
    stream: bool
    samples: list[Submission]  # one per sample (n > 1: rid-0, rid-1, ...)
    prompt_len: int
    logprobs: LogprobOptions
    stream_interval: int = 1  # streamed tokens per chunk (the last chunk: what is left)
    lora_id: str | None = None  # the LoRA adapter it runs with (None: the base model)

    def traced(self, context: tuple[str, str] | None) -> GenerateCall:
        """The call with its Generate span's context on every sample (the
        core's spans hang under it)."""
        if context is None:
            return self
        samples = [dataclasses.replace(s, trace_context=context) for s in self.samples]
        return dataclasses.replace(self, samples=samples)


def _finite(name: str, value: float) -> float:
    if math.isnan(value) or math.isinf(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}")
    return value


def sampling_from_proto(
    m: pb.SamplingParams,
    prompt_len: int,
    limits: Limits,
    stop_strs_ok: bool,
    *,
    defaults: ModelDefaults = NO_DEFAULTS,
) -> SamplingParams:
    temperature = _finite("temperature", m.temperature)
    if temperature < 0:
        raise InvalidRequestError(f"temperature must be >= 0, got {temperature}")
    top_p = _finite("top_p", m.top_p)
    if not 0.0 <= top_p <= 1.0:
        raise InvalidRequestError(f"top_p must be in [0, 1] (0 means unset), got {top_p}")
    for name in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        _finite(name, getattr(m, name))
    room = max(limits.context_len - prompt_len, 0)
    if m.HasField("max_new_tokens"):
        max_new = m.max_new_tokens
    elif defaults.max_new_tokens is not None:
        max_new = min(defaults.max_new_tokens, room)  # a default never refuses a prompt
    else:
        max_new = room
    stops = tuple(m.stop)
    if len(stops) > limits.max_stop_strings:
        raise InvalidRequestError(
            f"at most {limits.max_stop_strings} stop strings, got {len(stops)}"
        )
    longest = max(map(len, stops), default=0)
    if longest > limits.max_stop_string_len:
        raise InvalidRequestError(
            f"stop strings must be at most {limits.max_stop_string_len} characters, "
            f"got one of {longest}"
        )
    if len(m.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(m.stop_token_ids)}"
        )
    if stops and not stop_strs_ok:
        raise InvalidRequestError("stop strings need a tokenizer, and this model has none")
    if len(m.logit_bias) > limits.max_logit_bias:
        raise InvalidRequestError(
            f"logit_bias may name at most {limits.max_logit_bias} tokens, got {len(m.logit_bias)}"
        )
    bias: list[tuple[int, float]] = []
    for key, value in m.logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys are token ids, got {key!r}") from None
        value = _finite(f"logit_bias[{key}]", value)
        if abs(value) > limits.max_logit_bias_value:
            raise InvalidRequestError(
                f"logit_bias values must be in [-{limits.max_logit_bias_value:g}, "
                f"{limits.max_logit_bias_value:g}], got {value} for token {key}"
            )
        bias.append((token, value))
    grammar = None
    field = m.WhichOneof("constraint")
    if field is not None:
        text = getattr(m, field)
        if not text.strip():
            raise InvalidRequestError(f"{field} is empty")
        size = len(text.encode())
        if size > limits.max_grammar_bytes:
            raise InvalidRequestError(
                f"{field} has {size} bytes, the limit (--max-grammar-bytes) is "
                f"{limits.max_grammar_bytes}"
            )
        grammar = (_GRAMMAR_KIND_OF_FIELD[field], text)
    custom_params.check_keys(m.custom_params)
    seed = custom_params.seed(m.custom_params)
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=m.min_new_tokens,
        temperature=temperature,
        top_p=top_p or _default(defaults.top_p, 1.0),
        top_k=m.top_k or _default(defaults.top_k, -1),
        min_p=m.min_p,
        frequency_penalty=m.frequency_penalty,
        presence_penalty=m.presence_penalty,
        repetition_penalty=m.repetition_penalty or _default(defaults.repetition_penalty, 1.0),
        stop_strs=stops,
        stop_token_ids=frozenset(m.stop_token_ids),
        ignore_eos=m.ignore_eos,
        skip_special_tokens=m.skip_special_tokens,
        spaces_between_special_tokens=m.spaces_between_special_tokens,
        no_stop_trim=m.no_stop_trim,
        logit_bias=tuple(sorted(bias)),
        seed=seed,
        grammar=grammar,
    )


def _default(value: float | int | None, neutral: float | int) -> float | int:
    """A model's default, unless it declares the neutral value's stand-in
    (HF's top_k 0 is "no limit", as our -1)."""
    return neutral if value is None or value == 0 else value


def generate_call(
    m: pb.GenerateRequest,
    limits: Limits,
    encode,
    *,
    has_tokenizer: bool,
    adapters: Collection[str] = (),
    defaults: ModelDefaults = NO_DEFAULTS,
) -> GenerateCall:
    """Validate and convert; ``encode(text) -> ids`` tokenizes original_text;
    ``adapters``: the lora_ids loaded; ``defaults``: the model's sampling
    defaults, for the fields a request leaves unset."""
    if m.return_hidden_states:
        raise InvalidRequestError("hidden states are not returned by radixserve")
    _refuse_unsupported(m)
    if m.HasField("mm_inputs") and m.mm_inputs.ByteSize():
        raise InvalidRequestError("multimodal inputs are not supported by radixserve")
    if m.input_embeds:
        raise InvalidRequestError("input embeddings are not supported; send token ids")
    adapter = m.lora_id or None
    if adapter is not None and adapter not in adapters:
        loaded = ", ".join(sorted(adapters)[:10]) or "none"
        raise InvalidRequestError(
            f"lora_id {adapter!r} names no loaded LoRA adapter (loaded: {loaded}); load it "
            "with LoadLoRAAdapter first"
        )
    ids = list(m.tokenized.input_ids)
    if not ids and m.tokenized.original_text:
        if not has_tokenizer:
            raise InvalidRequestError("original_text needs a tokenizer, and this model has none")
        ids = encode(m.tokenized.original_text)
    if not ids:
        raise InvalidRequestError("the input is empty: give tokenized.input_ids or original_text")
    check_input_ids(ids, limits, noun="prompt")
    sp = sampling_from_proto(m.sampling_params, len(ids), limits, has_tokenizer, defaults=defaults)
    if m.require_reasoning:
        # SGLang's meaning: the output opens with a thinking section; the
        # grammar applies after its end token, the tokens up to it are counted.
        if limits.reasoning_end_token is None:
            raise InvalidRequestError(
                "require_reasoning: this model's vocabulary has no end-of-reasoning token "
                "(--think-end-token names it)"
            )
        sp = dataclasses.replace(sp, reasoning_end_token=limits.reasoning_end_token)
    n = max(m.sampling_params.n, 1)
    if n > limits.max_n:
        raise InvalidRequestError(f"n must be at most {limits.max_n}, got {n}")
    if m.top_logprobs_num < 0 or m.top_logprobs_num > limits.max_top_logprobs:
        raise InvalidRequestError(
            f"top_logprobs_num must be in [0, {limits.max_top_logprobs}], got {m.top_logprobs_num}"
        )
    if len(m.token_ids_logprob) > limits.max_token_ids_logprob:
        raise InvalidRequestError(
            f"token_ids_logprob may name at most {limits.max_token_ids_logprob} tokens, "
            f"got {len(m.token_ids_logprob)}"
        )
    bad = [t for t in m.token_ids_logprob if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token_ids_logprob has token ids outside the vocabulary [0, {limits.vocab_size}): "
            f"{bad[:5]}"
        )
    lp = LogprobOptions(
        return_logprob=m.return_logprob,
        logprob_start_len=m.logprob_start_len if m.return_logprob else -1,
        top_logprobs_num=m.top_logprobs_num,
        token_ids_logprob=tuple(m.token_ids_logprob),
    )
    rid = m.request_id or uuid.uuid4().hex
    rids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
    # n > 1: the first sample prefills the shared prompt; the others wait for
    # that prefill to be planned and read the prompt's KV from the cache. The
    # prompt's logprobs are the same for every sample: only the first computes
    # them (a sample that wants them cannot read those positions from the
    # cache), and the servicer hands them to its siblings.
    sibling_lp = dataclasses.replace(lp, logprob_start_len=-1)
    bootstraps = sample_bootstraps(m, n)
    priority = custom_params.priority(m.sampling_params.custom_params)
    routing_key = custom_params.routing_key(m.sampling_params.custom_params)
    speculative = custom_params.speculative(m.sampling_params.custom_params)
    samples = [
        Submission(
            r,
            ids,
            sp,
            sibling_lp if i else lp,
            priority=priority,
            adapter=adapter,
            routing_key=routing_key,
            speculative=speculative,
            waits_for=rids[0] if i else None,
            bootstrap=bootstraps[i] if bootstraps else None,
        )
        for i, r in enumerate(rids)
    ]
    samples[0].validate(limits.vocab_size, limits.context_len)  # the samples differ in rid only
    interval = (
        m.sampling_params.stream_interval if m.sampling_params.HasField("stream_interval") else 1
    )
    if interval > limits.max_stream_interval:
        raise InvalidRequestError(
            f"stream_interval must be at most {limits.max_stream_interval}, got {interval}"
        )
    return GenerateCall(rid, m.stream, samples, len(ids), lp, max(interval, 1), adapter)


# Sample i > 0 of a disaggregated call takes room + i * ROOM_STRIDE: the
# gateway draws rooms below 2**31, so derived rooms meet no other call's,
# and both units derive the same ones.
ROOM_STRIDE = 1 << 31


def sample_bootstraps(m: pb.GenerateRequest, n: int) -> list[Bootstrap]:
    """The bootstrap (prefill unit's host, port, room) of each of a call's
    ``n`` samples; none when the call is not disaggregated."""
    if not m.HasField("disaggregated_params") or not m.disaggregated_params.ByteSize():
        return []
    d = m.disaggregated_params
    if not d.bootstrap_host or not 0 < d.bootstrap_port < 65536:
        raise InvalidRequestError(
            "disaggregated_params: bootstrap_host and a bootstrap_port in [1, 65535] are needed, "
            f"got {d.bootstrap_host!r}:{d.bootstrap_port}"
        )
    if d.bootstrap_room < 0:
        raise InvalidRequestError(
            f"disaggregated_params: bootstrap_room must be >= 0, got {d.bootstrap_room}"
        )
    return [
        Bootstrap(d.bootstrap_host, d.bootstrap_port, d.bootstrap_room + i * ROOM_STRIDE)
        for i in range(n)
    ]


def _refuse_unsupported(m: pb.GenerateRequest) -> None:
    """Fields radixserve would otherwise ignore without a word."""
    if m.custom_logit_processor:
        raise InvalidRequestError(
            "custom_logit_processor: serialized logit processors (code) are not accepted"
        )
    if m.data_parallel_rank not in (0, -1):
        raise InvalidRequestError(
            f"data_parallel_rank: this scheduler has one data-parallel rank (0), "
            f"got {m.data_parallel_rank}"
        )
    if m.HasField("timestamp"):
        # SGLang's servicer never reads it and no client we know sends it (the
        # SMG gateway does not); a client that does expects some use of it.
        raise InvalidRequestError(
            "timestamp: radixserve does not read a client timestamp (arrival is "
            "timed on receipt); leave it unset"
        )


def check_input_ids(ids: list[int], limits: Limits, *, noun: str) -> None:
    """Ids within the vocabulary and shorter than the context (Generate's
    prompt, Embed's input)."""
    bad = [t for t in ids if t >= limits.vocab_size]
    if bad:
        raise InvalidRequestError(
            f"input token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}"
        )
    if len(ids) >= limits.context_len:
        raise InvalidRequestError(
            f"the {noun} has {len(ids)} tokens, the model's context is {limits.context_len}"
        )
