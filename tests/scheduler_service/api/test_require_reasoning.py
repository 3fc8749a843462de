"""require_reasoning through the public API (in process, the core a PipeCore):
accepted for a model whose vocabulary has the end-of-reasoning token, which
then rides on the request's sampling to the core (the worker defers the
grammar until it: tests/worker_service/test_grammar_reasoning.py); refused by
name for a model without it; and reasoning_tokens counts the output up to and
including that token's first occurrence, in every chunk and the complete, as
SGLang's scheduler counts them."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from common import tokenizer_archive
from scheduler_service import ipc
from scheduler_service.api.model_info import reasoning_end_token
from tests.scheduler_service.api.support.api_in_process import api_in_process, generate_request
from tests.scheduler_service.api.support.pipe_core import finish, ready, tokens

WORDS = ["[UNK]", "a", "b", "c", "<think>", "</think>", "{", "}", "<end>"]
END = WORDS.index("</think>")


def tokenizer() -> Tokenizer:
    t = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    t.pre_tokenizer = Whitespace()
    return t


def ready_with_tokenizer() -> ipc.Ready:
    archive = tokenizer_archive.pack({"tokenizer.json": tokenizer().to_str().encode()})
    return dataclasses.replace(ready(vocab_size=100), tokenizer_zip=archive)


def test_the_end_of_reasoning_token_is_looked_up_in_the_vocabulary():
    t = tokenizer()
    assert reasoning_end_token(t, "</think>", 100) == END
    assert reasoning_end_token(t, "<end>", 100) == WORDS.index("<end>")  # --think-end-token
    assert reasoning_end_token(t, "<|end_think|>", 100) is None  # not one token of it
    assert reasoning_end_token(t, "", 100) is None  # set empty: no reasoning models
    assert reasoning_end_token(t, "<end>", WORDS.index("<end>")) is None  # past the model's
    assert reasoning_end_token(None, "</think>", 100) is None  # no tokenizer


def _reasoning(request: pb.GenerateRequest) -> pb.GenerateRequest:
    request.require_reasoning = True
    return request


@pytest.mark.parametrize("require", [True, False])
def test_reasoning_tokens_count_up_to_the_end_of_reasoning_token(require):
    async def run() -> list[pb.GenerateResponse]:
        async with api_in_process(first_ready=ready_with_tokenizer()) as api:
            request = generate_request("r", max_new=8)
            request.require_reasoning = require
            call = api.stub.Generate(request)
            (s,) = await api.submitted()
            assert s.reasoning_end_token == (END if require else None)
            responses = []
            for token in (1, 2, END, 6, END):  # a second END is answer text
                api.core.say(tokens((s.rid, token)))
                responses.append(await call.read())  # a chunk per token
            api.core.say(finish(s.rid, 7, "stop"))
            while (r := await call.read()) is not grpc.aio.EOF:
                responses.append(r)
            return responses

    responses = asyncio.run(run())
    chunks = [r.chunk.reasoning_tokens for r in responses if r.HasField("chunk")]
    (complete,) = [r.complete for r in responses if r.HasField("complete")]
    if require:
        assert chunks == [1, 2, 3, 3, 3, 3]
        assert complete.reasoning_tokens == 3
    else:
        assert chunks == [0] * 6 and complete.reasoning_tokens == 0
    assert list(complete.output_ids) == [7] and complete.completion_tokens == 6


def test_a_thought_in_one_delta_counts_to_its_end_token_only():
    """Not streamed, the whole output in one delta (a drafted step's tokens
    arrive together too): the count stops at the first end token."""

    async def run() -> pb.GenerateResponse:
        async with api_in_process(first_ready=ready_with_tokenizer()) as api:
            call = api.stub.Generate(_reasoning(generate_request("r", max_new=8, stream=False)))
            (s,) = await api.submitted()
            api.core.say(tokens((s.rid, 1)))
            api.core.say(
                ipc.Outputs(
                    deltas=[ipc.DeltaOut(s.rid, [2, END, 6, 7], finish=ipc.Finish("stop"))],
                    load=tokens().load,
                )
            )
            (response,) = [r async for r in call]
            return response

    response = asyncio.run(run())
    assert list(response.complete.output_ids) == [1, 2, END, 6, 7]
    assert response.complete.reasoning_tokens == 3


def test_a_model_without_the_token_refuses_require_reasoning_by_name():
    async def run() -> None:
        async with api_in_process() as api:  # no tokenizer: no </think>
            call = api.stub.Generate(_reasoning(generate_request("r")))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == (
                "require_reasoning: this model's vocabulary has no end-of-reasoning token "
                "(--think-end-token names it)"
            )

    asyncio.run(run())


@pytest.mark.parametrize(
    ("with_token", "start"), [(True, "after_reasoning"), (False, "first_token")]
)
def test_server_info_tells_the_gateway_where_a_reasoning_grammar_starts(with_token, start):
    """smg reads ``constrained_decoding_start`` from server_args (SGLang's
    servicer's label) to shape a forced tool call's grammar."""

    async def run() -> dict:
        first = ready_with_tokenizer() if with_token else None
        async with api_in_process(first_ready=first) as api:
            info = await api.stub.GetServerInfo(pb.GetServerInfoRequest())
            return dict(info.server_args)

    args = asyncio.run(run())
    assert args["constrained_decoding_start"] == start
    assert args["think_end_token"] == "</think>"
