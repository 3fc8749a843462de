"""The worker verifies drafted extends (speculative decoding): the request's
last sampled token followed by k drafts is computed like a prefill chunk, a
token is sampled at each of the k + 1 positions as if the drafts before it
were accepted, and the entry yields the drafts that equal their samples plus
the sample after them. Whatever the drafts, the tokens, logprobs and top
logprobs equal plain decoding's (the real default model on the CPU, greedy,
seeded sampling and penalties, page sizes 1 and 16), the KV and pages of
rejected drafts are dropped (decoding goes on from the accepted tokens on
pages handed out again), a drafted plan never overlaps the step before it,
and bad drafted extends reject the plan whole."""

from __future__ import annotations

import math

import pytest

from common.simulated_model import expected_output
from protos import worker_pb2 as pb
from tests.worker_service.support.draft_driver import Decoded, DraftDriver
from tests.worker_service.support.worker_factory import runner_for
from tests.worker_service.support.worker_process import PlanStream, worker_process
from worker_service.execution.convert import plan_from_proto, result_to_proto
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import Extend, ForwardMode, Join, Plan, Result
from worker_service.execution.simulated_compute import SimulatedCompute
from worker_service.sampling.grammar import (
    SIMULATED_EOS,
    GrammarCompiler,
    simulated_tokenizer_info,
)
from worker_service.sampling.params import LogprobOptions, SamplingParams

# "List the planets of the solar system." in the default model's chat template.
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
PROMPT += [411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 6106, 260, 9244, 282, 260, 3693, 817]
PROMPT += [30, 2, 198, 1, 520, 9531, 198]
TOKENS = 20
COUNTS = [1, 1, 1, 9, 1, 3, 1, 1, 2]  # tokens per step of speculated()
LOGPROBS = LogprobOptions(return_logprob=True, top_logprobs_num=3)
SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234),
    "penalties": SamplingParams(
        temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3
    ),
}


@pytest.fixture(scope="module", params=[1, 16], ids=["page1", "page16"])
def model_runner(request) -> ModelRunner:
    return runner_for("default", page_size=request.param, num_pages=512, overlap="off")


@pytest.fixture
def runner(model_runner) -> ModelRunner:
    model_runner.reset()
    return model_runner


@pytest.fixture(scope="module")
def overlap_runner() -> ModelRunner:
    return runner_for("default", page_size=4, num_pages=256, overlap="on")


def plain(driver: DraftDriver, slot: int, prompt: list[int], sampling: SamplingParams) -> Decoded:
    seq = driver.start(slot, prompt, sampling, LOGPROBS)
    while len(seq.outputs) < TOKENS:
        driver.decode(seq)
    return seq


def wrong(token: int) -> int:
    return token + 1


def speculated(driver: DraftDriver, slot: int, ref: list[int], sampling: SamplingParams) -> Decoded:
    """Decode with drafts right, wrong and partly right; checks each step's
    tokens and the worker's state after it."""
    seq = driver.start(slot, PROMPT, sampling, LOGPROBS)
    r = ref
    schedule = [
        ([], r[1:2]),
        ([], r[2:3]),
        # All right: k + 1 tokens (long enough that a penalty left out of a
        # row, or a seeded draw at the wrong output count, changes a token).
        (r[3:11], r[3:12]),
        ([wrong(r[12]), r[13], r[14]], r[12:13]),  # the first one wrong: 1 token
        ([r[13], r[14], wrong(r[15]), r[16]], r[13:16]),  # two right: 3 tokens
        ([], r[16:17]),
        ([wrong(r[17])], r[17:18]),
        (r[18:19], r[18:20]),
    ]
    for drafts, expected in schedule:
        got = driver.verify(seq, drafts) if drafts else driver.decode(seq)
        assert got == expected, (drafts, got, expected)
        check_state(driver, seq)
    return seq


def check_state(driver: DraftDriver, seq: Decoded) -> None:
    state = driver.runner.slots[seq.slot]
    assert state.tokens == seq.prompt + seq.outputs
    assert state.kv_len == seq.kv_len == len(state.tokens) - 1
    assert state.pages == seq.pages
    assert len(state.pages) == math.ceil(state.kv_len / driver.page_size)


@pytest.mark.slow  # the default model
@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_drafts_give_the_tokens_and_logprobs_of_plain_decoding(runner, name):
    sampling = SAMPLINGS[name]
    driver = DraftDriver(runner)
    ref = plain(driver, 0, PROMPT, sampling)
    assert len(set(ref.outputs)) > 5  # a text, not one token repeated
    seq = speculated(driver, 1, ref.outputs, sampling)
    assert seq.outputs == ref.outputs
    assert seq.counts == COUNTS
    assert seq.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert seq.top_ids == ref.top_ids
    for got, want in zip(seq.top_logprobs, ref.top_logprobs, strict=True):
        assert got == pytest.approx(want, abs=1e-4)
    # And decoding goes on from there as plain decoding does.
    more = [driver.decode(seq)[0] for _ in range(3)]
    ref_more = [driver.decode(ref)[0] for _ in range(3)]
    assert more == ref_more
    assert seq.logprobs[-3:] == pytest.approx(ref.logprobs[-3:], abs=1e-4)


@pytest.mark.slow  # the default model
def test_a_drafted_plan_completes_the_overlapped_step_before_it(overlap_runner):
    """Overlap on: a decode is in flight (its token still PENDING on the worker)
    when the drafted plan that starts from that token arrives; the worker
    completes the decode first and checks the drafts against its token."""
    runner = overlap_runner
    sampling = SAMPLINGS["greedy"]
    driver = DraftDriver(runner)
    ref = plain(driver, 0, PROMPT, sampling).outputs
    seq = driver.start(1, PROMPT, sampling, LOGPROBS)
    decode = driver.decode_plan(seq)
    seq.kv_len += 1  # the drafted plan starts where the decode ends
    drafted = driver.drafted_plan(seq, ref[2:5], last=ref[1])
    first = runner.start(decode)
    second = runner.start(drafted)
    assert first.result is not None  # completed before the drafted plan was checked
    driver.take(seq, runner.complete(first))
    driver.take(seq, runner.complete(second))
    assert seq.outputs == ref[:6]
    assert seq.counts == [1, 1, 4]
    check_state(driver, seq)
    # Overlapped decodes after it start from its settled state.
    started = [runner.start(driver.decode_plan(seq))]
    seq.kv_len += 1
    started.append(runner.start(driver.decode_plan(seq)))
    assert started[0].result is None  # really overlapped
    for step in started:
        result = runner.complete(step)
        assert not result.error, result.error
        seq.outputs += result.token_ids
    assert seq.outputs == ref[:8]


# --------------------------------------------------------------- simulated


SIM_VOCAB = 50000  # holds the prompt's ids


def simulated_runner(page_size: int, max_context: int = 1 << 30) -> ModelRunner:
    compute = SimulatedCompute(vocab_size=SIM_VOCAB)
    return ModelRunner(
        compute, num_pages=256, page_size=page_size, vocab_size=SIM_VOCAB, max_context=max_context
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_simulated_worker_verifies_drafts_the_same_way(page_size):
    runner = simulated_runner(page_size)
    driver = DraftDriver(runner)
    ref = expected_output(PROMPT, TOKENS, SIM_VOCAB)
    seq = speculated(driver, 0, ref, SAMPLINGS["greedy"])
    assert seq.outputs == ref
    assert seq.counts == COUNTS
    driver.decode(seq)
    assert seq.outputs == expected_output(PROMPT, TOKENS + 1, SIM_VOCAB)


def test_a_drafted_step_with_other_entries_keeps_plan_order():
    """token_counts per sampling entry; tokens in entry order; the others get one."""
    runner = simulated_runner(4)
    driver = DraftDriver(runner)
    a = driver.start(0, PROMPT, SAMPLINGS["greedy"])
    b = driver.start(1, PROMPT[:20], SAMPLINGS["greedy"])
    ref_a = expected_output(PROMPT, 6, SIM_VOCAB)
    ref_b = expected_output(PROMPT[:20], 2, SIM_VOCAB)
    plan = driver.drafted_plan(a, ref_a[1:4] + [wrong(ref_a[4])])
    decode = driver.decode_plan(b)
    plan.decode_slots, plan.decode_positions = decode.decode_slots, decode.decode_positions
    plan.decode_new_pages = decode.decode_new_pages
    result = driver.run(plan)
    assert result.slots == [0, 1]
    assert result.token_counts == [4, 1]
    assert result.token_ids == ref_a[1:5] + ref_b[1:2]
    assert runner.slots[0].tokens == PROMPT + ref_a[:5]
    assert runner.slots[1].tokens == PROMPT[:20] + ref_b[:2]


def test_grammar_ended_indexes_tokens_in_a_drafted_step():
    """A grammar request decoding plainly beside a drafted extend: the index of
    its ending token counts the drafted entry's tokens before it."""
    compute = SimulatedCompute(vocab_size=SIM_VOCAB)
    grammars = GrammarCompiler(lambda: simulated_tokenizer_info(SIM_VOCAB))
    runner = ModelRunner(
        compute, num_pages=256, page_size=4, vocab_size=SIM_VOCAB, grammars=grammars
    )
    driver = DraftDriver(runner)
    a = driver.start(0, PROMPT, SAMPLINGS["greedy"])
    g = driver.start(1, PROMPT[:6], SamplingParams(temperature=0.0, grammar=("regex", "a")))
    assert g.outputs == [ord("a")]
    ref_a = expected_output(PROMPT, 5, SIM_VOCAB)
    plan = driver.drafted_plan(a, ref_a[1:4])
    decode = driver.decode_plan(g)
    plan.decode_slots, plan.decode_positions = decode.decode_slots, decode.decode_positions
    plan.decode_new_pages = decode.decode_new_pages
    result = driver.run(plan)
    assert result.token_counts == [4, 1]
    assert result.token_ids == ref_a[1:5] + [SIMULATED_EOS]
    assert result.grammar_ended == [4]


# -------------------------------------------------------------- refusals


def decoding_runner(page_size: int = 4, max_context: int = 1 << 30):
    """A simulated runner with slot 0 decoding and slot 1 halfway through its
    prompt (a chunk without sampling)."""
    runner = simulated_runner(page_size, max_context)
    driver = DraftDriver(runner)
    seq = driver.start(0, PROMPT[:10], SAMPLINGS["greedy"])
    plan = driver.new_plan()
    plan.joins.append(Join(1, "r1", SAMPLINGS["greedy"], LogprobOptions(), 10, []))
    plan.extends.append(Extend(1, 0, PROMPT[:5], [100, 101], False))
    driver.run(plan)
    return runner, driver, seq


def refused(runner: ModelRunner, plan: Plan) -> str:
    before = {s: (list(st.tokens), st.kv_len, list(st.pages)) for s, st in runner.slots.items()}
    result = runner.execute(plan)
    assert result.error
    after = {s: (list(st.tokens), st.kv_len, list(st.pages)) for s, st in runner.slots.items()}
    assert after == before  # nothing of the plan was applied
    return result.error


def drafted(seq: Decoded, inputs: list[int], draft_len: int, **kw) -> Plan:
    start = kw.pop("start", seq.kv_len)
    slot = kw.pop("slot", seq.slot)
    pages = kw.pop("pages", [50, 51, 52])
    e = Extend(slot, start, inputs, pages, kw.pop("sample", True), draft_len=draft_len, **kw)
    return Plan(99, ForwardMode.MIXED, extends=[e])


def test_bad_drafted_extends_reject_the_plan_whole():
    runner, _, seq = decoding_runner()
    last = seq.last
    cases = [
        (drafted(seq, [last, 5], 2), "draft_len 2 needs the last sampled token"),
        (drafted(seq, [last], 1), "draft_len 1 needs the last sampled token"),
        (drafted(seq, [last, 5], 1, sample=False), "sample is false"),
        (drafted(seq, [last, 5], 1, next_token=7), "next_token"),
        (drafted(seq, [wrong(last), 5], 1), f"is not the request's last sampled token {last}"),
        (drafted(seq, [last, 5], 1, start=seq.kv_len - 1), "starts at 9, its KV ends at 10"),
        (drafted(seq, [5, 6], 1, slot=1, start=5), "which is not decoding"),
        (drafted(seq, [last, 5], 1, slot=7), "which the worker does not hold"),
        (drafted(seq, [last, 5, 6, 7], 3, pages=[]), "would hold positions up to 13 in 3 pages"),
        (drafted(seq, [last, 5], 1, pages=[999]), "outside the pool"),
    ]
    for plan, message in cases:
        assert message in refused(runner, plan)
    # Whole: a good drafted extend is not applied when something after it is bad.
    plan = drafted(seq, [last, 5], 1)
    plan.decode_slots, plan.decode_positions, plan.decode_new_pages = [1], [5], [0]
    assert "decode of slot 1, which has no sampled token" in refused(runner, plan)
    # And the request still verifies drafts after all that.
    assert not runner.execute(drafted(seq, [last, 5], 1)).error


def test_a_drafted_extend_for_a_request_that_joins_in_the_plan_is_refused():
    runner, _, _ = decoding_runner()
    plan = Plan(99, ForwardMode.MIXED)
    plan.joins.append(Join(3, "r3", SAMPLINGS["greedy"], LogprobOptions(), 4, []))
    plan.extends.append(Extend(3, 0, [1, 2, 3, 4], [60], True, draft_len=2))
    assert "which is not decoding" in refused(runner, plan)


def test_drafts_past_the_context_are_refused():
    runner, _, seq = decoding_runner(max_context=13)
    assert "past the model's context (13 positions)" in refused(
        runner, drafted(seq, [seq.last, 5, 6, 7], 3)
    )
    assert not runner.execute(drafted(seq, [seq.last, 5, 6], 2)).error


def test_drafts_for_a_grammar_request_are_refused():
    runner, driver, _ = decoding_runner()
    regex = SamplingParams(temperature=0.0, grammar=("regex", "[ab]+"))
    plan = driver.new_plan()
    plan.joins.append(Join(2, "r2", regex, LogprobOptions(), 4, []))
    plan.extends.append(Extend(2, 0, PROMPT[:4], [70], False))
    driver.run(plan)
    message = refused(runner, drafted(Decoded(2, PROMPT[:4], kv_len=4), [PROMPT[3], 5], 1))
    assert "speculative drafts are not supported with a grammar" in message


# -------------------------------------------------------------- protocol


@pytest.mark.server  # a worker process
def test_a_simulated_worker_process_verifies_drafts_over_grpc(tmp_path):
    """The real servicer and codecs: a drafted Extend in, token_counts out."""
    prompt = [5, 17, 99, 3, 250, 41, 8]
    ref = expected_output(prompt, 6, 32000)
    with worker_process(tmp_path, "--model", "simulated", "--page-size", "4") as addr:
        stream = PlanStream(addr)
        greedy = pb.SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
        plan = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_PREFILL)
        plan.joins.add(slot=0, rid="a", sampling=greedy, prompt_len=len(prompt))
        plan.extends.add(slot=0, start_pos=0, input_ids=prompt, new_pages=[0, 1], sample=True)
        first = stream.run(plan)
        assert list(first.token_ids) == ref[:1] and not first.token_counts
        plan = pb.StepPlan(step_id=2, mode=pb.FORWARD_MODE_MIXED)
        drafts = [ref[1], ref[2], wrong(ref[3])]
        inputs = [ref[0], *drafts]
        plan.extends.add(
            slot=0, start_pos=7, input_ids=inputs, new_pages=[2], sample=True, draft_len=3
        )
        second = stream.run(plan)
        assert not second.error, second.error
        assert list(second.token_counts) == [3]
        assert list(second.token_ids) == ref[1:4]
        assert list(second.slots) == [0]
        # KV now ends at 10 (7 + 2 accepted + 1): a decode there continues.
        plan = pb.StepPlan(step_id=3, mode=pb.FORWARD_MODE_DECODE)
        plan.decode_slots.append(0)
        plan.decode_positions.append(10)
        plan.decode_new_pages.append(0)
        third = stream.run(plan)
        assert not third.error, third.error
        assert list(third.token_ids) == ref[4:5] and not third.token_counts
        stream.close()


def test_the_protocol_carries_draft_len_and_token_counts():
    msg = pb.StepPlan(step_id=3, mode=pb.FORWARD_MODE_MIXED)
    msg.extends.add(slot=1, start_pos=10, input_ids=[5, 6, 7], sample=True, draft_len=2)
    assert plan_from_proto(msg).extends[0].draft_len == 2
    result = Result(3, slots=[1, 2], token_ids=[6, 9, 4, 8], token_counts=[3, 1])
    assert list(result_to_proto(result).token_counts) == [3, 1]
