"""radixserve serve with tensor parallelism, metrics and tokenizer export."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from transformers import AutoTokenizer

from tests.e2e.support.system import free_port, greedy, serve, stub
from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.tiny_hf_models import tiny_model

BIN = Path(sys.executable).parent


def test_tensor_parallel_serve_matches_transformers_and_serves_metrics(tmp_path):
    model_dir = tmp_path / "model"
    hf = tiny_model("llama3-rope-scaling", model_dir)
    metrics = free_port()
    args = (
        "--model",
        str(model_dir),
        "--tp-size",
        "2",
        "--worker-threads",
        "1",
        "--metrics-port",
        str(metrics),
        "--log-level",
        "warning",
    )
    prompts = [[5, 6, 7, 8, 9], [200, 100, 50]]
    with serve(tmp_path, *args) as address:
        s = stub(address)
        info = s.GetServerInfo(pb.GetServerInfoRequest())
        assert info.server_args["tp_size"] == 2
        for p in prompts:
            (r,) = list(
                s.Generate(
                    pb.GenerateRequest(
                        tokenized=pb.TokenizedInput(input_ids=p),
                        sampling_params=greedy(12, ignore_eos=True),
                    )
                )
            )
            assert list(r.complete.output_ids) == hf_greedy(hf, p, 12)[0]

        def scrape(port: int) -> str:
            url = f"http://127.0.0.1:{port}/metrics"
            return urllib.request.urlopen(url, timeout=10).read().decode()

        text = scrape(metrics)
        assert "radixserve_generation_tokens_total 24.0" in text
        assert "radixserve_kv_pages_total" in text
        for rank in range(2):  # the workers serve theirs on the next ports
            assert "radixserve_worker_busy_seconds_total" in scrape(metrics + 1 + rank)


def test_original_text_is_tokenized_by_the_server(smollm2_address, tmp_path):
    s = stub(smollm2_address)
    text = "The capital of France is"
    (by_text,) = list(
        s.Generate(
            pb.GenerateRequest(
                tokenized=pb.TokenizedInput(original_text=text), sampling_params=greedy(4)
            )
        )
    )
    out = subprocess.run(
        [str(BIN / "radixserve"), "export-tokenizer", str(tmp_path / "tok")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ids = tok.encode(text)
    (by_ids,) = list(
        s.Generate(
            pb.GenerateRequest(
                tokenized=pb.TokenizedInput(input_ids=ids), sampling_params=greedy(4)
            )
        )
    )
    assert by_text.complete.prompt_tokens == len(ids)
    assert list(by_text.complete.output_ids) == list(by_ids.complete.output_ids)
