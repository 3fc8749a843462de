"""vs_vllm.py's loads: the `vllm bench serve` arguments of each named load,
and the chat load's prompts of real prose."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Load:
    name: str
    bench_args: tuple[str, ...]
    concurrency: int
    chat: bool = False


def make_load(name: str, chat_jsonl: str | None, chat_temperature: float) -> Load:
    """A load by name: shared16, random32, single, chat, ..."""
    if name == "single":
        args = ("--dataset-name", "random", "--random-input-len", "384")
        args += ("--random-output-len", "64", "--random-range-ratio", "0", "--num-prompts", "4")
        return Load(name, args, 1)
    if name == "chat":
        # The prompt goes as the user message; the server applies the template.
        args = ("--dataset-name", "custom", "--num-prompts", "48", "--skip-chat-template")
        args += ("--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
        args += ("--temperature", str(chat_temperature), "--custom-output-len", "128")
        if chat_jsonl:
            args += ("--dataset-path", chat_jsonl)
        return Load(name, args, 16, chat=True)
    for prefix in ("shared", "random"):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            c = int(name[len(prefix) :])
            if prefix == "shared":
                args = ("--dataset-name", "prefix_repetition")
                args += ("--prefix-repetition-num-prefixes", "4")
                args += ("--prefix-repetition-prefix-len", "256")
                args += ("--prefix-repetition-suffix-len", "32")
                args += ("--prefix-repetition-output-len", "64")
            else:
                args = ("--dataset-name", "random", "--random-input-len", "384")
                args += ("--random-output-len", "64", "--random-range-ratio", "0.33")
            return Load(name, (*args, "--num-prompts", str(3 * c)), c)
    raise SystemExit(f"unknown load {name!r}: sharedN, randomN, single or chat")


QUESTIONS = (
    "Summarize the passage above in three sentences.",
    "What is the main point of the passage above, and why does it matter?",
    "Explain the passage above to someone new to Python.",
    "List the key terms the passage above defines, with a short definition each.",
    "Write one example that illustrates the passage above, and explain it.",
)


def write_chat_prompts(path: Path, n: int, seed: int, max_chars: int = 1400) -> Path:
    """``n`` chat prompts of real prose nobody here wrote: consecutive
    paragraphs of the Python language reference's topic texts as the
    standard library ships them (``pydoc_data.topics``), up to ``max_chars``
    (about 300 tokens), then a question. The seed picks the passages, so
    each run's prompts are fresh."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    paragraphs = [
        [p.strip() for p in text.split("\n\n") if len(p.strip()) > 80]
        for _, text in sorted(topics.items())
    ]
    paragraphs = [ps for ps in paragraphs if ps]
    with open(path, "w") as f:
        for _ in range(n):
            ps = rng.choice(paragraphs)
            start = end = rng.randrange(len(ps))
            size = len(ps[start])
            # Forward from a random paragraph, then back when the topic ends.
            while end + 1 < len(ps) and size + len(ps[end + 1]) < max_chars:
                end += 1
                size += len(ps[end])
            while start > 0 and size + len(ps[start - 1]) < max_chars:
                start -= 1
                size += len(ps[start])
            text = "\n\n".join(ps[start : end + 1])[:max_chars] + "\n\n"
            f.write(json.dumps({"prompt": text + rng.choice(QUESTIONS)}) + "\n")
    return path
