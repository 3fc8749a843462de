"""Stop strings in the core: SGLang's rules (no min_new_tokens gate; the
text held back while it may still become a stop string) over the simulated
model and its toy text ("<t>" per token)."""

from __future__ import annotations

from scheduler_service.core import (
    FinishLength,
    FinishStop,
    Request,
    SamplingParams,
    SchedulerConfig,
    StopCheck,
    check_stop_text,
)
from scheduler_service.core.stop_check import ends_with_prefix
from scheduler_service.testing.simulated_worker import expected_output
from tests.scheduler_service.core.support.sim_driver import make_pair, toy_stop_strings

V = 64
PROMPT = list(range(1, 6))


def _req(rid: str, **sampling) -> Request:
    return Request(rid, PROMPT, SamplingParams(**sampling))


def _run(r: Request) -> list[tuple[list[int], bool, bool]]:
    """(tokens, holding, finished) of each delta the request got."""
    sched, worker = make_pair(SchedulerConfig(vocab_size=V), 64, V, stop_strings=toy_stop_strings)
    sched.add_request(r)
    seen = []
    while not sched.is_idle():
        plan = sched.step()
        if plan is not None:
            sched.update(worker.execute(plan))
        seen += [(d.new_token_ids, d.holding, d.finished) for d in sched.drain()]
    return seen


def test_text_rule() -> None:
    assert check_stop_text("hello world", ("wor",)) == StopCheck("wor", False)
    assert check_stop_text("hello wo", ("world",)) == StopCheck(None, True)
    assert check_stop_text("hello w", ("xyz", "world")) == StopCheck(None, True)
    assert check_stop_text("hello", ("world",)) == StopCheck(None, False)
    # a match wins over an earlier stop string's partial one
    assert check_stop_text("a<|im", ("<|im_end|>", "a<")) == StopCheck("a<", False)
    # the prefix must reach the end of the text; repeated first characters
    assert ends_with_prefix("xx<<", "<<a") and ends_with_prefix("x<<<", "<<<<")
    assert not ends_with_prefix("<|im_start|> ", "<|im_end|>")
    assert not ends_with_prefix("", "abc")


def test_a_stop_string_ends_the_request_before_min_new_tokens() -> None:
    """SGLang masks only EOS and stop ids before min_new_tokens; a stop
    string counts from the first token."""
    exp = expected_output(PROMPT, 20, V)
    stop = f"<{exp[1]}>"
    r = _req("r", max_new_tokens=20, min_new_tokens=10, stop_strs=(stop,))
    _run(r)
    assert r.finish_reason == FinishStop(stop)
    assert r.output_ids == exp[: exp.index(exp[1]) + 1]


def test_deltas_say_when_the_text_may_become_a_stop_string() -> None:
    """A stop string that never completes (token 999 is outside the
    vocabulary): each time the text ends with its start the delta holds."""
    exp = expected_output(PROMPT, 12, V)
    first = exp[2]
    r = _req("r", max_new_tokens=12, stop_strs=(f"<{first}><999>",))
    seen = _run(r)
    tokens = [t for ids, _, _ in seen for t in ids]
    assert tokens == exp and r.finish_reason == FinishLength(12)
    holding = [held for ids, held, _ in seen for _ in ids]
    assert holding == [t == first for t in exp]
    assert any(holding) and not all(holding)
