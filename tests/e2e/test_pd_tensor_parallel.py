"""Prefill/decode disaggregation under tensor parallelism: a prefill unit
and a decode unit of a tiny Llama, each with two CPU ranks (gloo). Each
prefill rank sends its own KV heads' shard to the same rank of the decode
unit (SendKv per rank); the decode unit's greedy tokens must be
transformers' for the whole model, so a shard sent to the wrong rank (or
not at all) fails."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import free_port, greedy, serve, stub
from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_hf_models import tiny_model

STEPS = 10


def test_each_rank_sends_its_shard_to_the_same_rank(tmp_path):
    model_dir = tmp_path / "model"
    hf = tiny_model("llama3-rope-scaling", model_dir)
    assert hf.config.num_key_value_heads >= 2  # each rank holds its own heads
    bport = free_port()
    common = ("--model", str(model_dir), "--tp-size", "2", "--worker-threads", "1")
    common += ("--log-level", "warning", "--check-integrity")
    prefill_args = (*common, "--disaggregation-mode", "prefill")
    prefill_args += ("--disaggregation-bootstrap-port", str(bport))
    decode_args = (*common, "--disaggregation-mode", "decode")
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    dp = pb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=bport, bootstrap_room=5)
    req = pb.GenerateRequest(
        request_id="tp",
        tokenized=pb.TokenizedInput(input_ids=prompt),
        sampling_params=greedy(STEPS, ignore_eos=True),
        disaggregated_params=dp,
    )
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    with (
        serve(tmp_path / "p", *prefill_args) as p,
        serve(tmp_path / "d", *decode_args) as d,
        ThreadPoolExecutor(2) as pool,
    ):
        calls = [pool.submit(lambda a=a: list(stub(a).Generate(req, timeout=120))) for a in (p, d)]
        # The prefill unit answers at once with a chunk without tokens.
        on_p, on_d = (c.result(150)[-1] for c in calls)
    want = hf_greedy(hf, prompt, STEPS)[0]
    assert list(on_d.complete.output_ids) == want
    assert list(on_p.complete.output_ids) == want[:1]
