"""The multi-turn chat workload (``--dataset multiturn``): conversations of
real text whose every turn sends the whole conversation so far.

A conversation opens with an optional system prompt (a document of prose,
shared by all conversations or one per conversation) and its first
question; the prompt of turn t > 0 is, exactly,

    ids(t)  = ids(t - 1)  + answer_ids(t - 1)  + ids(suffix(t))
    text(t) = text(t - 1) + answer_text(t - 1) + suffix(t)

where the answer is what the server generated for turn t - 1 (its trailing
special tokens, EOS, left out) and suffix(t) is what the chat template
renders between that answer and the next one: the end of the assistant's
turn, the user's turn with question t, the assistant's header. Without a
template (``--skip-chat-template``) the turns are ``User: ...`` /
``Assistant:`` lines. A driver that sees the answer's ids extends the ids
(radixserve's gRPC API: the prompt grows token for token, as a radix cache
sees a chat); one that sees only text (an OpenAI endpoint) sends the text.

A question is a passage of prose cut to a token budget with one of the text
workload's questions after it. The working set (``distinct_prefix_tokens``)
is the number of tokens a radix tree needs to hold every conversation whole:
what a cache must keep so that no turn recomputes its history.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from clients.bench.records import BenchRequest
from clients.bench.text_workloads import QUESTIONS, passage_text
from clients.bench.workloads import WorkloadError
from clients.tokenizer_bundle import TokenizerBundle

SYSTEM_HEADER = (
    "You are a helpful assistant. Answer the user's questions about the reference "
    "text below and about anything said earlier in the conversation.\n\n"
)
# Stands for an answer while a template renders the turn after it.
_ANSWER = "\x00answer\x00"


@dataclass(frozen=True, slots=True)
class ConversationPlan:
    """What a conversation will ask; its prompts wait for the answers."""

    index: int
    system: str | None
    questions: tuple[str, ...]
    output_len: int


def plan_conversations(
    tokenizer: TokenizerBundle,
    paragraphs: list[str],
    *,
    conversations: int,
    turns: int,
    question_len: int,
    output_len: int,
    system_prompt_len: int = 0,
    unique_system_prompts: bool = False,
    seed: int = 1,
) -> list[ConversationPlan]:
    """``conversations`` plans of ``turns`` questions of at most
    ``question_len`` tokens each (a passage, a blank line, a question); a
    system prompt of about ``system_prompt_len`` tokens (0: none), the same
    for all unless ``unique_system_prompts``. The seed picks everything."""
    for name, value in (("conversations", conversations), ("turns", turns)):
        if value < 1:
            raise WorkloadError(f"--mt-{name} must be at least 1")
    if question_len < 1 or output_len < 1 or system_prompt_len < 0:
        raise WorkloadError("--mt-question-len and --mt-output-len must be at least 1")
    if not paragraphs:
        raise WorkloadError("the multi-turn workload needs prose: no paragraphs")
    rng = random.Random(f"multiturn-{seed}")
    para_len: dict[int, int] = {}

    def passage(budget: int) -> str:
        if budget < 1:
            return ""
        return passage_text(
            tokenizer, paragraphs, rng.randrange(len(paragraphs)), budget, para_len=para_len
        )

    def system() -> str | None:
        if system_prompt_len == 0:
            return None
        header = len(tokenizer.encode(SYSTEM_HEADER))
        return SYSTEM_HEADER + passage(max(1, system_prompt_len - header))

    shared = system() if not unique_system_prompts else None
    plans = []
    for c in range(conversations):
        own = system() if unique_system_prompts else shared
        questions = []
        for _ in range(turns):
            q = rng.choice(QUESTIONS)
            text = passage(question_len - len(tokenizer.encode(q)) - 2)
            questions.append(f"{text}\n\n{q}" if text else q)
        plans.append(ConversationPlan(c, own, tuple(questions), output_len))
    return plans


class ChatFormat:
    """How turns become prompt text: through the model's chat template (or
    plain ``User:`` / ``Assistant:`` lines, ``chat=False`` or no template)."""

    def __init__(self, tokenizer: TokenizerBundle, chat: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chat = chat and tokenizer.chat_template is not None
        added = tokenizer.tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)

    def ids(self, text: str) -> list[int]:
        """Token ids of prompt text (the template's special tokens parsed, no
        BOS added: the template writes its own)."""
        return self.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    def opening(self, system: str | None, question: str) -> str:
        """The first turn's prompt."""
        if not self.chat:
            head = f"{system}\n\n" if system else ""
            return f"{head}User: {question}\nAssistant:"
        return self.tokenizer.chat_text(_messages(system, [], question))

    def suffix(self, system: str | None, history: Sequence[tuple[str, str]], question: str) -> str:
        """What follows the last answer of ``history`` ((question, answer)
        pairs) up to the next answer: the template rendered with a stand-in
        answer, cut after it."""
        if not self.chat:
            return f"\nUser: {question}\nAssistant:"
        past = [*history[:-1], (history[-1][0], _ANSWER)]
        text = self.tokenizer.chat_text(_messages(system, past, question))
        head, found, tail = text.rpartition(_ANSWER)
        if not found or _ANSWER in head:
            raise WorkloadError("the chat template does not write the assistant's answers as given")
        return tail

    def answer(self, ids: Sequence[int]) -> list[int]:
        """A generated answer without its trailing special tokens (EOS):
        the template closes the turn itself."""
        end = len(ids)
        while end and ids[end - 1] in self.special_ids:
            end -= 1
        return list(ids[:end])


def _messages(
    system: str | None, history: Iterable[tuple[str, str]], question: str
) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system else []
    for q, a in history:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    out.append({"role": "user", "content": question})
    return out


@dataclass
class Conversation:
    """One conversation's state: the prompt of its next turn, the turns
    answered so far (question, answer text)."""

    plan: ConversationPlan
    fmt: ChatFormat
    turn: int = 0
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    history: list[tuple[str, str]] = field(default_factory=list)
    last_answer_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_text = self.fmt.opening(self.plan.system, self.plan.questions[0])
        self.prompt_ids = self.fmt.ids(self.prompt_text)

    @property
    def done(self) -> bool:
        return self.turn >= len(self.plan.questions)

    def request(self, seed: int | None = None) -> BenchRequest:
        """The current turn's request (index: conversation x turns + turn)."""
        turns = len(self.plan.questions)
        return BenchRequest(
            self.plan.index * turns + self.turn,
            list(self.prompt_ids),
            self.plan.output_len,
            group=self.plan.index,
            text=self.plan.questions[self.turn],
            prompt_text=self.prompt_text,
            seed=seed,
        )

    def answer(self, ids: Sequence[int] | None, text: str | None = None) -> None:
        """Take the current turn's answer: its ids (then its text is their
        decoding) or, from a driver that sees only text, its text. The next
        turn's prompt is this prompt + the answer + the next question."""
        if ids is not None:
            answer_ids = self.fmt.answer(ids)
            text = self.fmt.tokenizer.decode(answer_ids)
        elif text is not None:
            answer_ids = self.fmt.ids(text)
        else:
            raise ValueError("an answer needs its ids or its text")
        self.history.append((self.plan.questions[self.turn], text))
        self.last_answer_ids = answer_ids
        self.turn += 1
        if self.done:
            return
        suffix = self.fmt.suffix(self.plan.system, self.history, self.plan.questions[self.turn])
        self.prompt_text = self.prompt_text + text + suffix
        self.prompt_ids = self.prompt_ids + answer_ids + self.fmt.ids(suffix)

    def tokens(self) -> list[int]:
        """Everything the conversation holds: its last prompt, and that
        prompt's answer once the conversation is done."""
        return self.prompt_ids + self.last_answer_ids if self.done else list(self.prompt_ids)


def distinct_prefix_tokens(sequences: Iterable[Sequence[int]]) -> int:
    """Tokens a radix tree needs to hold all the sequences (each prefix that
    two share counted once): over the sorted sequences, each one's length
    less its common prefix with the one before it."""
    total, prev = 0, ()
    for s in sorted(tuple(x) for x in sequences):
        common = 0
        for a, b in zip(prev, s, strict=False):
            if a != b:
                break
            common += 1
        total += len(s) - common
        prev = s
    return total


def planned_working_set(plans: Sequence[ConversationPlan], fmt: ChatFormat) -> int:
    """The distinct prefix tokens of the whole workload, every answer taken
    at its full ``output_len`` (an upper bound where answers end at EOS)."""
    return distinct_prefix_tokens(planned_sequences(plans, fmt))


def planned_sequences(plans: Sequence[ConversationPlan], fmt: ChatFormat) -> list[list[int]]:
    """Each conversation's tokens at its end, every answer ``output_len``
    stand-in ids long (ids no tokenizer has, so no two answers match)."""
    sequences = []
    for p in plans:
        filler = [-1 - p.index] * p.output_len  # no real id: no two answers share
        text = fmt.opening(p.system, p.questions[0])
        ids = fmt.ids(text)
        history: list[tuple[str, str]] = []
        for q_prev, q in zip(p.questions, p.questions[1:], strict=False):
            history.append((q_prev, ""))
            ids += filler + fmt.ids(fmt.suffix(p.system, history, q))
        sequences.append(ids + filler)
    return sequences
