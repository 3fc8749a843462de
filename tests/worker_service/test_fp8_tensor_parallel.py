"""FP8 checkpoints (per channel; 128x128 blocks in a shape whose shards
are whole blocks) served on 2 gloo ranks give transformers' greedy tokens on
the dequantized float model. On the CPU each rank dequantizes the whole
tensor at load and then takes its float shard (fp8_checkpoint.placed), so
this checks FP8 checkpoints under tensor parallelism end to end, not the
scale cuts: each rank's cut of FP8 weights and scales, as on CUDA, is
weights/test_fp8_checkpoint.py's."""

from __future__ import annotations

import pytest
import torch

from tests.support.hf_reference import hf_greedy_check
from tests.worker_service.support.fp8_checkpoints import VOCAB, write_fp8_checkpoint
from tests.worker_service.support.worker_process import greedy_on_two_gloo_ranks

# Starts worker processes (tests/support/process_guard.py); transformers reference.
pytestmark = [pytest.mark.server, pytest.mark.slow]

STEPS = 16
# Block shards: q 256 and k/v 256 rows -> 128 a rank, o/down inputs 128 and 256 a rank.
WHOLE_BLOCKS = {"num_key_value_heads": 4, "intermediate_size": 512}


@pytest.mark.parametrize(
    ("form", "shape"),
    [("fbgemm-channel", {}), ("fp8-block", WHOLE_BLOCKS)],
    ids=["channel", "block"],
)
def test_two_gloo_ranks_match_the_dequantized_model(form, shape, tmp_path):
    hf = write_fp8_checkpoint(tmp_path, form, **shape)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 4)]
    outputs = greedy_on_two_gloo_ranks(tmp_path, prompts, STEPS)
    for prompt, tokens in zip(prompts, outputs, strict=True):
        assert tokens == hf_greedy_check(hf, prompt, tokens)[0]
