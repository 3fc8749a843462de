"""Hugging Face transformers baseline: the benchmark's requests through ``generate``.

``run_hf_baseline`` runs the same ``BenchRequest`` list the server gets
through ``model.generate`` on the same model and device, in this process, in
static batches as a user of transformers would, and produces the same
``RequestRecord``s, so the report can put the two side by side.

Timing semantics (all times in seconds since the timed run began):

* Requests are taken in order, ``batch_size`` at a time: a closed loop with
  ``batch_size`` requests in flight. A batch starts when the previous one
  has finished; every request of a batch has ``start_s`` = the batch's start
  (its queueing behind earlier batches is not counted, as for a closed-loop
  client whose request is sent when a slot frees).
* A batch is one greedy ``generate`` call: prompts left-padded to the
  longest with an attention mask, ``max_new_tokens = min_new_tokens`` = the
  batch's largest ``output_len``, EOS ignored, so every row runs the full
  length.
* A ``StoppingCriteria`` records the clock each time it is called.
  transformers calls it once per decoding step, right after the step's token
  has been appended, the first call following the prefill forward; so call
  *k* is the time token *k* of every row became available (on CUDA the
  callback synchronizes first, so the time is when the token was computed,
  not when its kernels were queued; transformers synchronizes at that point
  anyway). A request's ``token_times`` are the first ``output_len`` step
  times of its batch and its ``output_ids`` the first ``output_len``
  generated ids: it counts as done at its own length, although HF keeps
  computing its row until the longest request of the batch is done.
* One untimed warm-up ``generate`` (a short batch) runs first, so one-off
  costs (allocator, kernel selection, lazy init) are not counted; model load
  is not timed either. ``duration_s`` is the wall time of all batches.

Torch's thread count is left as the caller set it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from clients.bench.records import BenchRequest, RequestRecord
from worker_service.device.dtypes import resolve_dtype
from worker_service.weights import open_model
from worker_service.weights.random_shapes import PREFIX as RANDOM_PREFIX

WARMUP_PROMPT_LEN = 8
WARMUP_NEW_TOKENS = 2


@dataclass
class BaselineRun:
    records: list[RequestRecord]
    duration_s: float  # wall time of the timed part (all batches), model load excluded
    batch_size: int
    device: str
    dtype: str


def _model_location(model: str) -> tuple[Path, str | None]:
    """(directory, gguf file name or None) for ``from_pretrained``: the model
    argument resolved exactly as the server resolves it."""
    if model.startswith(RANDOM_PREFIX):
        raise ValueError(
            f"model {model!r} has random weights of a made-up shape, which transformers "
            "cannot build; the HF baseline needs a real model (default, a HF directory or "
            "a .gguf file)"
        )
    source = open_model(model)
    if source.kind == "hf":
        return source.path, None
    return source.path.parent, source.path.name


def load_hf_model(
    model: str = "default", device: str = "cpu", dtype: str = "auto"
) -> tuple[PreTrainedModel, int]:
    """The model (eval mode, on ``device``, EOS disabled) and the id to pad with."""
    directory, gguf_file = _model_location(model)
    dev = torch.device(device)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=resolve_dtype(dtype, dev), **kwargs)
    hf = hf.to(dev).eval()
    gen = hf.generation_config
    pad = next(
        (
            int(p if isinstance(p, int) else p[0])
            for p in (gen.pad_token_id, hf.config.pad_token_id, gen.eos_token_id)
            if p is not None and p != []
        ),
        0,
    )
    gen.eos_token_id = None  # every row generates its full length
    gen.pad_token_id = pad
    return hf, pad


class _StepClock(StoppingCriteria):
    """Appends the time of each decoding step's token; never stops anything."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs
    ) -> torch.BoolTensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    new_tokens: int,
    pad_id: int,
    clock: _StepClock | None = None,
) -> list[list[int]]:
    """Greedy ``generate`` of ``new_tokens`` for each left-padded prompt; the
    generated ids per row."""
    device = model.device
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad_id,
    )
    criteria = StoppingCriteriaList([clock] if clock is not None else [])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=criteria,
        )
    return out[:, width:].tolist()


def _check_prompts(requests: list[BenchRequest], vocab: int) -> None:
    for r in requests:
        if not r.prompt_ids:
            raise ValueError(f"request {r.index} has an empty prompt")
        if r.output_len < 1:
            raise ValueError(f"request {r.index} asks for {r.output_len} output tokens")
        bad = [t for t in r.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"request {r.index}: prompt token id {bad[0]} is outside the model's "
                f"vocabulary (0..{vocab - 1}); was the workload built for another model?"
            )


def run_hf_baseline(
    requests: list[BenchRequest],
    model: str = "default",
    batch_size: int = 16,
    device: str = "cpu",
    dtype: str = "auto",
    progress: bool = True,
    *,
    loaded: tuple[PreTrainedModel, int] | None = None,
) -> BaselineRun:
    """Loads the model (or takes ``loaded``, a ``load_hf_model`` result, and
    ignores model/device/dtype), warms up, then runs ``requests`` in order in
    batches of ``batch_size`` (see the module docstring for what is timed)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    hf, pad_id = loaded if loaded is not None else load_hf_model(model, device, dtype)
    dev = hf.device
    dtype_name = str(hf.dtype).removeprefix("torch.")
    _check_prompts(requests, int(hf.config.vocab_size))
    records: list[RequestRecord] = []
    if not requests:
        return BaselineRun(records, 0.0, batch_size, str(dev), dtype_name)

    warm = [r.prompt_ids[:WARMUP_PROMPT_LEN] for r in requests[:batch_size]]
    _generate(hf, warm, WARMUP_NEW_TOKENS, pad_id)

    bar = tqdm(total=len(requests), unit="req", desc="hf baseline", disable=not progress)
    t0 = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        new_tokens = max(r.output_len for r in batch)
        clock = _StepClock(dev)
        start = time.perf_counter() - t0
        generated = _generate(hf, [r.prompt_ids for r in batch], new_tokens, pad_id, clock)
        if len(clock.times) < new_tokens:
            raise RuntimeError(
                f"transformers reported {len(clock.times)} decoding steps for "
                f"{new_tokens} new tokens; the step clock no longer matches generate"
            )
        steps = [t - t0 for t in clock.times]
        for r, ids in zip(batch, generated, strict=True):
            records.append(
                RequestRecord(
                    index=r.index,
                    prompt_tokens=len(r.prompt_ids),
                    start_s=start,
                    token_times=steps[: r.output_len],
                    cached_tokens=0,
                    output_ids=ids[: r.output_len],
                )
            )
        bar.update(len(batch))
    duration = time.perf_counter() - t0
    bar.close()
    return BaselineRun(records, duration, batch_size, str(dev), dtype_name)
