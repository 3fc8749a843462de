"""What the client makes of GenerateResponses: text, tokens, finish reasons."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from clients.detokenizer import IncrementalDetokenizer, trim_stop
from clients.tokenizer_bundle import TokenizerBundle


@dataclass
class Sampling:
    """Generation parameters (SGLang's meanings; temperature 0 is greedy)."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    # Structured generation: at most one of these (a JSON schema as text or a dict).
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict | None = None
    # Sent in custom_params (the public proto has no field for them): the
    # request's priority (used with --enable-priority-scheduling) and its
    # routing key (used by --schedule-policy routing-key). None: not sent.
    priority: int | None = None
    routing_key: str | None = None
    # False turns speculative decoding off for this request (None: the
    # server's --speculative-ngram decides).
    speculative: bool | None = None
    # The sampling seed (custom_params seed): the same seed and prompt give
    # the same tokens. None: the server draws from its own generator.
    seed: int | None = None

    def to_proto(self, m: pb.SamplingParams) -> None:
        m.temperature = self.temperature
        m.top_p = self.top_p
        m.top_k = self.top_k
        m.min_p = self.min_p
        m.frequency_penalty = self.frequency_penalty
        m.presence_penalty = self.presence_penalty
        m.repetition_penalty = self.repetition_penalty
        if self.max_new_tokens is not None:
            m.max_new_tokens = self.max_new_tokens
        m.stop.extend(self.stop)
        m.stop_token_ids.extend(self.stop_token_ids)
        m.ignore_eos = self.ignore_eos
        m.min_new_tokens = self.min_new_tokens
        m.skip_special_tokens = self.skip_special_tokens
        m.spaces_between_special_tokens = True
        m.no_stop_trim = self.no_stop_trim
        m.n = self.n
        constraints = {
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf_grammar": self.ebnf,
            "structural_tag": self.structural_tag,
        }
        given = {k: v for k, v in constraints.items() if v is not None}
        if len(given) > 1:
            raise ValueError(f"one constraint at most, got {sorted(given)}")
        for field_name, value in given.items():
            setattr(m, field_name, value if isinstance(value, str) else json.dumps(value))
        custom = {
            "seed": self.seed,
            "priority": self.priority,
            "routing_key": self.routing_key,
            "speculative": self.speculative,
        }
        custom = {k: v for k, v in custom.items() if v is not None}
        if custom:
            m.custom_params.update(custom)


@dataclass
class StreamEvent:
    index: int
    text: str  # new text, final (held back while it could be a stop string's start)
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last event of a sample
    matched_stop: int | str | None = None
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    matched_stop: int | str | None
    logprobs: list[float]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class GenerateResult:
    choices: list[Choice]

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason


class _Sample:
    def __init__(self, bundle: TokenizerBundle, prompt: list[int], sp: Sampling) -> None:
        self.detok = IncrementalDetokenizer(bundle.tokenizer, sp.skip_special_tokens, prompt)
        # Text that may still turn out to be (the start of) a stop string is
        # held back until the next tokens or the finish tell.
        self.stops = [] if sp.no_stop_trim else list(sp.stop)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sp = sp
        self.emitted = 0  # characters of detok.text already handed out
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.done: Choice | None = None

    def feed(self, ids: list[int]) -> str:
        self.token_ids.extend(ids)
        self.detok.add(ids)
        text = self.detok.text
        upto = len(text) - self.hold
        for stop in self.stops:
            at = text.find(stop, max(self.emitted - len(stop) + 1, 0))
            if at >= 0:
                upto = min(upto, at)
        upto = max(upto, self.emitted)
        out = text[self.emitted : upto]
        self.emitted = upto
        return out

    def final_text(self, matched: str | None) -> str:
        return trim_stop(self.detok.text, matched, self.sp.no_stop_trim)


class Transcriber:
    """Turns a Generate call's responses into stream events and a result."""

    def __init__(self, bundle: TokenizerBundle, prompt: list[int], sp: Sampling) -> None:
        self.samples = {i: _Sample(bundle, prompt, sp) for i in range(max(sp.n, 1))}
        self.streamed = False

    def take(self, resp: pb.GenerateResponse) -> list[StreamEvent]:
        if resp.HasField("chunk"):
            self.streamed = True
            c = resp.chunk
            s = self.samples[c.index]
            s.logprobs.extend(c.output_logprobs.token_logprobs)
            return [
                StreamEvent(
                    c.index,
                    s.feed(list(c.token_ids)),
                    list(c.token_ids),
                    logprobs=list(c.output_logprobs.token_logprobs),
                )
            ]
        c = resp.complete
        s = self.samples[c.index]
        if not self.streamed:  # the complete carries every token
            s.feed(list(c.output_ids))
            s.logprobs = list(c.output_logprobs.token_logprobs)
        which = c.WhichOneof("matched_stop")
        matched = getattr(c, which) if which else None
        text = s.final_text(matched if isinstance(matched, str) else None)
        tail = text[s.emitted :]
        s.emitted = len(text)
        s.done = Choice(
            c.index,
            text,
            s.token_ids,
            c.finish_reason,
            matched,
            s.logprobs,
            c.prompt_tokens,
            c.completion_tokens,
            c.cached_tokens,
        )
        return [StreamEvent(c.index, tail, [], c.finish_reason, matched)]

    def result(self) -> GenerateResult:
        missing = [i for i, s in self.samples.items() if s.done is None]
        if missing:
            raise RuntimeError(f"the server ended the call before samples {missing} finished")
        return GenerateResult([self.samples[i].done for i in sorted(self.samples)])
