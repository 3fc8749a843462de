"""FP8 checkpoints on the CPU (dequantized at load) against transformers.

Each supported form (support/fp8_checkpoints.py: FineGrainedFP8 128x128
blocks and per tensor, AutoFP8's per tensor with static input_scale,
fbgemm_fp8 and compressed-tensors per channel, compressed-tensors per tensor
static) is written as a tiny Llama (and Qwen3 for the block form) checkpoint
with FP8 projections and their scales. Greedy tokens identical over 24 steps
and chosen-token logprobs within 1e-4 in a mixed batch with chunked prefill.

The reference:
- ``fp8-block`` and ``fp8-tensor``: transformers 5.24 loading the SAME
  checkpoint (its FineGrainedFP8 quantizer dequantizes on a machine without
  a GPU; checked equal to the dequantized float model, bit for bit);
- the others: transformers on the float model holding exactly the
  dequantized weights (fp8 * scale), since transformers cannot run them on
  the CPU: fbgemm_fp8 needs fbgemm-gpu, compressed-tensors its package
  (not installed), and its FineGrainedFP8 reads AutoFP8's ``weight_scale``
  as an unexpected key and serves the raw FP8 values unscaled.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.support.hf_reference import hf_greedy
from tests.worker_service.support.fp8_checkpoints import FORMS, VOCAB, write_fp8_checkpoint
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from tests.worker_service.support.worker_factory import runner_for

pytestmark = pytest.mark.slow  # transformers references

STEPS = 24
TOL = 1e-4
SAME_CHECKPOINT = {"fp8-block", "fp8-tensor"}


def workload() -> list[DriverRequest]:
    g = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    shared = rand(30)
    return [
        DriverRequest(shared + rand(5), STEPS, arrive=0),
        DriverRequest(rand(3), STEPS, arrive=1),
        DriverRequest(shared + rand(9), STEPS, arrive=3, share_from=0),
        DriverRequest(rand(41), STEPS, arrive=4),
    ]


@pytest.mark.parametrize(
    ("form", "arch"), [*((f, "llama") for f in sorted(FORMS)), ("fp8-block", "qwen3")]
)
def test_greedy_tokens_and_logprobs_match_transformers(form, arch, tmp_path):
    dequantized = write_fp8_checkpoint(tmp_path, form, arch=arch)
    if form in SAME_CHECKPOINT:
        reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    else:
        reference = dequantized
    runner = runner_for(tmp_path, page_size=4, num_pages=512)
    for r in PlanDriver(runner, 4, chunk=16).run(workload()):
        tokens, logprobs = hf_greedy(reference, r.prompt, STEPS)
        assert r.outputs == tokens, f"request {r.slot}"
        assert max(abs(a - b) for a, b in zip(r.logprob_values, logprobs, strict=True)) < TOL
