"""radixserve-bench's real-text workloads and sampled mode, without a server:
prose paragraphs, passages cut to a token budget with a question, vLLM's
custom-dataset JSONL (read and written), the seeds per request, and the
defaults --compare-openai takes."""

from __future__ import annotations

import json

import pytest

from clients.bench.compare import repeat_args
from clients.bench.flags import build_parser, check_args, sampling_mode
from clients.bench.prose import default_paragraphs, paragraphs_of, read_paragraphs
from clients.bench.records import BenchRequest
from clients.bench.sampling import SamplingMode, with_seeds
from clients.bench.text_workloads import (
    QUESTIONS,
    jsonl_workload,
    text_workload,
    write_prompts,
)
from clients.bench.workloads import WorkloadError
from tests.clients.support.bench_peers import small_tokenizer

PROSE = """Title of the page
=================

The first paragraph is prose of a reasonable length, long enough to count as
a paragraph: it goes on across two lines of the file.

   indented_code = "is not prose" + " even when it has plenty of words in it ok"

>>> print("an interactive session is not prose either, whatever it prints out")

Short line.

The second kept paragraph mentions numbers such as 3 and 4 and still reads
like ordinary sentences a person wrote for other people to read.
"""


def test_paragraphs_keep_prose_and_drop_titles_code_and_fragments(tmp_path):
    paras = paragraphs_of(PROSE)
    assert paras == [
        "The first paragraph is prose of a reasonable length, long enough to count as "
        "a paragraph: it goes on across two lines of the file.",
        "The second kept paragraph mentions numbers such as 3 and 4 and still reads "
        "like ordinary sentences a person wrote for other people to read.",
    ]
    (tmp_path / "a.txt").write_text(PROSE)
    (tmp_path / "b.txt").write_bytes(PROSE.encode().replace(b"numbers", b"num\xffbers"))
    both = read_paragraphs([tmp_path / "a.txt", tmp_path / "b.txt"])
    assert len(both) == 4 and "num\ufffdbers" in both[3]
    # The default source: Python's own documentation, hundreds of paragraphs.
    default = default_paragraphs()
    assert len(default) > 500
    assert any("exception" in p for p in default)
    assert all(len(p.split()) >= 12 and "\n" not in p for p in default)


def _common_prefix(seqs: list[list[int]]) -> int:
    n = 0
    while all(len(x) > n for x in seqs) and len({x[n] for x in seqs}) == 1:
        n += 1
    return n


def _tokens(tok, text: str) -> int:
    return len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


def test_text_prompts_fit_their_budget_and_end_with_a_question():
    tok = small_tokenizer()
    paras = default_paragraphs()
    reqs = text_workload(tok, paras, 40, 200, output_len=32, range_ratio=0.5, seed=7)
    assert [r.index for r in reqs] == list(range(40))
    lens = [len(r.prompt_ids) for r in reqs]
    assert max(lens) <= 200 and min(lens) >= 100 * 0.8, lens
    assert len(set(lens)) > 10  # budgets drawn from the range, not one length
    for r in reqs:
        assert r.output_len == 32 and r.group == -1
        assert r.prompt_ids == tok.tokenizer.encode(r.prompt_text, add_special_tokens=False).ids
        assert r.prompt_text == f"<|im_start|>user\n{r.text}<|im_end|>\n<|im_start|>assistant\n"
        passage, _, question = r.text.rpartition("\n\n")
        assert question in QUESTIONS
        # Cut at a word boundary: the passage's last word is a whole word of the text.
        assert any(passage.split()[-1] in p.split() for p in paras)
    # Every passage starts at its own paragraph: no two prompts share a prefix
    # longer than the chat template's head.
    firsts = {r.text.split("\n\n")[0][:80] for r in reqs}
    assert len(firsts) == 40
    # Without the template the message is the prompt.
    raw = text_workload(tok, paras, 5, 200, output_len=32, seed=7, chat=False)
    assert all(r.prompt_text == r.text and len(r.prompt_ids) <= 200 for r in raw)


def test_text_prompts_follow_the_seed():
    tok = small_tokenizer()
    paras = default_paragraphs()

    def ids(seed: int) -> list[list[int]]:
        return [r.prompt_ids for r in text_workload(tok, paras, 12, 160, output_len=8, seed=seed)]

    assert ids(3) == ids(3)
    assert ids(3) != ids(4)
    assert not {tuple(x) for x in ids(3)} & {tuple(x) for x in ids(4)}


def test_questions_per_passage_share_the_passage_as_a_prefix():
    tok = small_tokenizer()
    reqs = text_workload(
        tok, default_paragraphs(), 10, 180, output_len=8, questions_per_passage=4, seed=2
    )
    assert [r.group for r in reqs] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    for g in range(3):
        members = [r for r in reqs if r.group == g]
        passages = {r.text.rpartition("\n\n")[0] for r in members}
        assert len(passages) == 1
        questions = [r.text.rpartition("\n\n")[2] for r in members]
        assert len(set(questions)) == len(members)
        shared = _common_prefix([r.prompt_ids for r in members])
        assert shared >= _tokens(tok, passages.pop()) - 2
        assert all(len(r.prompt_ids) <= 180 for r in members)


def test_text_workload_refusals():
    tok = small_tokenizer()
    paras = default_paragraphs()[:5]
    with pytest.raises(WorkloadError, match="6 passages asked for, but the text has 5"):
        text_workload(tok, paras, 6, 200, output_len=8)
    with pytest.raises(WorkloadError, match="raise --text-input-len"):
        text_workload(tok, paras, 1, 24, output_len=8)
    with pytest.raises(WorkloadError, match="questions-per-passage"):
        text_workload(tok, paras, 1, 200, output_len=8, questions_per_passage=len(QUESTIONS) + 1)


def test_jsonl_in_vllm_custom_shape_read_shuffled_by_seed_and_written_back(tmp_path):
    tok = small_tokenizer()
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"Question number {i}: what is {i} plus {i}?"} for i in range(6)]
    lines[2]["output_tokens"] = 9
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + "\n")
    reqs = jsonl_workload(tok, path, 100, 50, seed=1)
    assert len(reqs) == 6  # a short file is used once, never repeated
    assert sorted(r.text for r in reqs) == sorted(x["prompt"] for x in lines)
    assert {r.text: r.output_len for r in reqs}[lines[2]["prompt"]] == 9
    assert {r.output_len for r in reqs if r.text != lines[2]["prompt"]} == {50}
    assert all(r.prompt_text.startswith("<|im_start|>user\n") for r in reqs)
    orders = {tuple(r.text for r in jsonl_workload(tok, path, 100, 50, seed=s)) for s in range(4)}
    assert len(orders) > 1
    assert [r.text for r in jsonl_workload(tok, path, 3, 50, seed=1)] == [r.text for r in reqs[:3]]
    out = tmp_path / "saved.jsonl"
    write_prompts(out, reqs)
    again = jsonl_workload(tok, out, 100, 1, seed=1)
    assert sorted((r.text, r.output_len) for r in again) == sorted(
        (r.text, r.output_len) for r in reqs
    )
    with pytest.raises(WorkloadError, match="needs a text workload"):
        write_prompts(out, [BenchRequest(0, [1, 2], 3)])
    bad = tmp_path / "bad.jsonl"
    for text, message in [
        ('{"prompt": "ok"}\n{"text": "no prompt"}', "bad.jsonl:2: prompt must be"),
        ('{"prompt": "ok", "output_tokens": 0}', "bad.jsonl:1: output_tokens must be"),
        ("[1]", "bad.jsonl:1: a line must be a JSON object"),
        ("", "bad.jsonl: no prompts"),
    ]:
        bad.write_text(text)
        with pytest.raises(WorkloadError, match=message):
            jsonl_workload(tok, bad, 10, 5)


def test_request_seeds_are_distinct_and_follow_the_run_seed():
    reqs = [BenchRequest(i, [1], 4) for i in range(500)]
    sampled = SamplingMode(temperature=0.8)
    seeds = [r.seed for r in with_seeds(reqs, sampled, 11)]
    assert len(set(seeds)) == 500 and all(0 <= s < 2**31 for s in seeds)
    assert [r.seed for r in with_seeds(reqs, sampled, 11)] == seeds
    assert not set(seeds) & {r.seed for r in with_seeds(reqs, sampled, 12)}
    assert all(r.seed is None for r in with_seeds(reqs, SamplingMode(), 11))
    unseeded = SamplingMode(temperature=0.8, request_seeds=False)
    assert all(r.seed is None for r in with_seeds(reqs, unseeded, 11))
    assert all(r.seed is None for r in reqs)  # the workload itself is not changed


def _args(*argv: str):
    p = build_parser()
    args = p.parse_args(list(argv))
    check_args(p, args)
    return args


def test_compare_openai_defaults_to_sampled_real_text_and_fresh_prompts_per_repeat():
    args = _args("--compare-openai", "http://127.0.0.1:8100")
    assert (args.dataset, args.num_prompts) == ("text", 256)
    mode = sampling_mode(args)
    assert mode == SamplingMode(temperature=1.0, ignore_eos=False)
    assert [repeat_args(args, i).seed for i in range(3)] == [1, 2, 3]
    again = _args("--compare-openai", "x", "--repeat-prompts", "--seed", "5")
    assert [repeat_args(again, i).seed for i in range(3)] == [5, 5, 5]
    # The earlier comparison, by flags: greedy random tokens, EOS ignored.
    greedy = _args("--compare-openai", "x", "--dataset", "random", "--temperature", "0")
    assert sampling_mode(greedy).greedy and greedy.ignore_eos and greedy.num_prompts == 1000
    # Plain runs keep their defaults; text honours EOS unless told.
    plain = _args()
    assert plain.dataset == "generated-shared-prefix" and sampling_mode(plain).greedy
    assert _args("--dataset", "text").ignore_eos is False
    assert _args("--dataset", "text", "--ignore-eos").ignore_eos is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dataset", "jsonl"], "--dataset jsonl needs --dataset-path"),
        (["--temperature", "-1"], "--temperature must be"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "0"], "--top-k must be -1"),
        (["--baseline", "hf", "--temperature", "0.7"], "--baseline hf compares greedy"),
        (["--baseline", "hf", "--dataset", "text"], "--baseline hf compares greedy"),
    ],
)
def test_bad_sampling_and_dataset_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _args(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
