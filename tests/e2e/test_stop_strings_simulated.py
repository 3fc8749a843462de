"""Stop strings through `radixserve serve` (simulated worker, the default
model's tokenizer for the text): a stop string ends a request before
min_new_tokens, and a stream holds back the tokens whose text may still
become a stop string, sending them once it cannot; the chunks start at the
first token and come every stream_interval tokens otherwise."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from tokenizers import Tokenizer

from common.simulated_model import expected_output
from scheduler_service.core.stop_check import check_stop_text
from tests.e2e.support.system import serve_process, stub

VOCAB = 49152  # the tokenizer's: every simulated token has a text
PROMPT = [1004, 2233, 517, 12000, 88]
# 50 ms steps: each step's token reaches the client alone, so chunk
# boundaries are the server's choice, not a slow reader's.
ENV = {"RADIXSERVE_WORKER_SIMULATED_VOCAB": str(VOCAB), "RADIXSERVE_WORKER_SIMULATED_STEP_MS": "50"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    args = ("--model", "simulated", "--tokenizer", str(tokenizer_dir), "--log-level", "warning")
    with serve_process(tmp_path_factory.mktemp("serve"), *args, env=ENV) as (_, address):
        yield stub(address), tok


def _request(rid: str, stream: bool, **sampling) -> pb.GenerateRequest:
    params = pb.SamplingParams(temperature=0.0, ignore_eos=True, **sampling)
    return pb.GenerateRequest(
        request_id=rid,
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=params,
        stream=stream,
    )


def test_a_stop_string_needs_no_min_new_tokens(setup):
    s, tok = setup
    want = expected_output(PROMPT, 40, VOCAB)
    stop = tok.decode(want[1:2], skip_special_tokens=False).strip()
    assert stop, "the second token spells nothing"
    req = _request("mn", stream=False, max_new_tokens=40, min_new_tokens=20, stop=[stop])
    (done,) = s.Generate(req, timeout=60)
    c = done.complete
    assert c.finish_reason == "stop" and c.matched_stop_str == stop
    assert len(c.output_ids) < 20 and list(c.output_ids) == want[: len(c.output_ids)]


def test_text_that_may_become_a_stop_string_is_held_back(setup):
    s, tok = setup
    n = 24
    want = expected_output(PROMPT, n, VOCAB)
    # the text of tokens 3-5 and a character no token here spells: never completes
    stop = tok.decode(want[3:6], skip_special_tokens=False) + "\u2603\u2603"
    assert stop not in tok.decode(want, skip_special_tokens=False)
    req = _request("held", stream=True, max_new_tokens=n, stop=[stop])
    chunks = [list(r.chunk.token_ids) for r in s.Generate(req, timeout=60) if r.HasField("chunk")]
    assert [t for c in chunks for t in c] == want
    ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
    held = {
        k
        for k in range(1, n + 1)
        if check_stop_text(
            tok.decode(want[max(0, k - 20) : k], skip_special_tokens=False), (stop,)
        ).partial
    }
    assert {3 + 1, 3 + 2, 3 + 3} <= held  # outputs 4-6 spell the stop string's start
    assert not held & set(ends[:-1]), f"a chunk ended where the text was held: {ends}"
    assert set(range(1, n + 1)) - held <= set(ends)  # otherwise a chunk per token


def test_stream_interval_sends_the_first_token_at_once(setup):
    s, _ = setup
    want = expected_output(PROMPT, 10, VOCAB)
    req = _request("si", stream=True, max_new_tokens=10, stream_interval=4)
    chunks = [list(r.chunk.token_ids) for r in s.Generate(req, timeout=60) if r.HasField("chunk")]
    assert [t for c in chunks for t in c] == want
    assert len(chunks[0]) == 1  # token 1 at once
    # then never before the 1 + 4k grid: [1, 4, 4, 1] when each step's token
    # reaches the API alone; a loaded machine may merge two steps' news into
    # one bigger chunk (a slow reader's rule), never an earlier one
    ends = [sum(map(len, chunks[: i + 1])) for i in range(len(chunks))]
    assert all(end >= 1 + 4 * i for i, end in enumerate(ends[:-1])), ends
    assert len(chunks) <= 4
