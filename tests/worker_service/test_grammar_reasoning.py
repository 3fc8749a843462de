"""require_reasoning on the worker: a reasoning request's grammar waits for the
end-of-reasoning token (``</think>``) in its output, then applies, and a
request re-joined on a fresh worker (retraction, worker loss) replays its
output into the same phase, before or after that token.

The simulated model picks each token by a hash of the context (among the
tokens its grammar allows, when one applies), so an unconstrained token is
``expected_output``'s and a constrained one is a byte the regex allows. The
end-of-reasoning token is the one the model itself samples third: the
section ends live, with no forcing.
"""

from __future__ import annotations

import re

import pytest

from common.simulated_model import expected_output
from tests.worker_service.support.draft_driver import Decoded, DraftDriver
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, Join
from worker_service.execution.simulated_compute import SimulatedCompute
from worker_service.sampling.grammar import (
    SIMULATED_EOS,
    GrammarCompiler,
    simulated_tokenizer_info,
)
from worker_service.sampling.params import LogprobOptions, SamplingParams

VOCAB = 1024
PROMPT = [11, 12, 13, 14, 15]
REGEX = "[a-z]{4}"
THOUGHT = expected_output(PROMPT, 3, VOCAB)  # what the model says unconstrained
END = THOUGHT[2]  # so the thinking section ends on the model's third token


def runner() -> ModelRunner:
    grammars = GrammarCompiler(lambda: simulated_tokenizer_info(VOCAB))
    return ModelRunner(
        SimulatedCompute(vocab_size=VOCAB),
        num_pages=64,
        page_size=4,
        vocab_size=VOCAB,
        grammars=grammars,
    )


def sampling(end: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.0, grammar=("regex", REGEX), reasoning_end_token=end)


def run_to_end(driver: DraftDriver, seq: Decoded) -> list[bool]:
    """Decode until the grammar ends; whether each step reported its end."""
    ended = []
    while not ended or not ended[-1]:
        result = driver.run(driver.decode_plan(seq))
        driver.take(seq, result)
        ended.append(result.grammar_ended == [0])
        assert len(seq.outputs) < 20
    return ended


def rejoin(outputs: list[int], end: int | None) -> int:
    """The next token of a request re-joined on a fresh worker with
    ``outputs`` already generated: its prompt and output prefilled at once."""
    driver = DraftDriver(runner())
    seq = Decoded(0, PROMPT + outputs)
    plan = driver.new_plan()
    join = Join(0, "r0", sampling(end), LogprobOptions(), len(PROMPT), [])
    join.num_output_tokens = len(outputs)
    plan.joins.append(join)
    plan.extends.append(Extend(0, 0, seq.prompt, driver._pages_to(seq, len(seq.prompt)), True))
    (token,) = driver.run(plan).token_ids
    return token


def undisturbed() -> list[int]:
    driver = DraftDriver(runner())
    seq = driver.start(0, PROMPT, sampling(END))
    run_to_end(driver, seq)
    return seq.outputs


def test_the_grammar_applies_only_after_the_end_of_reasoning_token():
    assert END not in THOUGHT[:2] and THOUGHT[0] >= 256  # a token no regex allows
    outputs = undisturbed()
    assert outputs[:3] == THOUGHT  # thinking: what the model says, END included
    answer = outputs[3:]
    assert answer[-1] == SIMULATED_EOS
    assert re.fullmatch(REGEX, bytes(answer[:-1]).decode())


def test_without_require_reasoning_the_grammar_applies_from_the_first_token():
    driver = DraftDriver(runner())
    seq = driver.start(0, PROMPT, sampling(None))
    run_to_end(driver, seq)
    assert seq.outputs[-1] == SIMULATED_EOS
    assert re.fullmatch(REGEX, bytes(seq.outputs[:-1]).decode())


@pytest.mark.parametrize("generated", [1, 2, 3, 4, 6])
def test_a_rejoined_request_continues_exactly_in_either_phase(generated):
    """Re-joined with 1-2 tokens (still thinking), 3 (END just sampled) or
    more (inside the answer): its next token is the undisturbed run's."""
    outputs = undisturbed()
    assert rejoin(outputs[:generated], END) == outputs[generated]


def test_a_thinking_section_the_grammar_would_refuse_replays_without_error():
    """The output so far breaks the grammar (the thought is not [a-z]), so a
    replay that fed it to the grammar would fail the step."""
    outputs = undisturbed()
    with pytest.raises(AssertionError, match="breaks its grammar"):
        rejoin(outputs[:4], None)
