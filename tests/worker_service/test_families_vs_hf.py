"""The Gemma 2, Gemma 3 and Phi-3 families against transformers 5 on the same
weights (fp32, CPU), as test_models_vs_hf.py checks the Llama family.

Tiny random checkpoints (support/tiny_hf_models.py: FAMILY_ARCHITECTURES)
with sliding windows of 12-16 tokens under prompts of 40-60, so the sliding
layers see less than the global ones; Gemma 2's attention and final-logit
soft-caps small enough to bend a tiny model's scores; Gemma 3's own RoPE for
its sliding layers and its query/key norms; Phi-3's fused checkpoint tensors
and longrope factors; a Phi-4-mini-shaped Phi-3 whose heads rotate in half
their dims. The reference is transformers' uncached forward over
each request's tokens (hf_reference.hf_greedy_check; why not generate() is
said there). Greedy tokens
identical over 64 new tokens, chosen-token logprobs within 1e-4, in mixed
batches of long and short requests with chunked prefill, cached prefixes and
page sizes 1 and 16; speculative
verification (drafts right and wrong) gives the same tokens; LoRA on the
attention projections (Gemma 3) and on Phi-3's fused projections matches PEFT.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel

from tests.support.hf_reference import hf_greedy_check
from tests.support.lora_adapters import ATTENTION, make_adapter
from tests.worker_service.support.draft_driver import DraftDriver
from tests.worker_service.support.plan_driver import GREEDY, DriverRequest, PlanDriver
from tests.worker_service.support.tiny_hf_models import VOCAB, tiny_model
from tests.worker_service.support.worker_factory import runner_for, worker_for
from worker_service.execution.plan import AdapterSlot
from worker_service.sampling.params import LogprobOptions

# Out of make test-fast: transformers references.
pytestmark = pytest.mark.slow

STEPS = 64
TOL = 1e-4
FAMILIES = ["gemma2", "gemma3", "phi3-longrope", "phi3-partial-rotary"]


def rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def workload() -> list[DriverRequest]:
    g = torch.Generator().manual_seed(7)
    shared = rand(g, 40)
    return [
        DriverRequest(shared + rand(g, 8), STEPS, arrive=0),
        DriverRequest(rand(g, 3), STEPS, arrive=1),  # short beside long ones
        DriverRequest(shared + rand(g, 15), STEPS, arrive=4, share_from=0),  # cached prefix
        DriverRequest(rand(g, 60), STEPS, arrive=6),  # several chunks
    ]


def assert_matches(hf: PreTrainedModel, prompt: list[int], tokens, logprobs) -> None:
    """``tokens`` are transformers' greedy tokens after ``prompt`` and
    ``logprobs`` their logprobs."""
    choices, want = hf_greedy_check(hf, prompt, tokens)
    assert tokens == choices
    assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < TOL


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_greedy_tokens_and_logprobs_match_hf(name, page_size, chunk, tmp_path):
    hf = tiny_model(name, tmp_path)
    runner = runner_for(tmp_path, page_size=page_size, num_pages=4096 // page_size)
    reqs = PlanDriver(runner, page_size, chunk=chunk).run(workload())
    for r in reqs:
        assert_matches(hf, r.prompt, r.outputs, r.logprob_values)


@pytest.mark.parametrize("name", ["gemma2", "phi3-longrope"])
def test_speculative_verify_gives_hf_tokens(name, tmp_path):
    """Drafted extends (the last token and k drafts) on the sliding and
    soft-capped layers, drafts all right, all wrong and partly right (drawn
    from a plain decode of the same prompt, as an n-gram drafter would find
    them), give plain decoding's tokens, which are transformers'."""
    hf = tiny_model(name, tmp_path)
    prompt = rand(torch.Generator().manual_seed(11), 50)
    runner = runner_for(tmp_path, page_size=4, num_pages=512, overlap="off")
    driver = DraftDriver(runner)
    lp = LogprobOptions(return_logprob=True)
    n = 40
    plain = driver.start(0, prompt, GREEDY, lp)
    while len(plain.outputs) < n:
        driver.decode(plain)
    assert_matches(hf, prompt, plain.outputs[:n], plain.logprobs[:n])
    seq = driver.start(1, prompt, GREEDY, lp)
    kinds = ["right", "wrong", "half", "right", "plain"]
    while len(seq.outputs) < n:
        at = len(seq.outputs)
        drafts = plain.outputs[at : at + 6]
        kind = kinds[len(seq.counts) % len(kinds)]
        if kind == "plain" or not drafts:
            driver.decode(seq)
            continue
        if kind == "wrong":
            drafts = [(t + 1) % VOCAB for t in drafts]
        elif kind == "half":
            drafts = drafts[:3] + [(t + 1) % VOCAB for t in drafts[3:]]
        driver.verify(seq, drafts)
    assert max(seq.counts) > 1, "some drafts were accepted"
    assert seq.outputs[:n] == plain.outputs[:n]
    assert max(abs(a - b) for a, b in zip(seq.logprobs[:n], plain.logprobs[:n], strict=True)) < TOL


def test_lora_on_attention_projections_matches_peft(tmp_path):
    hf = tiny_model("gemma3", tmp_path / "model")
    adapter = make_adapter(tmp_path, "attn", 4, ATTENTION, seed=3, base=hf)
    worker = worker_for(tmp_path / "model", page_size=16, num_pages=256, swa_memory=False)
    worker.runner.adapters.put(worker.adapter_loader.load("attn", adapter, 0))
    prompt = rand(torch.Generator().manual_seed(5), 45)
    reqs = [
        DriverRequest(prompt, 32, adapter_slot=1),
        DriverRequest(prompt, 32),  # the base model in the same batch
    ]
    PlanDriver(worker.runner, 16, chunk=20).run(reqs, adapter_slots=[AdapterSlot(1, "attn")])
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), str(adapter)).eval()
    assert_matches(peft, prompt, reqs[0].outputs, reqs[0].logprob_values)
    assert_matches(hf, prompt, reqs[1].outputs, reqs[1].logprob_values)
    assert reqs[0].outputs != reqs[1].outputs, "the adapter changes what the model says"


def test_phi3_lora_on_its_fused_projections_matches_peft(tmp_path):
    """Phi-3 adapters target the checkpoint's fused qkv_proj and gate_up_proj
    (one A, B's rows the parts'): read as one adapter per part."""
    hf = tiny_model("phi3-longrope", tmp_path / "model")
    modules = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapter = make_adapter(tmp_path, "fused", 4, modules, seed=4, base=hf)
    worker = worker_for(tmp_path / "model", page_size=16, num_pages=256, swa_memory=False)
    loaded = worker.adapter_loader.load("fused", adapter, 0)
    assert loaded.target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    worker.runner.adapters.put(loaded)
    prompt = rand(torch.Generator().manual_seed(6), 45)
    (req,) = PlanDriver(worker.runner, 16, chunk=20).run(
        [DriverRequest(prompt, 32, adapter_slot=1)], adapter_slots=[AdapterSlot(1, "fused")]
    )
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), str(adapter)).eval()
    assert_matches(peft, prompt, req.outputs, req.logprob_values)
    assert hf_greedy_check(hf, prompt, req.outputs)[0] != req.outputs, "the adapter matters"
