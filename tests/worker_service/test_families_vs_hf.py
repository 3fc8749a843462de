"""The Gemma 2, Gemma 3 and Phi-3 families against transformers 5 on the same
weights (fp32, CPU), as test_models_vs_hf.py checks the Llama family.

Tiny random checkpoints (support/tiny_hf_models.py: FAMILY_ARCHITECTURES)
with sliding windows of 12-16 tokens under prompts of 40-60, so the sliding
layers see less than the global ones; Gemma 2's attention and final-logit
soft-caps small enough to bend a tiny model's scores; Gemma 3's own RoPE for
its sliding layers and its query/key norms; Phi-3's fused checkpoint tensors
and longrope factors. The reference is transformers' uncached forward, step by
step (hf_reference.hf_greedy_uncached says why not generate()). Greedy tokens
identical over 64 new tokens, chosen-token logprobs within 1e-4, in mixed
batches of long and short requests with chunked prefill, cached prefixes and
page sizes 1 and 16; speculative
verification (n-gram drafts, right and wrong) gives the same tokens; LoRA on
the attention projections matches PEFT.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import PreTrainedModel

from tests.support.hf_reference import hf_greedy_uncached
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
FAMILIES = ["gemma2", "gemma3", "phi3-longrope"]


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


_REFERENCE: dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[float]]] = {}


def reference(name: str, hf: PreTrainedModel, prompt: list[int], steps: int = STEPS):
    """transformers' greedy tokens and their logprobs (each model's weights are
    a function of its name: computed once per name and prompt)."""
    key = (name, tuple(prompt), steps)
    if key not in _REFERENCE:
        _REFERENCE[key] = hf_greedy_uncached(hf, prompt, steps)
    return _REFERENCE[key]


def assert_matches(name, hf, prompt, tokens, logprobs):
    want_tokens, want_logprobs = reference(name, hf, prompt, len(tokens))
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < TOL


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 9), (16, 32)])
def test_greedy_tokens_and_logprobs_match_hf(name, page_size, chunk, tmp_path):
    hf = tiny_model(name, tmp_path)
    runner = runner_for(tmp_path, page_size=page_size, num_pages=4096 // page_size)
    reqs = PlanDriver(runner, page_size, chunk=chunk).run(workload())
    for r in reqs:
        assert_matches(name, hf, r.prompt, r.outputs, r.logprob_values)


@pytest.mark.parametrize("name", ["gemma2", "phi3-longrope"])
def test_speculative_verify_gives_hf_tokens(name, tmp_path):
    """Drafted extends (the last token and k drafts) on the sliding and
    soft-capped layers: all right, all wrong, partly right."""
    hf = tiny_model(name, tmp_path)
    prompt = rand(torch.Generator().manual_seed(11), 50)
    want, _ = reference(name, hf, prompt, 40)
    runner = runner_for(tmp_path, page_size=4, num_pages=512, overlap="off")
    driver = DraftDriver(runner)
    lp = LogprobOptions(return_logprob=True)
    seq = driver.start(0, prompt, GREEDY, lp)
    kinds = ["right", "wrong", "half", "right", "plain"]
    step = 0
    while len(seq.outputs) < 40:
        at = len(seq.outputs)
        drafts = want[at : at + 6]
        kind = kinds[step % len(kinds)]
        step += 1
        if kind == "plain" or not drafts:
            driver.decode(seq)
            continue
        if kind == "wrong":
            drafts = [(t + 1) % VOCAB for t in drafts]
        elif kind == "half":
            drafts = drafts[:3] + [(t + 1) % VOCAB for t in drafts[3:]]
        driver.verify(seq, drafts)
    assert max(seq.counts) > 1, "some drafts were accepted"
    n = 40
    assert_matches(name, hf, prompt, seq.outputs[:n], seq.logprobs[:n])


def test_lora_on_attention_projections_matches_peft(tmp_path):
    name = "gemma3"
    hf = tiny_model(name, tmp_path / "model")
    adapter = make_adapter(tmp_path, "attn", 4, ATTENTION, seed=3, base=hf)
    worker = worker_for(tmp_path / "model", page_size=16, num_pages=256)
    worker.runner.adapters.put(worker.adapter_loader.load("attn", adapter, 0))
    prompt = rand(torch.Generator().manual_seed(5), 45)
    reqs = [
        DriverRequest(prompt, 32, adapter_slot=1),
        DriverRequest(prompt, 32),  # the base model in the same batch
    ]
    PlanDriver(worker.runner, 16, chunk=20).run(reqs, adapter_slots=[AdapterSlot(1, "attn")])
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), str(adapter)).eval()
    tokens, logprobs = hf_greedy_uncached(peft, prompt, 32)
    assert reqs[0].outputs == tokens
    assert max(abs(a - b) for a, b in zip(reqs[0].logprob_values, logprobs, strict=True)) < TOL
    assert_matches(name, hf, prompt, reqs[1].outputs, reqs[1].logprob_values)
    assert tokens != reqs[1].outputs, "the adapter changes what the model says"
