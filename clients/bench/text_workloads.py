"""Workloads of real text: prose passages with a question appended (``--dataset
text``), and prompts from a JSONL file in vLLM's custom-dataset shape
(``--dataset jsonl``), one per line:

    {"prompt": "What does the passage say about ...?", "output_tokens": 128}

``output_tokens`` is optional (default: ``--text-output-len``). Either way a
prompt is the user's message through the model's chat template, as
``vllm bench serve --dataset-name custom`` sends it, unless
``--skip-chat-template``; ``--save-prompts`` writes any text workload in the
same shape, so vLLM's own client can send exactly these prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from clients.bench.records import BenchRequest
from clients.bench.workloads import WorkloadError, json_lines
from clients.tokenizer_bundle import TokenizerBundle

# Appended to a passage after a blank line. Questions about the text, not
# about its subject, so they fit any prose; several, so the prompts of one
# passage (--text-questions-per-passage) differ only after the passage.
QUESTIONS = (
    "What is the main point of the text above? Answer in a few sentences.",
    "Summarize the passage above for a reader who is new to the subject.",
    "Explain the text above in your own words, with an example.",
    "List the rules or facts that the passage above states, one per line.",
    "What in the text above might a beginner misunderstand, and why?",
    "Write one question a student could ask about this text, and answer it.",
    "Which terms in the passage above need a definition? Define each briefly.",
    "Rewrite the first sentence of the passage above in plain words, then explain it.",
)

# A passage keeps at least this many tokens once the template and the
# question are counted; a smaller budget is refused rather than sent as a
# question about nothing.
MIN_PASSAGE_TOKENS = 16


class Prompter:
    """A user message -> the prompt text and ids, through the chat template
    (or as it is, ``chat=False``, or when the model has none)."""

    def __init__(self, tokenizer: TokenizerBundle, chat: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat = chat and tokenizer.chat_template is not None

    def __call__(self, message: str) -> tuple[str, list[int]]:
        if not self.chat:
            return message, self.tokenizer.encode(message)
        text = self.tokenizer.chat_text([{"role": "user", "content": message}])
        return text, self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids


def text_workload(
    tokenizer: TokenizerBundle,
    paragraphs: list[str],
    num_prompts: int,
    input_len: int,
    *,
    output_len: int,
    range_ratio: float = 0.5,
    questions_per_passage: int = 1,
    seed: int = 1,
    chat: bool = True,
) -> list[BenchRequest]:
    """``num_prompts`` prompts of at most ``input_len`` tokens each (template
    and question included; a passage's budget is drawn uniformly from
    [input_len * range_ratio, input_len]): consecutive paragraphs from a
    starting paragraph the seed picks (a different one for every passage of
    the run), cut at a word boundary to the budget, then a question.
    ``questions_per_passage`` prompts share each passage (a shared-prefix
    load of real text: they differ from the question on)."""
    k = questions_per_passage
    if not 1 <= k <= len(QUESTIONS):
        raise WorkloadError(f"--text-questions-per-passage must be in [1, {len(QUESTIONS)}]")
    if not 0.0 <= range_ratio <= 1.0:
        raise WorkloadError(f"--text-range-ratio must be in [0, 1], got {range_ratio}")
    if output_len < 1:
        raise WorkloadError("--text-output-len must be at least 1")
    groups = -(-num_prompts // k)
    if groups > len(paragraphs):
        raise WorkloadError(
            f"{groups} passages asked for, but the text has {len(paragraphs)} paragraphs "
            "to start them at: fewer prompts, or more text (--text-files)"
        )
    prompter = Prompter(tokenizer, chat)
    rng = random.Random(seed)
    starts = rng.sample(range(len(paragraphs)), groups)
    para_len: dict[int, int] = {}
    out: list[BenchRequest] = []
    for g, start in enumerate(starts):
        budget = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        questions = rng.sample(QUESTIONS, min(k, num_prompts - len(out)))
        passage_ids = _passage_ids(tokenizer, paragraphs, start, budget, para_len=para_len)
        for text, prompt_text, ids in _fit(prompter, passage_ids, questions, budget):
            out.append(
                BenchRequest(
                    len(out),
                    ids,
                    output_len,
                    g if k > 1 else -1,
                    text=text,
                    prompt_text=prompt_text,
                )
            )
    return out


def _passage_ids(
    tokenizer: TokenizerBundle,
    paragraphs: list[str],
    start: int,
    budget: int,
    *,
    para_len: dict[int, int],
) -> list[int]:
    """Token ids of paragraphs start, start + 1, ... (wrapping), enough of
    them to fill ``budget`` tokens."""
    chosen: list[str] = []
    total = 0
    i = start
    while total < budget and len(chosen) < len(paragraphs):
        j = i % len(paragraphs)
        if j not in para_len:
            para_len[j] = len(tokenizer.encode(paragraphs[j]))
        chosen.append(paragraphs[j])
        total += para_len[j] + 2
        i += 1
    return tokenizer.tokenizer.encode("\n\n".join(chosen), add_special_tokens=False).ids


def passage_text(
    tokenizer: TokenizerBundle,
    paragraphs: list[str],
    start: int,
    budget: int,
    *,
    para_len: dict[int, int],
) -> str:
    """Prose of paragraphs start, start + 1, ... cut at a word boundary to
    at most ``budget`` tokens (the multi-turn workload's questions and
    system prompt)."""
    ids = _passage_ids(tokenizer, paragraphs, start, budget, para_len=para_len)
    return _cut(tokenizer, ids, min(budget, len(ids)))


def _fit(
    prompter: Prompter, passage_ids: list[int], questions: list[str], budget: int
) -> list[tuple[str, str, list[int]]]:
    """(message, prompt text, ids) per question, the passage cut to the same
    length for all of them so that every prompt fits ``budget``."""
    n = len(passage_ids)
    while True:
        passage = _cut(prompter.tokenizer, passage_ids, n)
        made = []
        for q in questions:
            message = f"{passage}\n\n{q}"
            made.append((message, *prompter(message)))
        excess = max(len(ids) for _, _, ids in made) - budget
        if excess <= 0:
            return made
        n = min(n - 1, len(_ids_of(prompter, passage)) - excess)
        if n < MIN_PASSAGE_TOKENS:
            raise WorkloadError(
                f"a {budget}-token prompt leaves too little room for a passage once the "
                "chat template and the question are counted: raise --text-input-len"
            )


def _ids_of(prompter: Prompter, passage: str) -> list[int]:
    return prompter.tokenizer.tokenizer.encode(passage, add_special_tokens=False).ids


def _cut(tokenizer: TokenizerBundle, ids: list[int], n: int) -> str:
    """The text of the first ``n`` ids, without a word cut in half."""
    text = tokenizer.decode(ids[:n])
    if n < len(ids):
        head, sep, _ = text.rpartition(" ")
        text = head if sep and head.strip() else text
    return text.strip()


def jsonl_workload(
    tokenizer: TokenizerBundle,
    path: str | Path,
    num_prompts: int,
    output_len: int,
    *,
    seed: int = 1,
    chat: bool = True,
) -> list[BenchRequest]:
    """Up to ``num_prompts`` lines of the file, in an order the seed shuffles
    (as vLLM's custom dataset; lines are never sent twice, so a short file
    gives fewer requests rather than repeats a warm cache would answer)."""
    items = _read_prompt_lines(path)
    random.Random(seed).shuffle(items)
    prompter = Prompter(tokenizer, chat)
    out = []
    for message, tokens in items[:num_prompts]:
        prompt_text, ids = prompter(message)
        out.append(
            BenchRequest(len(out), ids, tokens or output_len, text=message, prompt_text=prompt_text)
        )
    return out


def _read_prompt_lines(path: str | Path) -> list[tuple[str, int | None]]:
    items: list[tuple[str, int | None]] = []
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise WorkloadError(f"{path}: {e.strerror}") from None
    with f:
        for where, item in json_lines(f, path):
            if not isinstance(item, dict):
                raise WorkloadError(f"{where}: a line must be a JSON object")
            prompt, tokens = item.get("prompt"), item.get("output_tokens")
            if not isinstance(prompt, str) or not prompt.strip():
                raise WorkloadError(f"{where}: prompt must be a non-empty string")
            if tokens is not None and (type(tokens) is not int or tokens < 1):
                raise WorkloadError(f"{where}: output_tokens must be a positive integer")
            items.append((prompt, tokens))
    if not items:
        raise WorkloadError(f"{path}: no prompts")
    return items


def write_prompts(path: str | Path, requests: Iterable[BenchRequest]) -> None:
    """The workload as vLLM's custom dataset (the user's messages and their
    output lengths); only text workloads have messages to write."""
    lines = []
    for r in requests:
        if r.text is None:
            raise WorkloadError("--save-prompts needs a text workload (--dataset text or jsonl)")
        lines.append(json.dumps({"prompt": r.text, "output_tokens": r.output_len}) + "\n")
    Path(path).write_text("".join(lines), encoding="utf-8")
