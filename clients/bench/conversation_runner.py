"""Sends multi-turn conversations through a driver: a closed loop per
conversation (a turn is built from the previous turn's answer, so it is
sent only once that answer has ended, after a think time), all
conversations at once, optionally at most ``max_concurrency`` turns in
flight among them."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from clients.bench.conversations import Conversation, distinct_prefix_tokens
from clients.bench.drivers import Driver
from clients.bench.records import RequestRecord
from clients.bench.runner import Run, error_text
from clients.bench.sampling import SEED_RANGE

NOT_SENT = "not sent: an earlier turn of its conversation failed"
NO_ANSWER = "the driver returned neither the answer's ids nor its text: the conversation ends"


@dataclass(frozen=True, slots=True)
class ThinkTime:
    """The user's pause between an answer's end and the next question
    (and before a conversation's first one, so they do not all start at
    once): exponential with this mean, or always the mean (``fixed``)."""

    mean_s: float = 1.0
    distribution: str = "exponential"

    def __post_init__(self) -> None:
        if self.mean_s < 0 or not math.isfinite(self.mean_s):
            raise ValueError("the think time's mean must be a number >= 0")
        if self.distribution not in ("exponential", "fixed"):
            raise ValueError(f"unknown think-time distribution {self.distribution!r}")

    def draw(self, rng: random.Random) -> float:
        if self.mean_s == 0 or self.distribution == "fixed":
            return self.mean_s
        return rng.expovariate(1.0 / self.mean_s)


def turn_seeds(conversations: int, turns: int, run_seed: int, sampled: bool) -> list[int | None]:
    """A sampling seed per turn (conversation-major), distinct within the
    run, when the run samples with seeds; else None each."""
    if not sampled:
        return [None] * (conversations * turns)
    rng = random.Random(f"request-seeds-{run_seed}")
    return list(rng.sample(range(SEED_RANGE), conversations * turns))


async def run_conversations(
    driver: Driver,
    conversations: Sequence[Conversation],
    *,
    think: ThinkTime,
    max_concurrency: int | None = None,
    seed: int = 0,
    sampled_seeds: bool = False,
    progress: bool = True,
) -> Run:
    """Every turn of every conversation, in order within a conversation. A
    failed turn ends its conversation (its later turns are recorded as not
    sent). ``Run.extra``: turns planned and completed, conversations
    completed, and the working set the run built (distinct prefix tokens
    of the conversations as they ended)."""
    from tqdm.auto import tqdm

    turns = max(len(c.plan.questions) for c in conversations) if conversations else 0
    seeds = turn_seeds(len(conversations), turns, seed, sampled_seeds)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: dict[int, RequestRecord] = {}
    planned = sum(len(c.plan.questions) for c in conversations)
    bar = tqdm(total=planned, disable=not progress, unit="turn", dynamic_ncols=True)
    t0 = time.perf_counter()

    async def one_turn(conv: Conversation) -> RequestRecord:
        req = conv.request(seeds[conv.plan.index * turns + conv.turn])
        record = RequestRecord(req.index, len(req.prompt_ids), 0.0)
        records[req.index] = record
        if slots is not None:
            await slots.acquire()
        try:
            record.start_s = time.perf_counter() - t0
            await driver.send(req, record, t0)
            if not record.token_times and record.error is None:
                record.error = "the server returned no tokens"
        except Exception as e:  # recorded; the other conversations go on
            record.error = error_text(e)
        finally:
            if slots is not None:
                slots.release()
            bar.update(1)
        return record

    async def converse(conv: Conversation) -> None:
        rng = random.Random(f"think-{seed}-{conv.plan.index}")
        while not conv.done:
            await asyncio.sleep(think.draw(rng))
            record = await one_turn(conv)
            if not record.ok:
                return
            if not record.output_ids and not record.output_text:
                record.error = NO_ANSWER
                return
            if record.output_ids:
                conv.answer(record.output_ids)
            else:
                conv.answer(None, record.output_text)

    try:
        await asyncio.gather(*(converse(c) for c in conversations))
    finally:
        bar.close()
    for c in conversations:  # the turns a failure left unsent
        for t in range(len(c.plan.questions)):
            index = c.plan.index * turns + t
            if index not in records:
                records[index] = RequestRecord(index, 0, 0.0, error=NOT_SENT)
    ordered = [records[i] for i in sorted(records)]
    ends = [r.token_times[-1] for r in ordered if r.token_times]
    duration = max(ends, default=time.perf_counter() - t0)
    extra = {
        "turns_planned": planned,
        "turns_completed": sum(r.ok for r in ordered),
        "conversations": len(conversations),
        "conversations_completed": sum(
            all(records[c.plan.index * turns + t].ok for t in range(len(c.plan.questions)))
            for c in conversations
        ),
        "working_set_tokens": distinct_prefix_tokens(c.tokens() for c in conversations),
    }
    return Run(ordered, duration, extra)
