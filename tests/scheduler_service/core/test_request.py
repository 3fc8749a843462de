from __future__ import annotations

import pytest

from scheduler_service.core.request import (
    FinishAbort,
    FinishLength,
    FinishStop,
    Request,
)
from scheduler_service.core.sampling import InvalidRequestError, LogprobOptions, SamplingParams


def test_finish_invalidates_in_flight_results():
    req = Request("a", [1])
    req.pending, epoch = 1, req.epoch
    req.finish(FinishAbort("x"), now=0.0)
    assert req.epoch != epoch and req.pending == 0 and req.times.finished == 0.0


def test_finish_reason_kinds():
    assert FinishStop("###").kind == "stop"
    assert FinishLength(3).kind == "length"
    assert FinishAbort("m").kind == "abort"


def test_max_prefix_len_leaves_a_token_and_prompt_logprob_positions():
    req = Request("a", list(range(10)))
    assert req.max_prefix_len() == 9
    req.output_ids = [1, 2]
    assert req.max_prefix_len() == 11
    lp = Request(
        "b", list(range(10)), logprobs=LogprobOptions(return_logprob=True, logprob_start_len=4)
    )
    assert lp.max_prefix_len() == 3  # token 4 is scored by the logits at position 3
    lp.prompt_logprobs_pending = False
    assert lp.max_prefix_len() == 9


def test_validation_messages():
    with pytest.raises(InvalidRequestError, match="empty"):
        Request("a", []).validate()
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        Request("a", [1, 50]).validate(vocab_size=50)
    with pytest.raises(InvalidRequestError, match="context"):
        Request("a", [1] * 10).validate(context_len=10)
    with pytest.raises(InvalidRequestError, match="exceeds the context length"):
        Request("a", [1] * 8, SamplingParams(max_new_tokens=3)).validate(context_len=10)
    Request("a", [1] * 8, SamplingParams(max_new_tokens=2)).validate(context_len=10)
