"""The mixture-of-experts families against Hugging Face transformers on the
same weights (fp32, CPU), as test_models_vs_hf.py checks the Llama family:
tiny random checkpoints of Qwen3-MoE (with and without norm_topk_prob),
Mixtral, OLMoE and GPT-OSS (sinks, a sliding layer and a full one, yarn);
greedy tokens identical over 64 new tokens and chosen-token logprobs within
1e-4, in mixed batches of long and short requests, page sizes 1 and 16,
prompts split into chunks, a prefix read from pages an earlier request
wrote. Drafted extends (speculative decoding) give plain decoding's tokens;
LoRA adapters reach the attention projections and are refused on the
experts."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.support.hf_reference import hf_greedy
from tests.support.lora_adapters import ATTENTION, MLP, make_adapter, peft_greedy
from tests.worker_service.support.draft_driver import DraftDriver
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.tiny_moe_models import MOE_ARCHITECTURES, tiny_moe_model
from tests.worker_service.support.worker_factory import runner_for, worker_for
from worker_service.execution.model_runner import ModelRunner
from worker_service.execution.plan import AdapterSlot
from worker_service.lora.adapter import AdapterError
from worker_service.sampling.grammar import GrammarCompiler
from worker_service.sampling.params import LogprobOptions, SamplingParams

STEPS = 64
# Tiny models: one thread each (the machine's cores are shared; several
# threads contending for them make each small op wait).
ONE_THREAD = {"threads": 1}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """arch -> (directory, transformers model, greedy reference by prompt), built once."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            hf = tiny_moe_model(arch, path)
            made[arch] = (path, hf, functools.cache(lambda p: hf_greedy(hf, list(p), STEPS)))
        return made[arch]

    return get


def workload(seed: int) -> list[DriverRequest]:
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(40)
    return [
        DriverRequest(shared + rand(7), STEPS, arrive=0),
        DriverRequest(rand(23), STEPS, arrive=1),
        DriverRequest(shared + rand(12), STEPS, arrive=4, share_from=0),  # cached prefix
        DriverRequest(rand(97), STEPS, arrive=6),  # long: several chunks
        DriverRequest(rand(3), STEPS, arrive=9),
    ]


@pytest.mark.slow  # transformers references
@pytest.mark.parametrize("arch", sorted(MOE_ARCHITECTURES))
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_greedy_tokens_and_logprobs_match_hf(arch, page_size, chunk, checkpoint):
    path, _, reference = checkpoint(arch)
    runner = runner_for(path, page_size=page_size, num_pages=4096 // page_size, **ONE_THREAD)
    reqs = PlanDriver(runner, page_size, chunk=chunk).run(workload(seed=0))
    assert reqs[2].pages[: 40 // page_size] == reqs[0].pages[: 40 // page_size]
    for r in reqs:
        tokens, logprobs = reference(tuple(r.prompt))
        assert r.outputs == tokens, f"request {r.slot}"
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < 1e-4
    assert len({t for r in reqs for t in r.outputs}) > 20  # text, not one token repeated


@pytest.mark.slow
def test_drafted_extends_give_plain_decodings_tokens(tmp_path):
    hf = tiny_moe_model("qwen3-moe", tmp_path)
    runner = runner_for(tmp_path, page_size=4, num_pages=256, overlap="off", **ONE_THREAD)
    greedy, lp = SamplingParams(temperature=0.0), LogprobOptions(return_logprob=True)
    prompt = list(range(30, 50))
    driver = DraftDriver(runner)
    plain = driver.start(0, prompt, greedy, lp)
    for _ in range(11):
        driver.decode(plain)
    want, want_logprobs = hf_greedy(hf, prompt, 12)
    assert plain.outputs == want
    drafted = driver.start(1, prompt, greedy, lp)
    # Right drafts, then one wrong one: 4 tokens, then 2.
    assert driver.verify(drafted, want[1:4]) == want[1:5]
    assert driver.verify(drafted, [want[5], (want[6] + 1) % VOCAB]) == want[5:7]
    while len(drafted.outputs) < 12:
        driver.decode(drafted)
    assert drafted.outputs == want
    assert drafted.logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.slow
def test_lora_on_the_attention_projections_matches_peft_and_experts_are_refused(tmp_path):
    hf = tiny_moe_model("qwen3-moe", tmp_path / "model")
    adapter = make_adapter(tmp_path / "adapters", "attn", 4, ATTENTION, seed=5, base=hf)
    worker = worker_for(
        tmp_path / "model", page_size=4, num_pages=256, swa_memory=False, **ONE_THREAD
    )
    worker.runner.adapters.put(worker.adapter_loader.load("attn", adapter, 0))
    prompt = list(range(60, 75))
    reqs = [DriverRequest(prompt, 12, adapter_slot=1), DriverRequest(prompt, 12)]
    reqs = PlanDriver(worker.runner, 4).run(reqs, adapter_slots=[AdapterSlot(1, "attn")])
    want = peft_greedy(adapter, prompt, 12, base=hf)[0]
    assert reqs[0].outputs == want
    assert reqs[1].outputs == hf_greedy(hf, prompt, 12)[0] != want
    # PEFT cannot even draw one on the MoE model (its experts are no
    # nn.Linear): a dense model of the same shape trained it.
    dense = tiny_model("qwen3-qk-norm", tmp_path / "dense")
    mlp = make_adapter(tmp_path / "adapters", "mlp", 4, MLP, seed=6, base=dense)
    with pytest.raises(AdapterError, match=r"not LoRA targets of this model .*mixture of experts"):
        worker.adapter_loader.load("mlp", mlp, 0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral", "olmoe"])
def test_stacked_expert_tensors_load_as_the_per_expert_checkpoint_does(arch, checkpoint):
    """transformers 5 holds the experts stacked (``mlp.experts.gate_up_proj``
    (E, 2I, hidden), ``down_proj``), as some checkpoints are saved; its
    save_pretrained writes them per expert. Both load to the same weights."""
    path, hf, _ = checkpoint(arch)
    from_file = runner_for(path, page_size=4, num_pages=16, **ONE_THREAD).compute.model
    state = hf.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    from_memory = runner_for(path, page_size=4, num_pages=16, **ONE_THREAD).compute.model
    from_memory.load_weights(
        (name, t) for name, t in state.items() if not name.endswith("rotary_emb.inv_freq")
    )
    mine = dict(from_file.named_parameters())
    for name, param in from_memory.named_parameters():
        assert torch.equal(param, mine[name]), name


@pytest.mark.slow
def test_a_grammar_constrains_a_moe_model_to_transformers_masked_argmax(checkpoint):
    """The regex allows a..e six times: each token is the argmax of
    transformers' logits over those five bytes (the tiny vocabulary read as
    raw bytes, as the simulated model's is)."""
    import xgrammar as xgr

    path, hf, _ = checkpoint("gpt-oss")
    worker = worker_for(path, page_size=4, num_pages=64, swa_memory=False, **ONE_THREAD)
    info = xgr.TokenizerInfo(
        [bytes([i]) for i in range(VOCAB)], xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[0]
    )
    runner = ModelRunner(
        worker.runner.compute,
        num_pages=worker.num_pages,
        page_size=4,
        vocab_size=VOCAB,
        grammars=GrammarCompiler(lambda: info, processes=1),
    )
    prompt = list(range(100, 130))
    sampling = SamplingParams(temperature=0.0, grammar=("regex", "[a-e]{6}"))
    driver = DraftDriver(runner)
    seq = driver.start(0, prompt, sampling, LogprobOptions())
    while len(seq.outputs) < 6:
        driver.decode(seq)
    want: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            logits = hf(torch.tensor([prompt + want])).logits[0, -1]
            want.append(ord("a") + int(logits[ord("a") : ord("e") + 1].argmax()))
    assert seq.outputs == want
    assert want != [int(t) for t in hf_greedy(hf, prompt, 6)[0]]  # the grammar changed them
