"""Prometheus metrics of both services, scraped after a known load."""

from __future__ import annotations

import threading

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.metrics import scrape
from tests.e2e.support.system import free_port, separate, stub, wait_until

pytestmark = pytest.mark.slow

NUM_PAGES = 48  # page size 16: 768 tokens for 8 x (20 + 80): retractions


def test_metrics_count_what_happened(tmp_path):
    sched_port, worker_port = free_port(), free_port()
    worker = ["--model", "simulated", "--simulated-step-ms", "2", "--num-pages", str(NUM_PAGES)]
    with separate(
        tmp_path,
        [*worker, "--metrics-port", str(worker_port)],
        ["--metrics-port", str(sched_port)],
    ) as address:
        s = stub(address)

        def one(i: int) -> None:
            req = pb.GenerateRequest(
                request_id=f"m{i}",
                tokenized=pb.TokenizedInput(input_ids=[100 + i] * 20),
                sampling_params=pb.SamplingParams(max_new_tokens=80, ignore_eos=True),
            )
            (r,) = list(s.Generate(req))
            assert len(r.complete.output_ids) == 80

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(grpc.RpcError) as e:
            list(s.Generate(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[]))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_until(lambda: scrape(sched_port)["radixserve_queue_time_seconds_count"] == 8)
        m, w = scrape(sched_port), scrape(worker_port)

    assert m["radixserve_requests_total{finish_reason=length}"] == 8
    assert m["radixserve_requests_total{finish_reason=stop}"] == 0
    assert m["radixserve_request_errors_total{code=INVALID_ARGUMENT}"] == 1
    assert m["radixserve_generation_tokens_total"] == 8 * 80
    assert m["radixserve_prompt_tokens_total"] == 8 * 20
    assert m["radixserve_time_to_first_token_seconds_count"] == 8
    assert m["radixserve_e2e_request_latency_seconds_count"] == 8
    assert m["radixserve_inter_token_latency_seconds_count"] == 8 * 79
    assert m["radixserve_inter_token_latency_seconds_bucket{le=+Inf}"] == 8 * 79
    assert m["radixserve_retractions_total"] > 0
    assert m["radixserve_kv_pages_total"] == NUM_PAGES
    assert m["radixserve_kv_page_size_tokens"] == 16
    assert m["radixserve_requests_running"] == 0 and m["radixserve_requests_waiting"] == 0
    assert [v for k, v in m.items() if k.startswith("radixserve_worker_connected")] == [1.0]
    assert m["process_resident_memory_bytes"] > 0
    ttft_sum = m["radixserve_time_to_first_token_seconds_sum"]
    assert 0 < ttft_sum < m["radixserve_e2e_request_latency_seconds_sum"]

    assert w["radixserve_worker_busy_seconds_total"] > 0
    assert w["radixserve_worker_idle_seconds_total"] > 0
    assert w["radixserve_worker_kv_pages_total"] == NUM_PAGES
    assert w["radixserve_worker_scheduler_connected"] == 1
    assert w["radixserve_worker_requests_active"] == 0
    decode_steps = w["radixserve_worker_step_duration_seconds_count{mode=decode}"]
    assert decode_steps >= 80  # at least one step per token of the longest request
    assert w["radixserve_worker_batch_size_requests_sum"] >= 8 * 80  # every decode entry
    assert w["radixserve_worker_batch_size_tokens_sum"] >= 8 * (20 + 79)
