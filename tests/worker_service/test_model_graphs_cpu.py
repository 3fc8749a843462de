"""ModelCompute's CUDA graphs on the CPU, through FlashInfer's real wrappers
(flashinfer_cpu_harness.py, whole-model stand-in graphs that record every torch
op): a tiny bf16 Llama whose decode, drafted (verify) and LoRA decode steps
replay captured graphs gives the tokens and logprobs of the same model run
eagerly. Decode steps are padded to a graph size; drafted steps to max draft
+ 1 rows a request and to a graph size in requests; LoRA decode steps read
their adapters from fixed slots; the LM head runs after the replay. A model
whose layers alternate sliding and full attention (layer groups: one FlashInfer
backend per group) replays its graphs too."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from tests.support.lora_adapters import make_adapter
from tests.worker_service.support import flashinfer_cpu_harness as harness
from tests.worker_service.support.draft_driver import DraftDriver
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import tiny_model
from tests.worker_service.support.worker_factory import worker_for
from worker_service.attention.layer_groups import GroupedGraphAttention
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import AdapterSlot
from worker_service.lora.graph_slots import LoraSlots
from worker_service.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from worker_service.models.lora_loader import lora_targets
from worker_service.sampling.params import LogprobOptions, SamplingParams

pytest.importorskip("flashinfer", reason="flashinfer-python is not installed")

GREEDY = SamplingParams(temperature=0.0)
MAX_DRAFT = 3
PROMPT = [5, 17, 99, 3, 42, 7, 7, 120, 64, 9, 201]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "llama"
    return path, tiny_model("llama3-rope-scaling", path)


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return tiny[0]


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
        attn.enable_decode_graphs(worker.runner.compute.scratch_page, 16, sizes=(2, 4))
        attn.enable_verify_graphs(MAX_DRAFT + 1, sizes=(2,))
        worker.runner.compute.capture_decode_graphs()
    return worker.runner


def alternate_windows(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    """The tiny Llama read as a model whose layers alternate a ``window``-token
    sliding window and full attention (Gemma 2 / GPT-OSS's pattern)."""
    read = ModelConfig.from_hf.__func__

    def from_hf(cls, cfg):
        mcfg = read(cls, cfg)
        types = (SLIDING_ATTENTION, FULL_ATTENTION) * (mcfg.num_layers // 2)
        return dataclasses.replace(mcfg, sliding_window=window, layer_types=types)

    monkeypatch.setattr(ModelConfig, "from_hf", classmethod(from_hf))


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


@pytest.mark.usefixtures("fi_cpu")
def test_a_grouped_models_graph_replays_give_the_eager_tokens(monkeypatch, checkpoint) -> None:
    """Decode and verify graphs over both groups' backends: the tokens and
    logprobs of the eager grouped model, which the window changes."""
    harness.install_model_graph_stand_ins(monkeypatch)
    full_attention = runner(checkpoint, graphs=False)  # read before the windows
    alternate_windows(monkeypatch, window=4)
    d = DraftDriver(runner(checkpoint, graphs=False))
    seq = d.start(0, PROMPT, GREEDY)
    for _ in range(16):
        d.decode(seq)
    greedy = seq.outputs
    eager = script(runner(checkpoint, graphs=False), greedy)
    graphed_runner = runner(checkpoint, graphs=True)
    attn = graphed_runner.compute.attn
    assert isinstance(attn, GroupedGraphAttention)
    assert graphed_runner.num_swa_pages > 0  # two KV pools: each group pads its own
    assert {g: b.spec.sliding_window for g, b in attn.backends.items()} == {
        "full": None,
        "sliding": 4,
    }
    replays: Counter[str] = Counter()
    for name in ("graphs", "verify_graphs"):
        graphs = getattr(graphed_runner.compute, name)
        real_replay = graphs.replay

        def counted(batch, inputs, _real=real_replay, _name=name):
            out = _real(batch, inputs)
            replays[_name] += out is not None
            return out

        monkeypatch.setattr(graphs, "replay", counted)
    graphed = script(graphed_runner, greedy)
    assert replays == {"graphs": 2, "verify_graphs": 4}
    assert graphed[0] == eager[0] and graphed[2] == eager[2]
    assert graphed[1] == pytest.approx(eager[1], abs=2e-2)
    full = script(full_attention, greedy)
    # The prompt's and the first decode's samples (before any draft): the
    # sliding layers saw less than full attention would have.
    assert full[1][:2] != pytest.approx(eager[1][:2], abs=2e-2)


ADAPTERS = {
    "a": (8, ["q_proj", "v_proj", "down_proj"]),
    "b": (4, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
}


@pytest.mark.usefixtures("fi_cpu")
def test_lora_decode_graphs_give_the_eager_tokens(monkeypatch, tiny, tmp_path) -> None:
    """Two adapters in two slots and base rows in one decode step, through one
    graph per size; the same requests run eagerly (batch.py's grouped path)."""
    harness.install_model_graph_stand_ins(monkeypatch)
    path, hf = tiny
    dirs = {
        name: make_adapter(tmp_path, name, r, modules, seed=i + 1, base=hf)
        for i, (name, (r, modules)) in enumerate(ADAPTERS.items())
    }
    outputs = []
    replays = Counter()
    for graphs in (False, True):
        worker = worker_for(
            path,
            device="cpu",
            dtype="bfloat16",
            attention_backend="flashinfer",
            kernels="torch",
            page_size=4,
            num_pages=128,
            overlap="off",
        )
        for name, directory in dirs.items():
            worker.runner.adapters.put(worker.adapter_loader.load(name, directory, 0))
        compute = worker.runner.compute
        if graphs:
            attn = compute.attn
            attn.enable_decode_graphs(worker.runner.num_pages, 16, sizes=(2, 4))
            compute.lora_slots = LoraSlots.create(
                lora_targets(compute.model),
                slots=2,
                max_rank=8,
                dtype=compute.kv.dtype,
                device=compute.device,
            )
            compute.capture_decode_graphs()
            real_replay = compute.lora_graphs.replay

            def counted(batch, inputs, _real=real_replay):
                out = _real(batch, inputs)
                replays["lora"] += out is not None
                return out

            monkeypatch.setattr(compute.lora_graphs, "replay", counted)
        reqs = [
            DriverRequest(PROMPT, 6, adapter_slot=1),
            DriverRequest(PROMPT, 6, adapter_slot=2),
            DriverRequest(PROMPT, 6),
            DriverRequest(PROMPT[:5], 6, adapter_slot=1),
        ]
        slots = [AdapterSlot(1, "a"), AdapterSlot(2, "b")]
        PlanDriver(worker.runner, 4).run(reqs, adapter_slots=slots)
        outputs.append([(r.outputs, r.logprob_values) for r in reqs])
    (eager, graphed) = outputs
    assert replays["lora"] >= 4
    for (e_tokens, e_lps), (g_tokens, g_lps) in zip(eager, graphed, strict=True):
        assert g_tokens == e_tokens
        assert g_lps == pytest.approx(e_lps, abs=2e-2)
    # The adapters change the tokens: the slots are not read as empty.
    assert len({tuple(tokens) for tokens, _ in eager[:3]}) == 3
