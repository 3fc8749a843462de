"""A model step in flight: what ``ModelCompute.launch`` queued on the device
and ``finish`` reads back after the step's one wait.

Everything ``finish`` reads (the sampled tokens and logprobs, prompt scores,
pooled vectors, the tensor-parallel status) is copied back by one
``HostCopy`` queued at the end of ``launch``, right behind the step's own
kernels (``device_tensors`` lists them in the order ``finish`` takes them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker_service.device.transfer import HostCopy
from worker_service.execution.prompt_scores import PromptScores
from worker_service.sampling.sampler import SampleLaunch


class SampleFault(RuntimeError):
    """The fault tests' injected sampler failure (``--fail-sample-token``)."""


@dataclass
class ModelStep:
    """A model step queued on the device (ModelCompute.launch)."""

    sample: SampleLaunch | None
    prompt_logprobs: list[PromptScores] = field(default_factory=list)
    # Embedding requests whose prompt ended: (slot, vector on the device).
    embeddings: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Tensor parallelism: rank 0's sampling status (1: it failed), broadcast
    # with the tokens; every rank reads it in ``finish``.
    sample_status: torch.Tensor | None = None
    sample_error: Exception | None = None  # rank 0: why its sampler failed
    # The copies of everything ``finish`` reads, queued at the end of ``launch``
    # right behind the step's own kernels, not behind the next step's.
    readback: HostCopy | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """What ``finish`` reads: the samples', the prompt scores', the TP status."""
        out = self.sample.device_tensors() if self.sample is not None else []
        out += [t for p in self.prompt_logprobs for t in p.tensors()]
        out += [vec for _, vec in self.embeddings]
        if self.sample_status is not None:
            out.append(self.sample_status)
        return out

    @property
    def tokens(self) -> torch.Tensor:
        if self.sample is None:
            raise ValueError("this step samples nothing")
        return self.sample.tokens
