"""EmbedRequest -> one prefill-only Submission (SGLang's servicer's
``_convert_embed_request``: max_new_tokens 0, the prompt's vector back).

The request cannot choose the pooling (the public proto has no field for
it): the model's does (``pooling_of``, from the worker's GetInfo).
``sampling_params`` is the proto's "dummy for compatibility": SGLang reads
nothing of it for an embedding, and neither do we. Fields we cannot honour
are refused by name. A sequence classifier's vector is its score head's
logits (SGLang's ``score_and_pool``); a rerank request (``is_cross_encoder``,
``texts``: rerank.py) needs one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from scheduler_service.api.convert.public import Limits, check_input_ids
from scheduler_service.api.convert.rerank import ScoringHead, pair_ids
from scheduler_service.core.embedding import EmbedOptions
from scheduler_service.core.intake import Submission
from scheduler_service.core.sampling import InvalidRequestError, SamplingParams


def pooling_of(worker_info: dict) -> EmbedOptions:
    """The model's pooling as the worker reports it (GetInfo's ModelInfo, as a dict)."""
    model = worker_info.get("model", {})
    pooling = "mean" if model.get("pooling") == "POOLING_MEAN" else "last"
    return EmbedOptions(pooling, bool(model.get("normalize", False)))


def embed_submission(
    m: pb.EmbedRequest,
    limits: Limits,
    encode: Callable[[str], list[int]],
    *,
    has_tokenizer: bool,
    options: EmbedOptions,
    architecture: str,
    scoring: ScoringHead | None = None,
    encode_pair: Callable[[str, str], list[int]] | None = None,
) -> Submission:
    """``scoring``: the model's score head (None: a causal LM); ``encode_pair``
    tokenizes a rerank request's [query, document]."""
    if m.texts and not m.is_cross_encoder:
        raise InvalidRequestError(
            "texts: the query/document pair of a rerank request, which sets is_cross_encoder"
        )
    if m.is_cross_encoder and scoring is None:
        raise InvalidRequestError(
            "is_cross_encoder: rerank scores a query/document pair with a "
            f"sequence-classification head, and the served model ({architecture}) has none "
            "(serve a *ForSequenceClassification checkpoint to rerank)"
        )
    if m.HasField("mm_inputs") and m.mm_inputs.ByteSize():
        raise InvalidRequestError("multimodal inputs are not supported by radixserve")
    if m.data_parallel_rank not in (0, -1):
        raise InvalidRequestError(
            f"data_parallel_rank: this scheduler has one data-parallel rank (0), "
            f"got {m.data_parallel_rank}"
        )
    if any(m.token_type_ids):
        raise InvalidRequestError(
            "token_type_ids: the served model has no token types (segment embeddings); "
            "only all-zero ids are accepted"
        )
    ids = list(m.tokenized.input_ids)
    if m.is_cross_encoder:
        ids = pair_ids(m, encode_pair, has_tokenizer=has_tokenizer) or ids
    if not ids and m.tokenized.original_text:
        if not has_tokenizer:
            raise InvalidRequestError("original_text needs a tokenizer, and this model has none")
        ids = encode(m.tokenized.original_text)
    if not ids:
        raise InvalidRequestError(
            "the input is empty: give tokenized.input_ids or original_text "
            "(a rerank request: or texts)"
        )
    if m.token_type_ids and len(m.token_type_ids) != len(ids):
        raise InvalidRequestError(
            f"token_type_ids has {len(m.token_type_ids)} entries for {len(ids)} input tokens"
        )
    check_input_ids(ids, limits, noun="input")
    sub = Submission(
        m.request_id or uuid.uuid4().hex, ids, SamplingParams(max_new_tokens=0), embed=options
    )
    sub.validate(limits.vocab_size, limits.context_len)
    return sub
