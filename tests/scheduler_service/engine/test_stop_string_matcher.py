"""The core process's stop-string matcher on a real tokenizers.Tokenizer, and
what crosses the pipe: the tail decoded with special tokens kept (SGLang's
tail_str), so a special-token stop string matches under
skip_special_tokens=true; a tail that may still become a stop string
reaches the API process as a holding delta."""

from __future__ import annotations

import pickle

from tokenizers import Tokenizer, models, pre_tokenizers

from protos import worker_pb2 as pb
from scheduler_service import ipc
from scheduler_service.core.config import SchedulerConfig
from scheduler_service.core.request import Request
from scheduler_service.core.sampling import SamplingParams
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.stop_check import StopCheck
from scheduler_service.engine.loop import Engine
from scheduler_service.engine.stop_strings import StopStringMatcher

WORDS = ["[UNK]", "hello", "world", "again", "<|im_end|>"]
HELLO, WORLD, AGAIN, IM_END = 1, 2, 3, 4


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_end|>"])
    return tok


def _req(output: list[int], *stops: str, skip_special_tokens: bool = True) -> Request:
    sp = SamplingParams(stop_strs=stops, skip_special_tokens=skip_special_tokens)
    r = Request("r", [HELLO], sp)
    r.output_ids = output
    return r


def test_a_special_token_stop_string_matches_whatever_skip_special_tokens_says():
    match = StopStringMatcher(_tokenizer())
    for skip in (True, False):
        r = _req([HELLO, IM_END], "<|im_end|>", skip_special_tokens=skip)
        assert match(r) == StopCheck("<|im_end|>", False)


def test_the_tail_says_when_it_may_still_become_a_stop_string():
    match = StopStringMatcher(_tokenizer())
    assert match(_req([AGAIN, HELLO], "hello world")) == StopCheck(None, True)
    assert match(_req([HELLO, AGAIN], "hello world")) == StopCheck(None, False)
    assert match(_req([HELLO, WORLD], "hello world")) == StopCheck("hello world", False)


class _Conn:
    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(pickle.loads(pickle.dumps(msg)))  # as the pipe carries it


def test_holding_and_the_match_cross_the_pipe():
    cfg = SchedulerConfig(page_size=4, max_running_requests=8, vocab_size=len(WORDS))
    sched = Scheduler(cfg, 64, stop_strings=StopStringMatcher(_tokenizer()))
    sp = SamplingParams(max_new_tokens=8, stop_strs=("hello world",), min_new_tokens=6)
    sched.add_request(Request("r", [AGAIN], sp))
    conn = _Conn()
    eng = Engine(sched, None, conn, overlap_depth=1, recovery_timeout_s=60)
    seen: list[ipc.DeltaOut] = []
    for token in (HELLO, AGAIN, HELLO, WORLD):
        plan = sched.step()
        eng.codec.encode(plan)
        result = pb.StepResult(step_id=plan.step_id, token_ids=[token])
        sched.update(eng.codec.decode(result, plan))
        eng._publish()
        seen += [d for m in conn.sent for d in m.items()]
        conn.sent.clear()
    assert [(d.token_ids, d.holding) for d in seen] == [
        ([HELLO], True),
        ([AGAIN], False),
        ([HELLO], True),
        ([WORLD], False),
    ]
    # before min_new_tokens (6): only stop ids wait for it, as in SGLang
    assert seen[-1].finish == ipc.Finish("stop", matched_str="hello world")
