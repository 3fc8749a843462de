"""lora_id reaches GenerateRequest.lora_id from the Python clients (sync and
asyncio, generate, stream and chat) and from `radixserve-client --lora-id`,
checked on a fake scheduler servicer on a loopback gRPC server that records
the requests."""

from __future__ import annotations

import asyncio
import json
from concurrent import futures

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc
from tokenizers import Tokenizer, models, pre_tokenizers

from clients import cli
from clients.client import AsyncRadixClient, RadixClient
from common import tokenizer_archive

VOCAB = {"[UNK]": 0, "hello": 1, "world": 2, "user": 3, ":": 4}


def _tokenizer_archive() -> bytes:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
    config = {"chat_template": template}
    return tokenizer_archive.pack(
        {
            "tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": json.dumps(config).encode(),
        }
    )


class FakeScheduler(pb_grpc.SglangSchedulerServicer):
    """Serves a word-level tokenizer and answers every Generate with "world"."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.archive = _tokenizer_archive()

    def GetTokenizer(self, request, context):
        for data, digest in tokenizer_archive.chunks(self.archive, 64):
            yield cpb.GetTokenizerChunk(data=data, sha256=digest)

    def Generate(self, request, context):
        self.requests.append(request)
        n = len(request.tokenized.input_ids)
        if request.stream:
            yield pb.GenerateResponse(
                request_id=request.request_id,
                chunk=pb.GenerateStreamChunk(token_ids=[2], prompt_tokens=n, completion_tokens=1),
            )
        yield pb.GenerateResponse(
            request_id=request.request_id,
            complete=pb.GenerateComplete(
                output_ids=[2], finish_reason="stop", prompt_tokens=n, completion_tokens=1
            ),
        )


@pytest.fixture
def fake():
    servicer = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_SglangSchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def test_sync_client_sends_lora_id(fake):
    address, servicer = fake
    client = RadixClient(address)
    assert client.generate("hello", lora_id="sql", max_new_tokens=4).text.strip() == "world"
    assert "".join(e.text for e in client.stream("hello", lora_id="sql-v2")).strip() == "world"
    client.chat([{"role": "user", "content": "hello"}], lora_id="chat.v1")
    list(client.chat([{"role": "user", "content": "hello"}], stream=True, lora_id="chat.v1"))
    client.generate([1, 2], lora_id="ids")  # token-id prompts too
    client.generate("hello")  # none: the base model
    client.close()
    assert [r.lora_id for r in servicer.requests] == [
        "sql",
        "sql-v2",
        "chat.v1",
        "chat.v1",
        "ids",
        "",
    ]
    # The rest of the request is as before: the prompt and the sampling.
    first = servicer.requests[0]
    assert list(first.tokenized.input_ids) == [1] and first.sampling_params.max_new_tokens == 4


def test_async_client_sends_lora_id(fake):
    address, servicer = fake

    async def run():
        client = AsyncRadixClient(address)
        result = await client.generate("hello", lora_id="sql")
        events = [e async for e in client.stream("hello world", lora_id="sql")]
        plain = await client.generate("hello")
        await client.close()
        return result, events, plain

    result, events, _ = asyncio.run(run())
    assert result.text.strip() == "world"
    assert "".join(e.text for e in events).strip() == "world"
    assert [r.lora_id for r in servicer.requests] == ["sql", "sql", ""]
    assert [r.stream for r in servicer.requests] == [False, True, False]


@pytest.mark.parametrize("stream", [False, True])
def test_cli_lora_id_flag(fake, capsys, stream):
    address, servicer = fake
    args = ["--server", address, "generate", "hello", "--lora-id", "sql"]
    assert cli.main(args + (["--stream"] if stream else [])) == 0
    if not stream:  # (the streamed text goes to the sys.stdout of import time)
        assert capsys.readouterr().out.strip() == "world"
    assert cli.main(["--server", address, "chat", "hello", "--lora-id", "chat.v1"]) == 0
    assert cli.main(["--server", address, "generate", "hello"]) == 0
    assert [r.lora_id for r in servicer.requests] == ["sql", "chat.v1", ""]
    assert cli.build_parser().parse_args(["generate", "x"]).lora_id is None
