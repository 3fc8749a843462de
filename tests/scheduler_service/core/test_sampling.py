from __future__ import annotations

import pytest

from scheduler_service.core.sampling import (
    TOP_K_ALL,
    InvalidRequestError,
    LogprobOptions,
    SamplingParams,
)


def test_defaults_are_sglangs():
    sp = SamplingParams()
    assert (sp.max_new_tokens, sp.min_new_tokens) == (128, 0)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1.0, 1.0, -1, 0.0)
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not sp.ignore_eos and not sp.no_stop_trim
    assert sp.skip_special_tokens and sp.spaces_between_special_tokens
    assert sp.stop_strs == () and sp.stop_token_ids == frozenset()
    assert sp.effective_top_k == TOP_K_ALL and not sp.is_greedy


def test_zero_temperature_or_top_k_one_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.0).effective_top_k == 1
    assert SamplingParams(top_k=1).is_greedy
    assert SamplingParams(top_k=5).effective_top_k == 5


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop_strs": ("",)}, "stop strings"),
    ],
)
def test_out_of_range_parameters_are_named(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs).validate()


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(stop_token_ids=frozenset({9})).validate(vocab_size=10)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=frozenset({10})).validate(vocab_size=10)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((-1, 2.0),)).validate(vocab_size=10)


def test_logprob_options_validate_against_the_prompt():
    LogprobOptions(return_logprob=True, logprob_start_len=3).validate(prompt_len=4)
    with pytest.raises(InvalidRequestError, match="logprob_start_len"):
        LogprobOptions(return_logprob=True, logprob_start_len=4).validate(prompt_len=4)
    with pytest.raises(InvalidRequestError, match="top_logprobs_num"):
        LogprobOptions(top_logprobs_num=-1).validate(prompt_len=4)
    assert LogprobOptions(return_logprob=True, logprob_start_len=0).wants_prompt_logprobs
    assert not LogprobOptions(return_logprob=False, logprob_start_len=0).wants_prompt_logprobs
