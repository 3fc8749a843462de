"""Speculative decoding through the public API with simulated workers: a
repeated prompt is drafted from the cached first answer (every draft right),
outputs never change, per-request opt-out, and the counters in
GenerateComplete and /metrics agree."""

from __future__ import annotations

import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from common.simulated_model import expected_output
from tests.e2e.support.sim_server import VOCAB, assert_idle_and_clean, simulated_server
from tests.e2e.support.system import free_port, greedy, scrape_metric, stub

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    args = ("--metrics-port", str(port), "--speculative-max-draft", "6")
    with simulated_server(
        tmp_path_factory.mktemp("spec"), num_pages=256, scheduler_args=args
    ) as address:
        yield address, port


def generate(s, ids, sampling, rid) -> pb.GenerateComplete:
    req = pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=sampling
    )
    (r,) = list(s.Generate(req, timeout=30))
    return r.complete


def test_repeated_prompt_is_drafted_from_the_cache_and_outputs_are_unchanged(server):
    address, port = server
    s = stub(address)
    expected = expected_output(PROMPT, 60, VOCAB)
    first = generate(s, PROMPT, greedy(60, ignore_eos=True), "first")
    assert list(first.output_ids) == expected
    second = generate(s, PROMPT, greedy(60, ignore_eos=True), "second")
    assert list(second.output_ids) == expected
    # The whole first answer sits in the cache after the prompt: drafts are right.
    assert second.spec_draft_tokens >= 40
    assert second.spec_accepted_tokens == second.spec_draft_tokens
    drafted = scrape_metric(port, "radixserve_spec_draft_tokens_total")
    accepted = scrape_metric(port, "radixserve_spec_accepted_tokens_total")
    assert drafted >= first.spec_draft_tokens + second.spec_draft_tokens
    assert accepted >= second.spec_accepted_tokens
    assert scrape_metric(port, "radixserve_spec_verify_steps_total") > 0
    assert_idle_and_clean(s)


def test_per_request_opt_out_drafts_nothing(server):
    address, _ = server
    s = stub(address)
    generate(s, PROMPT[:-1], greedy(30, ignore_eos=True), "warm")
    params = Struct()
    params.update({"speculative": False})
    off = generate(s, PROMPT[:-1], greedy(30, ignore_eos=True, custom_params=params), "off")
    assert (off.spec_draft_tokens, off.spec_accepted_tokens) == (0, 0)
    assert list(off.output_ids) == expected_output(PROMPT[:-1], 30, VOCAB)


def test_stop_inside_a_drafted_run_ends_where_plain_decoding_would(server):
    address, _ = server
    s = stub(address)
    prompt = [21, 22, 23, 24]
    full = expected_output(prompt, 40, VOCAB)
    generate(s, prompt, greedy(40, ignore_eos=True), "seed-cache")
    stop = full[17]
    cut = generate(s, prompt, greedy(40, stop_token_ids=[stop]), "stopped")
    assert list(cut.output_ids) == full[: full.index(stop) + 1]
    assert cut.finish_reason == "stop" and cut.matched_token_id == stop
    short = generate(s, prompt, greedy(9, ignore_eos=True), "short")
    assert list(short.output_ids) == full[:9] and short.finish_reason == "length"
    assert_idle_and_clean(s)
