"""ModelCompute's CUDA graphs on the CPU, through FlashInfer's real wrappers
(flashinfer_cpu_harness.py, whole-model stand-in graphs that record every torch
op): a tiny bf16 Llama whose decode and drafted (verify) steps replay captured
graphs gives the tokens and logprobs of the same model run eagerly. Decode
steps are padded to a graph size; drafted steps to max draft + 1 rows a
request and to a graph size in requests; the LM head runs after the replay."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support.draft_driver import DraftDriver
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.execution.model_runner import ModelRunner
from worker_service.sampling.params import LogprobOptions, SamplingParams

pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")

GREEDY = SamplingParams(temperature=0.0)
MAX_DRAFT = 3
PROMPT = [5, 17, 99, 3, 42, 7, 7, 120, 64, 9, 201]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama3-rope-scaling", path)
    return path


def runner(checkpoint, *, graphs: bool) -> ModelRunner:
    worker = worker_for(
        checkpoint,
        device="cpu",
        dtype="bfloat16",
        attention_backend="flashinfer",
        kernels="torch",
        page_size=4,
        num_pages=64,
        overlap="off",
    )
    if graphs:  # what build_worker does on CUDA
        attn = worker.runner.compute.attn
        attn.enable_decode_graphs(worker.runner.num_pages, 16, sizes=(2, 4))
        attn.enable_verify_graphs(MAX_DRAFT + 1, sizes=(2,))
        worker.runner.compute.capture_decode_graphs()
    return worker.runner


def script(r: ModelRunner, greedy: list[int]) -> tuple[list[int], list[float], list[int]]:
    """Prefill, decodes and drafted steps: drafts all right, partly right, wrong,
    shorter than the graphs' rows."""
    d = DraftDriver(r)
    seq = d.start(0, PROMPT, GREEDY, LogprobOptions(top_logprobs_num=2))
    d.decode(seq)
    n = len(seq.outputs)
    d.verify(seq, greedy[n : n + MAX_DRAFT])  # every draft accepted
    n = len(seq.outputs)
    d.verify(seq, [greedy[n], (greedy[n + 1] + 1) % 256])  # one accepted
    d.verify(seq, [(seq.last + 1) % 256])  # none
    d.decode(seq)
    d.verify(seq, greedy[len(seq.outputs) : len(seq.outputs) + 2])
    return seq.outputs, seq.logprobs, seq.counts


@pytest.mark.usefixtures("fi_cpu")
def test_graph_replays_give_the_eager_tokens(monkeypatch, checkpoint) -> None:
    harness.install_model_graph_stand_ins(monkeypatch)
    d = DraftDriver(runner(checkpoint, graphs=False))
    seq = d.start(0, PROMPT, GREEDY)
    for _ in range(16):
        d.decode(seq)
    greedy = seq.outputs

    eager = script(runner(checkpoint, graphs=False), greedy)
    graphed_runner = runner(checkpoint, graphs=True)
    replays: Counter[str] = Counter()
    compute = graphed_runner.compute
    for name in ("graphs", "verify_graphs"):
        graphs = getattr(compute, name)
        real_replay = graphs.replay

        def counted(batch, inputs, _real=real_replay, _name=name):
            out = _real(batch, inputs)
            replays[_name] += out is not None
            return out

        monkeypatch.setattr(graphs, "replay", counted)
    graphed = script(graphed_runner, greedy)

    assert replays == {"graphs": 2, "verify_graphs": 4}
    assert graphed[0] == eager[0] and graphed[2] == eager[2]
    assert eager[2][2:5] == [MAX_DRAFT + 1, 2, 1]  # the drafts were judged as meant
    assert graphed[1] == pytest.approx(eager[1], abs=2e-2)
    assert eager[0][: len(eager[0])] == greedy[: len(eager[0])]
