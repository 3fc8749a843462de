"""Python client of radixserve's public API (sglang.grpc.scheduler), sync and asyncio.

Text goes in, streamed text and tokens come out: the client fetches the
model's tokenizer once (GetTokenizer), tokenizes prompts, applies the chat
template to messages, and detokenizes streamed tokens incrementally.

    client = RadixClient("127.0.0.1:30000")
    print(client.generate("The capital of France is", max_new_tokens=8).text)
    print(client.generate("SELECT", lora_id="sql", max_new_tokens=8).text)  # a LoRA adapter
    for event in client.chat([{"role": "user", "content": "Hi"}], stream=True):
        print(event.text, end="", flush=True)
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from clients.results import GenerateResult, Sampling, StreamEvent, Transcriber
from clients.tokenizer_bundle import TokenizerBundle

Prompt = str | list[int]
Metadata = tuple[tuple[str, str], ...]


def open_channel(
    api: ModuleType,
    address: str,
    tls: bool = False,
    tls_ca: str | bytes | None = None,
    tls_server_name: str | None = None,
) -> grpc.Channel | grpc.aio.Channel:
    """A channel of ``api`` (grpc or grpc.aio): plaintext unless ``tls`` (the
    system's roots) or ``tls_ca`` (a PEM file's path or its bytes) is given."""
    target = address.removeprefix("grpc://")
    if tls_ca is None and not tls:
        return api.insecure_channel(target)
    roots = Path(tls_ca).read_bytes() if isinstance(tls_ca, str) else tls_ca
    options = []
    if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    creds = grpc.ssl_channel_credentials(root_certificates=roots)
    return api.secure_channel(target, creds, options=options)


def auth_metadata(api_key: str | None) -> Metadata | None:
    """Sent with every call rather than as call credentials, which gRPC sends
    over TLS only: a key must also work on a plaintext loopback or mesh port."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def build_request(
    bundle: TokenizerBundle | None,
    prompt: Prompt,
    sampling: Sampling,
    stream: bool,
    request_id: str | None,
    lora_id: str | None = None,
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
        # The LoRA adapter to generate with (its name on the server); none: the base model.
        lora_id=lora_id or "",
    )
    sampling.to_proto(req.sampling_params)
    return req


class _Connection:
    """What both clients hold. ``tls``/``tls_ca``/``tls_server_name``: see
    open_channel; ``api_key`` goes as ``authorization: Bearer`` on every call."""

    api: ModuleType = grpc  # grpc or grpc.aio

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        *,
        tls: bool = False,
        tls_ca: str | bytes | None = None,
        tls_server_name: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.channel = open_channel(self.api, address, tls, tls_ca, tls_server_name)
        self.metadata = auth_metadata(api_key)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.timeout_s = timeout_s
        self._bundle: TokenizerBundle | None = None


class RadixClient(_Connection):
    """Blocking client."""

    @property
    def tokenizer(self) -> TokenizerBundle:
        if self._bundle is None:
            chunks = self.stub.GetTokenizer(
                cpb.GetTokenizerRequest(), timeout=60, metadata=self.metadata
            )
            self._bundle = TokenizerBundle.from_chunks(chunks)
        return self._bundle

    def generate(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        *,
        lora_id: str | None = None,
        **sampling,
    ) -> GenerateResult:
        sp = Sampling(**sampling)
        req = build_request(self.tokenizer, prompt, sp, False, request_id, lora_id)
        t = Transcriber(self.tokenizer, list(req.tokenized.input_ids), sp)
        for resp in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
            t.take(resp)
        return t.result()

    def stream(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        *,
        lora_id: str | None = None,
        **sampling,
    ) -> Iterator[StreamEvent]:
        sp = Sampling(**sampling)
        req = build_request(self.tokenizer, prompt, sp, True, request_id, lora_id)
        t = Transcriber(self.tokenizer, list(req.tokenized.input_ids), sp)
        for resp in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
            yield from t.take(resp)

    def chat(self, messages: list[dict], stream: bool = False, **sampling):
        prompt = self.tokenizer.chat_prompt(messages)
        return self.stream(prompt, **sampling) if stream else self.generate(prompt, **sampling)

    def abort(self, request_id: str, reason: str = "") -> bool:
        req = pb.AbortRequest(request_id=request_id, reason=reason)
        return self.stub.Abort(req, metadata=self.metadata).success

    def health(self) -> bool:
        return self.stub.HealthCheck(
            pb.HealthCheckRequest(), timeout=30, metadata=self.metadata
        ).healthy

    def close(self) -> None:
        self.channel.close()


class AsyncRadixClient(_Connection):
    """asyncio client (grpc.aio); the same options as RadixClient."""

    api = grpc.aio

    async def tokenizer(self) -> TokenizerBundle:
        if self._bundle is None:
            chunks = [
                c
                async for c in self.stub.GetTokenizer(
                    cpb.GetTokenizerRequest(), metadata=self.metadata
                )
            ]
            self._bundle = TokenizerBundle.from_chunks(chunks)
        return self._bundle

    async def generate(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        *,
        lora_id: str | None = None,
        **sampling,
    ) -> GenerateResult:
        bundle = await self.tokenizer()
        sp = Sampling(**sampling)
        req = build_request(bundle, prompt, sp, False, request_id, lora_id)
        t = Transcriber(bundle, list(req.tokenized.input_ids), sp)
        async for resp in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
            t.take(resp)
        return t.result()

    async def stream(
        self,
        prompt: Prompt,
        request_id: str | None = None,
        *,
        lora_id: str | None = None,
        **sampling,
    ) -> AsyncIterator[StreamEvent]:
        bundle = await self.tokenizer()
        sp = Sampling(**sampling)
        req = build_request(bundle, prompt, sp, True, request_id, lora_id)
        t = Transcriber(bundle, list(req.tokenized.input_ids), sp)
        async for resp in self.stub.Generate(req, timeout=self.timeout_s, metadata=self.metadata):
            for event in t.take(resp):
                yield event

    async def chat_prompt(self, messages: list[dict]) -> list[int]:
        return (await self.tokenizer()).chat_prompt(messages)

    async def abort(self, request_id: str, reason: str = "") -> bool:
        req = pb.AbortRequest(request_id=request_id, reason=reason)
        resp = await self.stub.Abort(req, metadata=self.metadata)
        return resp.success

    async def close(self) -> None:
        await self.channel.close()
