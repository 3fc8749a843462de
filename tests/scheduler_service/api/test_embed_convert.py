"""EmbedRequest -> Submission: the model's pooling, SGLang's prefill-only
request, and every field we cannot honour refused by name."""

from __future__ import annotations

import dataclasses

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service.api.convert.embed import embed_submission, pooling_of
from scheduler_service.api.convert.public import Limits
from scheduler_service.config import LimitsConfig
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.sampling import InvalidRequestError

LIMITS = Limits(vocab_size=100, context_len=16, **dataclasses.asdict(LimitsConfig()))
MEAN = EmbedOptions("mean", normalize=False)


def convert(m: pb.EmbedRequest, *, has_tokenizer: bool = True):
    return embed_submission(
        m,
        LIMITS,
        lambda text: [ord(c) % 100 for c in text],
        has_tokenizer=has_tokenizer,
        options=MEAN,
        architecture="LlamaForCausalLM",
    )


def test_a_request_becomes_one_prefill_only_submission_with_the_models_pooling():
    sub = convert(
        pb.EmbedRequest(
            request_id="e1",
            tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
            token_type_ids=[0, 0, 0],
            data_parallel_rank=-1,
            sampling_params=pb.SamplingParams(max_new_tokens=9, temperature=0.5),
        )
    )
    assert (sub.rid, sub.prompt_ids, sub.embed) == ("e1", [5, 6, 7], MEAN)
    assert sub.sampling.max_new_tokens == 0  # the dummy sampling_params change nothing
    text = convert(pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text="hi")))
    assert text.prompt_ids == [ord("h") % 100, ord("i") % 100] and text.rid


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.EmbedRequest(is_cross_encoder=True), "sequence-classification head"),
        (pb.EmbedRequest(is_cross_encoder=True, texts=["q", "d"]), "LlamaForCausalLM"),
        (pb.EmbedRequest(texts=["q", "d"]), "sets is_cross_encoder"),
        (pb.EmbedRequest(token_type_ids=[0, 1]), "token_type_ids"),
        (pb.EmbedRequest(data_parallel_rank=2), "data_parallel_rank"),
        (pb.EmbedRequest(mm_inputs=pb.MultimodalInputs(image_urls=["x"])), "multimodal"),
        (pb.EmbedRequest(), "the input is empty"),
        (pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1, 100])), "vocabulary"),
        (pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=list(range(16)))), "context"),
        (
            pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[1]), token_type_ids=[0, 0]),
            "2 entries for 1",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(request_, message):
    if not request_.HasField("tokenized") and "empty" not in message:
        request_.tokenized.input_ids.extend([1, 2])
    with pytest.raises(InvalidRequestError, match=message):
        convert(request_)


def test_the_pooling_comes_from_the_workers_model_info():
    mean = EmbedOptions("mean", normalize=False)
    assert pooling_of({"model": {"pooling": "POOLING_MEAN"}}) == mean
    assert pooling_of({"model": {"pooling": "POOLING_LAST", "normalize": True}}) == EmbedOptions()
    assert pooling_of({}) == EmbedOptions("last", normalize=False)  # a worker that predates it
