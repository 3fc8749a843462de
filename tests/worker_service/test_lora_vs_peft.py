"""LoRA adapters on the default model against transformers + PEFT reading the
same adapter directories (fp32, CPU): greedy tokens identical and logprobs
within 1e-4, alone and in mixed batches of several adapters and base rows with
chunked prefill and cached prefixes."""

from __future__ import annotations

import pytest

from tests.support.lora_adapters import STANDARD
from tests.worker_service.support.lora_workers import (
    default_worker,
    max_logprob_gap,
    prompts,
    reference,
)
from tests.worker_service.support.plan_driver import DriverRequest, PlanDriver
from worker_service.execution.plan import AdapterSlot

# Out of make test-fast: PEFT references of the default model.
pytestmark = pytest.mark.slow

STEPS = 16
TOL = 1e-4


@pytest.mark.parametrize("adapter", sorted(STANDARD))
def test_each_adapter_matches_peft(adapter):
    worker = default_worker()
    prompt = list(prompts()[0])
    (req,) = PlanDriver(worker.runner, 16).run(
        [DriverRequest(prompt, STEPS, adapter_slot=1)],
        adapter_slots=[AdapterSlot(1, adapter)],
    )
    tokens, logprobs = reference(adapter, tuple(prompt), STEPS)
    assert req.outputs == tokens
    assert max_logprob_gap(req.logprob_values, logprobs) < TOL
    # The adapter does change what the model says.
    assert tokens != reference(None, tuple(prompt), STEPS)[0]


def test_mixed_batch_of_adapters_and_base_rows_with_chunks_and_cached_prefixes():
    worker = default_worker()
    p = [list(x) for x in prompts()]
    names = sorted(STANDARD)  # slots 1..4
    slots = [AdapterSlot(k + 1, n) for k, n in enumerate(names)]
    reqs = [
        DriverRequest(p[0], STEPS, arrive=0, adapter_slot=1),
        DriverRequest(p[0], STEPS, arrive=0),  # base, same prompt
        DriverRequest(p[1], STEPS, arrive=1, adapter_slot=2),
        DriverRequest(p[2], STEPS, arrive=1, adapter_slot=3),
        DriverRequest(p[1], STEPS, arrive=2, adapter_slot=4),
        # Prefixes cached by a request of the same adapter (the scheduler
        # keeps each adapter's cache apart: KV differs by adapter).
        DriverRequest(p[1], STEPS, arrive=4, adapter_slot=2, share_from=2),
        DriverRequest(p[0], STEPS, arrive=5, share_from=1),
        DriverRequest(p[2], STEPS, arrive=6, adapter_slot=1),
    ]
    PlanDriver(worker.runner, 16, chunk=20).run(reqs, adapter_slots=slots)
    for r in reqs:
        adapter = names[r.adapter_slot - 1] if r.adapter_slot else None
        tokens, logprobs = reference(adapter, tuple(r.prompt), STEPS)
        assert r.outputs == tokens, (r.slot, adapter)
        assert max_logprob_gap(r.logprob_values, logprobs) < TOL, (r.slot, adapter)
    assert reqs[5].pages[0] == reqs[2].pages[0]  # the prefix was read, not recomputed
