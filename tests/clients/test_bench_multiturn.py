"""radixserve-bench's multi-turn chat workload without a server process:
conversation construction (turn t's prompt is the previous prompt, the
answer and the next question, exactly), the closed loop per conversation
with its think time, determinism under a seed, the working set and the
run's figures; then on the wire against the recording gRPC and OpenAI
servers (tests/clients/support/bench_peers.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import pytest

from clients.bench import cli
from clients.bench.conversation_runner import NO_ANSWER, NOT_SENT, ThinkTime, run_conversations
from clients.bench.conversations import (
    ChatFormat,
    Conversation,
    distinct_prefix_tokens,
    plan_conversations,
    planned_working_set,
)
from clients.bench.flags import build_parser, check_args
from clients.bench.metrics import summarize
from clients.bench.prose import default_paragraphs
from clients.bench.text_workloads import QUESTIONS
from tests.clients.support.bench_peers import (
    OUTPUT,
    recording_openai,
    recording_scheduler,
    small_tokenizer,
)

TOK = small_tokenizer()
EOS = TOK.tokenizer.token_to_id("<|im_end|>")


def plans(n: int = 3, turns: int = 4, seed: int = 5, **kw):
    args = dict(question_len=60, output_len=8, system_prompt_len=80) | kw
    return plan_conversations(
        TOK, default_paragraphs(), conversations=n, turns=turns, seed=seed, **args
    )


def test_plans_use_real_text_fit_their_budget_and_follow_the_seed():
    ps = plans(4, 3)
    assert [p.index for p in ps] == [0, 1, 2, 3]
    assert len({p.system for p in ps}) == 1 and ps[0].system.startswith("You are a helpful")
    for p in ps:
        assert len(p.questions) == 3 and p.output_len == 8
        for q in p.questions:
            assert q.rpartition("\n\n")[2] in QUESTIONS
            assert len(TOK.encode(q)) <= 60
            assert len(q.split()) >= 5  # prose, not a stub
    assert plans(4, 3) == ps
    assert plans(4, 3, seed=6) != ps
    unique = plans(4, 3, unique_system_prompts=True)
    assert len({p.system for p in unique}) == 4
    assert all(p.system is None for p in plans(2, 2, system_prompt_len=0))


def test_each_turn_is_the_previous_prompt_the_answer_and_the_next_question_exactly():
    fmt = ChatFormat(TOK)
    (plan,) = plans(1, 4)
    conv = Conversation(plan, fmt)
    messages = [{"role": "system", "content": plan.system}]
    messages.append({"role": "user", "content": plan.questions[0]})
    assert conv.prompt_text == TOK.chat_text(messages)
    assert conv.prompt_ids == fmt.ids(conv.prompt_text)
    answers = [[300, 301, 302, EOS], [310, 311], [320, 321, 322, EOS, EOS]]
    for t, ids in enumerate(answers, start=1):
        before_ids, before_text = conv.prompt_ids, conv.prompt_text
        conv.answer(ids)
        kept = [i for i in ids if i != EOS]  # the trailing EOS is the template's to write
        answer_text = TOK.decode(kept)
        suffix = (
            f"<|im_end|>\n<|im_start|>user\n{plan.questions[t]}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert conv.prompt_ids == before_ids + kept + fmt.ids(suffix)
        assert conv.prompt_text == before_text + answer_text + suffix
        # The same text the template writes for the whole conversation.
        messages += [
            {"role": "assistant", "content": answer_text},
            {"role": "user", "content": plan.questions[t]},
        ]
        assert conv.prompt_text == TOK.chat_text(messages)
        req = conv.request()
        assert (req.index, req.group, req.text) == (t, 0, plan.questions[t])
    conv.answer([330, 331, EOS])
    assert conv.done and conv.tokens() == conv.prompt_ids + [330, 331]


def test_a_text_answer_extends_the_text_and_plain_turns_without_a_template():
    (plan,) = plans(1, 2, system_prompt_len=0)
    conv = Conversation(plan, ChatFormat(TOK))
    first = conv.prompt_text
    conv.answer(None, " an answer in words")
    assert conv.prompt_text.startswith(first + " an answer in words<|im_end|>\n<|im_start|>user\n")
    plain = Conversation(plan, ChatFormat(TOK, chat=False))
    assert plain.prompt_text == f"User: {plan.questions[0]}\nAssistant:"
    plain.answer(None, " yes.")
    assert plain.prompt_text == (
        f"User: {plan.questions[0]}\nAssistant: yes.\nUser: {plan.questions[1]}\nAssistant:"
    )


def test_distinct_prefix_tokens_counts_shared_prefixes_once():
    assert distinct_prefix_tokens([]) == 0
    assert distinct_prefix_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [7]]) == 3 + 1 + 1 + 1
    assert distinct_prefix_tokens([[1, 2], [1, 2]]) == 2
    ps = plans(3, 3)
    fmt = ChatFormat(TOK)
    system = len(fmt.ids(fmt.opening(ps[0].system, "x")))  # about the shared system prompt
    one = planned_working_set(ps[:1], fmt)
    three = planned_working_set(ps, fmt)
    # Three conversations share the system prompt: less than three times one.
    assert 3 * one - 2 * system - 40 < three < 3 * one - 2 * system + 40
    assert one > 3 * 8 + 3 * 40  # the answers at full length and the questions


class ChatDriver:
    """In-process (no server): answers each turn after ``delay_s`` with ids
    that name the turn, EOS last; records every send's start and end and
    what it was sent."""

    name = "chat"

    def __init__(self, delay_s: float = 0.02, fail: set[tuple[int, int]] = frozenset()) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.log: list[dict] = []
        self.in_flight = self.most = 0

    async def send(self, req, rec, t0):
        conv, turn = req.group, req.index % 4
        entry = {"conv": conv, "turn": turn, "start": time.perf_counter(), "ids": req.prompt_ids}
        self.log.append(entry)
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if (conv, turn) in self.fail:
                raise RuntimeError("refused")
            answer = [400 + conv, 450 + turn, EOS]
            rec.output_ids.extend(answer)
            rec.token_times.extend([time.perf_counter() - t0] * len(answer))
            rec.cached_tokens = len(req.prompt_ids) // 2
        finally:
            self.in_flight -= 1
            entry["end"] = time.perf_counter()


def conversations(n: int = 3):
    fmt = ChatFormat(TOK)
    return [Conversation(p, fmt) for p in plans(n, 4)]


def test_closed_loop_a_turn_waits_for_the_previous_answer_and_the_think_time():
    driver = ChatDriver()
    think = ThinkTime(0.05, "fixed")
    run = asyncio.run(run_conversations(driver, conversations(3), think=think, progress=False))
    assert len(driver.log) == 12 and all(r.ok for r in run.records)
    by = {(e["conv"], e["turn"]): e for e in driver.log}
    for c in range(3):
        for t in range(1, 4):
            prev, cur = by[(c, t - 1)], by[(c, t)]
            assert cur["start"] >= prev["end"] + 0.05 - 1e-3, (c, t)
            # What turn t carried: turn t - 1's prompt, then the answer it got (EOS dropped).
            assert cur["ids"][: len(prev["ids"]) + 2] == prev["ids"] + [400 + c, 450 + t - 1]
    # The conversations ran side by side, not one after another.
    assert driver.most == 3
    assert run.extra["turns_completed"] == run.extra["turns_planned"] == 12
    assert run.extra["conversations_completed"] == 3


def test_max_concurrency_caps_turns_in_flight_across_conversations():
    driver = ChatDriver()
    run = asyncio.run(
        run_conversations(
            driver, conversations(4), think=ThinkTime(0.0), max_concurrency=2, progress=False
        )
    )
    assert driver.most == 2 and run.extra["turns_completed"] == 16


def test_same_seed_same_run_and_think_times_drawn_from_it():
    def sent(seed: int) -> list:
        driver = ChatDriver(0.001)
        think = ThinkTime(0.01)
        convs = [Conversation(p, ChatFormat(TOK)) for p in plans(2, 4, seed=seed)]
        asyncio.run(run_conversations(driver, convs, think=think, seed=seed, progress=False))
        return sorted((e["conv"], e["turn"], e["ids"]) for e in driver.log)

    assert sent(3) == sent(3)
    assert sent(3) != sent(4)
    import random

    draws = [ThinkTime(2.0).draw(random.Random(1)) for _ in range(3)]
    assert len(set(draws)) == 1  # the same generator state, the same draw
    rng = random.Random(1)
    many = [ThinkTime(2.0).draw(rng) for _ in range(4000)]
    assert 1.8 < sum(many) / len(many) < 2.2 and min(many) >= 0
    assert ThinkTime(2.0, "fixed").draw(rng) == 2.0
    with pytest.raises(ValueError):
        ThinkTime(-1.0)


def test_a_failed_turn_ends_its_conversation_and_the_figures_count_it():
    driver = ChatDriver(fail={(1, 1)})
    run = asyncio.run(
        run_conversations(driver, conversations(3), think=ThinkTime(0), progress=False)
    )
    assert [(e["conv"], e["turn"]) for e in driver.log if e["conv"] == 1] == [(1, 0), (1, 1)]
    errors = {r.index: r.error for r in run.records if r.error}
    assert errors == {5: "RuntimeError: refused", 6: NOT_SENT, 7: NOT_SENT}
    assert run.extra["turns_completed"] == 9 and run.extra["conversations_completed"] == 2
    s = summarize(run.records, run.duration_s) | run.extra
    done = [r for r in run.records if r.ok]
    assert s["completed"] == 9 and s["failed"] == 3
    assert s["input_tokens"] == sum(r.prompt_tokens for r in done)
    assert s["prefill_tokens"] == s["input_tokens"] - s["cached_tokens"]
    assert s["cache_hit_rate"] == pytest.approx(s["cached_tokens"] / s["input_tokens"])
    assert s["output_tokens"] == 9 * 3
    # The working set is what the conversations hold as they ended: the
    # finished ones whole, the failed one up to the prompt it failed on.
    by = {(e["conv"], e["turn"]): e["ids"] for e in driver.log}
    held = [by[(0, 3)] + [400, 453], by[(2, 3)] + [402, 453], by[(1, 1)]]
    assert run.extra["working_set_tokens"] == distinct_prefix_tokens(held)


def test_a_driver_with_no_answer_ends_the_conversation():
    class Mute(ChatDriver):
        async def send(self, req, rec, t0):
            rec.token_times.append(0.0)

    run = asyncio.run(
        run_conversations(Mute(), conversations(1), think=ThinkTime(0), progress=False)
    )
    assert [r.error for r in run.records] == [NO_ANSWER, NOT_SENT, NOT_SENT, NOT_SENT]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mt-turns", "0"], "--mt-turns must be at least 1"),
        (["--mt-think-time-s", "-1"], "--mt-think-time-s must be"),
        (["--save-trace", "x"], "nothing to save before the run"),
        (["--prompts-only", "--save-prompts", "x"], "nothing to save before the run"),
    ],
)
def test_bad_multiturn_arguments_are_refused(argv, message, capsys):
    p = build_parser()
    with pytest.raises(SystemExit):
        check_args(p, p.parse_args(["--dataset", "multiturn", *argv]))
    assert message in capsys.readouterr().err


def test_multiturn_honours_eos_by_default():
    p = build_parser()
    args = p.parse_args(["--dataset", "multiturn"])
    check_args(p, args)
    assert args.ignore_eos is False and args.temperature == 0.0


MT = ("--dataset", "multiturn", "--mt-conversations", "2", "--mt-turns", "3")
MT += ("--mt-question-len", "50", "--mt-output-len", "3", "--mt-think-time-s", "0")


def _bench(capsys, *argv: str) -> tuple[int, str]:
    code = cli.main(["--no-progress", "--warmup-requests", "1", *argv])
    got = capsys.readouterr()
    return code, got.out + got.err


def test_grpc_run_sends_each_turn_its_history_and_reports_the_figures(capsys, tmp_path):
    out = tmp_path / "mt.json"
    with recording_scheduler() as (address, servicer):
        code, text = _bench(capsys, "--address", address, *MT, "--output-json", str(out))
    assert code == 0, text
    sent = [r for r in servicer.requests if not r.request_id.startswith("bench--")]
    by_conv: dict[int, list[list[int]]] = {}
    for r in sorted(sent, key=lambda r: int(r.request_id.split("-")[1])):
        index = int(r.request_id.split("-")[1])
        by_conv.setdefault(index // 3, []).append(list(r.tokenized.input_ids))
    assert sorted(by_conv) == [0, 1] and all(len(v) == 3 for v in by_conv.values())
    for turns in by_conv.values():
        for prev, cur in itertools.pairwise(turns):
            assert cur[: len(prev) + len(OUTPUT)] == prev + OUTPUT  # the answer's ids as given
    assert "turns completed 6/6, conversations completed 2/2" in text
    assert "prefill tokens computed" in text
    s = json.loads(out.read_text())["results"]["radixserve"]
    assert (s["turns_completed"], s["completed"], s["output_tokens"]) == (6, 6, 18)
    assert s["device_pool_tokens"] is None  # this server does not say
    assert s["working_set_tokens"] == distinct_prefix_tokens(
        [turns[-1] + OUTPUT for turns in by_conv.values()]
    )


def test_openai_run_appends_the_answers_text(capsys, monkeypatch):
    monkeypatch.setattr(cli, "local_tokenizer", lambda model: small_tokenizer())
    with recording_openai() as (url, bodies):
        code, text = _bench(capsys, "--backend", "openai", "--base-url", url, *MT)
    assert code == 0, text
    prompts = [b["prompt"] for b in bodies if b["max_tokens"] == 3]
    assert len(prompts) == 6
    answer = "".join(f" w{t}" for t in OUTPUT)
    followers = [p for p in prompts if answer in p]
    assert len(followers) == 4  # turns 1 and 2 of both conversations
    for p in followers:
        head = p.split(answer + "<|im_end|>\n<|im_start|>user\n")[0]
        assert head in prompts  # the earlier turn's prompt, then its answer


def test_working_set_flag_reports_the_size_and_sends_nothing(capsys):
    with recording_scheduler() as (address, servicer):
        code, text = _bench(capsys, "--address", address, *MT, "--mt-working-set")
    assert code == 0, text
    assert "working set:" in text and "distinct prefix tokens" in text
    assert not servicer.requests
    size = json.loads(text.strip().splitlines()[-1])
    assert size["working_set_tokens"] > 2 * 3 * (3 + 20)
