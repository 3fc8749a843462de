"""How the benchmark talks to a server: our gRPC client, or an OpenAI API
(the SMG gateway's /v1/completions). A driver sends one request and fills in
its RequestRecord: the time of every output token, the ids when it sees
them, and the prompt tokens the server served from its cache."""

from __future__ import annotations

import json
import time
from typing import Protocol

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from clients.bench.records import BenchRequest, RequestRecord
from clients.bench.sampling import SamplingMode
from clients.bench.workloads import WorkloadError
from clients.client import AsyncRadixClient, build_request
from clients.results import Sampling
from clients.tokenizer_bundle import TokenizerBundle


class Driver(Protocol):
    name: str

    async def vocab_size(self) -> int | None: ...

    async def tokenizer(self) -> TokenizerBundle: ...

    async def send(self, req: BenchRequest, record: RequestRecord, t0: float) -> None: ...

    async def close(self) -> None: ...


def _sampling(req: BenchRequest, mode: SamplingMode, speculative: bool | None) -> Sampling:
    """At most ``output_len`` tokens (exactly, with EOS ignored), greedy or
    sampled with the request's seed."""
    return Sampling(
        max_new_tokens=req.output_len,
        temperature=mode.temperature,
        top_p=mode.top_p,
        top_k=mode.top_k,
        ignore_eos=mode.ignore_eos,
        speculative=speculative,
        seed=req.seed,
    )


def openai_body(req: BenchRequest, mode: SamplingMode, model: str | None, prompt: str) -> dict:
    """A streamed /v1/completions request with the run's sampling (vLLM and
    the SMG gateway read ``seed``, ``top_k`` and ``ignore_eos`` beside
    OpenAI's fields)."""
    body: dict = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_len,
        "temperature": mode.temperature,
        "top_p": mode.top_p,
        "ignore_eos": mode.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if mode.top_k > 0:
        body["top_k"] = mode.top_k
    if req.seed is not None:
        body["seed"] = req.seed
    return body


class RadixDriver:
    """radixserve's public gRPC API through clients.client (token ids in,
    streamed token ids out; ``cached_tokens`` from the final message)."""

    name = "radixserve"

    def __init__(
        self,
        address: str,
        speculative: bool | None = None,
        sampling: SamplingMode | None = None,
        **connection,
    ) -> None:
        self.client = AsyncRadixClient(address, **connection)
        self.speculative = speculative  # False: custom_params speculative=false
        self.sampling = sampling or SamplingMode()

    async def vocab_size(self) -> int | None:
        info = await self.client.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=30, metadata=self.client.metadata
        )
        return info.vocab_size or None

    async def pool_tokens(self) -> int | None:
        """The KV pool in tokens (GetServerInfo's max_total_num_tokens; None
        from a server that does not say)."""
        try:
            info = await self.client.stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=30, metadata=self.client.metadata
            )
        except grpc.RpcError:
            return None
        return info.max_total_num_tokens or None

    async def tokenizer(self) -> TokenizerBundle:
        """The server's own (GetTokenizer): text prompts become the ids it reads."""
        try:
            return await self.client.tokenizer()
        except grpc.RpcError as e:
            raise WorkloadError(
                f"the server sends no tokenizer ({e.code().name}: {e.details()}); "
                "the text datasets need the served model's"
            ) from None

    async def flush_cache(self) -> None:
        """Empty the server's prefix cache (it must be idle), so a run does not
        read what an earlier run of the same prompts left there."""
        result = await self.client.stub.FlushCache(
            cpb.FlushCacheRequest(timeout_s=30.0), timeout=60, metadata=self.client.metadata
        )
        if not result.success:
            raise OSError(f"FlushCache failed: {result.message}")

    async def send(self, req: BenchRequest, record: RequestRecord, t0: float) -> None:
        sampling = _sampling(req, self.sampling, self.speculative)
        message = build_request(None, req.prompt_ids, sampling, True, f"bench-{req.index}")
        call = self.client.stub.Generate(message, metadata=self.client.metadata)
        async for resp in call:
            now = time.perf_counter() - t0
            if resp.HasField("chunk"):
                ids = resp.chunk.token_ids
                record.output_ids.extend(ids)
                record.token_times.extend([now] * len(ids))
            else:
                record.cached_tokens = resp.complete.cached_tokens
                record.spec_draft_tokens = resp.complete.spec_draft_tokens
                record.spec_accepted_tokens = resp.complete.spec_accepted_tokens
                record.prompt_tokens = resp.complete.prompt_tokens or record.prompt_tokens

    async def close(self) -> None:
        await self.client.close()


class OpenAIDriver:
    """An OpenAI-compatible /v1/completions endpoint (the SMG gateway), streamed.

    The SMG gateway takes text prompts only, so a text workload's prompt goes
    as its text and a token workload's ids as the text ``tokenizer`` decodes
    them to (the server re-tokenizes it: its usage block's ``prompt_tokens``
    is what is reported). Chunks carry text, not
    ids (the record keeps the text: a conversation's next turn appends it):
    each chunk with text counts as one token, and the usage block's
    ``completion_tokens`` corrects the count (extra tokens are dated at the
    last chunk)."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        tokenizer: TokenizerBundle,
        model: str | None = None,
        api_key: str | None = None,
        sampling: SamplingMode | None = None,
    ):
        import httpx  # the bench extra; only this driver needs it

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers, timeout=httpx.Timeout(None)
        )
        self.model = model
        self.local_tokenizer = tokenizer
        self.sampling = sampling or SamplingMode()

    async def vocab_size(self) -> int | None:
        if self.model is None:
            resp = await self.http.get("/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.local_tokenizer.tokenizer.get_vocab_size()

    async def tokenizer(self) -> TokenizerBundle:
        return self.local_tokenizer

    async def send(self, req: BenchRequest, record: RequestRecord, t0: float) -> None:
        # A text workload's prompt goes as its words (decoding the ids would
        # drop the chat template's special tokens); token workloads as the
        # text their ids decode to.
        text = req.prompt_text
        if text is None:
            text = self.local_tokenizer.decode(req.prompt_ids)
        body = openai_body(req, self.sampling, self.model, text)
        usage: dict | None = None
        async with self.http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("error"):
                    raise RuntimeError(str(event["error"]))
                now = time.perf_counter() - t0
                piece = "".join(c.get("text") or "" for c in event.get("choices") or ())
                if piece:
                    record.token_times.append(now)
                    record.output_text += piece
                usage = event.get("usage") or usage
        if usage:
            n = usage.get("completion_tokens") or 0
            times = record.token_times
            if times and n > len(times):
                times.extend([times[-1]] * (n - len(times)))
            elif n and n < len(times):
                del times[n:]
            record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = details.get("cached_tokens") or 0

    async def close(self) -> None:
        await self.http.aclose()
