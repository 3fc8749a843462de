"""Python client of radixserve's public API (sglang.grpc.scheduler), sync and asyncio.

Text goes in, streamed text and tokens come out: the client fetches the
model's tokenizer once (GetTokenizer), tokenizes prompts, applies the chat
template to messages, and detokenizes streamed tokens incrementally.

    client = RadixClient("127.0.0.1:30000")
    print(client.generate("The capital of France is", max_new_tokens=8).text)
    for event in client.chat([{"role": "user", "content": "Hi"}], stream=True):
        print(event.text, end="", flush=True)
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.results import GenerateResult, Sampling, StreamEvent, Transcriber
from clients.tokenizer_bundle import TokenizerBundle

Prompt = str | list[int]


def build_request(
    bundle: TokenizerBundle | None,
    prompt: Prompt,
    sampling: Sampling,
    stream: bool,
    request_id: str | None,
) -> pb.GenerateRequest:
    ids = prompt if isinstance(prompt, list) else None
    text = prompt if isinstance(prompt, str) else ""
    if ids is None and bundle is not None:
        ids = bundle.encode(text)
    req = pb.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex,
        tokenized=pb.TokenizedInput(input_ids=ids or [], original_text=text),
        stream=stream,
        return_logprob=sampling.logprobs,
        logprob_start_len=-1,
        top_logprobs_num=sampling.top_logprobs,
    )
    sampling.to_proto(req.sampling_params)
    return req


class RadixClient:
    """Blocking client."""

    def __init__(self, address: str, timeout_s: float | None = None) -> None:
        self.channel = grpc.insecure_channel(address.removeprefix("grpc://"))
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.timeout_s = timeout_s
        self._bundle: TokenizerBundle | None = None

    @property
    def tokenizer(self) -> TokenizerBundle:
        if self._bundle is None:
            chunks = self.stub.GetTokenizer(cpb.GetTokenizerRequest(), timeout=60)
            self._bundle = TokenizerBundle.from_chunks(chunks)
        return self._bundle

    def generate(self, prompt: Prompt, request_id: str | None = None, **sampling) -> GenerateResult:
        sp = Sampling(**sampling)
        req = build_request(self.tokenizer, prompt, sp, False, request_id)
        t = Transcriber(self.tokenizer, list(req.tokenized.input_ids), sp)
        for resp in self.stub.Generate(req, timeout=self.timeout_s):
            t.take(resp)
        return t.result()

    def stream(
        self, prompt: Prompt, request_id: str | None = None, **sampling
    ) -> Iterator[StreamEvent]:
        sp = Sampling(**sampling)
        req = build_request(self.tokenizer, prompt, sp, True, request_id)
        t = Transcriber(self.tokenizer, list(req.tokenized.input_ids), sp)
        for resp in self.stub.Generate(req, timeout=self.timeout_s):
            yield from t.take(resp)

    def chat(self, messages: list[dict], stream: bool = False, **sampling):
        prompt = self.tokenizer.chat_prompt(messages)
        return self.stream(prompt, **sampling) if stream else self.generate(prompt, **sampling)

    def abort(self, request_id: str, reason: str = "") -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason)).success

    def health(self) -> bool:
        return self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).healthy

    def close(self) -> None:
        self.channel.close()


class AsyncRadixClient:
    """asyncio client (grpc.aio)."""

    def __init__(self, address: str, timeout_s: float | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"))
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.timeout_s = timeout_s
        self._bundle: TokenizerBundle | None = None

    async def tokenizer(self) -> TokenizerBundle:
        if self._bundle is None:
            chunks = [c async for c in self.stub.GetTokenizer(cpb.GetTokenizerRequest())]
            self._bundle = TokenizerBundle.from_chunks(chunks)
        return self._bundle

    async def generate(
        self, prompt: Prompt, request_id: str | None = None, **sampling
    ) -> GenerateResult:
        bundle = await self.tokenizer()
        sp = Sampling(**sampling)
        req = build_request(bundle, prompt, sp, False, request_id)
        t = Transcriber(bundle, list(req.tokenized.input_ids), sp)
        async for resp in self.stub.Generate(req, timeout=self.timeout_s):
            t.take(resp)
        return t.result()

    async def stream(
        self, prompt: Prompt, request_id: str | None = None, **sampling
    ) -> AsyncIterator[StreamEvent]:
        bundle = await self.tokenizer()
        sp = Sampling(**sampling)
        req = build_request(bundle, prompt, sp, True, request_id)
        t = Transcriber(bundle, list(req.tokenized.input_ids), sp)
        async for resp in self.stub.Generate(req, timeout=self.timeout_s):
            for event in t.take(resp):
                yield event

    async def chat_prompt(self, messages: list[dict]) -> list[int]:
        return (await self.tokenizer()).chat_prompt(messages)

    async def abort(self, request_id: str, reason: str = "") -> bool:
        resp = await self.stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason))
        return resp.success

    async def close(self) -> None:
        await self.channel.close()
