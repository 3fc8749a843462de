"""Sampling parameters are declared in four families: the client's
``Sampling``, the core's ``SamplingParams``, the worker protocol's
``SamplingParams`` message and the worker's ``SamplingParams``
(worker_service/sampling/params.py). This test fails when a knob is added
to one and not carried by the others (or declared here as deliberately not
carried, with why), and checks that every knob the worker samples with
survives the trip core -> wire -> worker."""

from __future__ import annotations

import dataclasses

from clients.results import Sampling
from protos import worker_pb2 as pb
from scheduler_service.core.sampling import SamplingParams
from scheduler_service.engine.worker_codec import sampling_to_proto
from worker_service.execution.convert import sampling_from_proto
from worker_service.sampling.params import SamplingParams as WorkerSamplingParams

# Knobs the core keeps to itself: they act on the scheduler's side (stop
# checks, detokenization), never on the worker's sampling.
CORE_ONLY = {
    "max_new_tokens": "the scheduler stops the request",
    "stop_strs": "matched on the detokenized text in the core",
    "skip_special_tokens": "detokenization",
    "spaces_between_special_tokens": "detokenization",
    "no_stop_trim": "detokenization",
}
# The worker protocol's fields -> the core's / the worker's knob.
WIRE_NAMES = {"logit_bias_ids": "logit_bias", "logit_bias_values": "logit_bias"}
# The client's name for a core knob, where it differs; the grammar is one of
# four client fields.
CLIENT_NAMES = {
    "stop": "stop_strs",
    "json_schema": "grammar",
    "regex": "grammar",
    "ebnf": "grammar",
    "structural_tag": "grammar",
}
# Client fields that are no sampling knob of the core (logprob options,
# the number of samples, or custom_params the API reads).
CLIENT_NOT_SAMPLING = {"n", "logprobs", "top_logprobs", "priority", "routing_key", "speculative"}
# Core knobs the client does not offer, and why.
CLIENT_LACKS = {
    "logit_bias": "the public API's logit_bias map; the client does not send it yet",
    "spaces_between_special_tokens": "the client decodes with the server's tokenizer itself",
    "reasoning_end_token": "set by the API from GenerateRequest.require_reasoning and the "
    "model's vocabulary; the client does not send require_reasoning yet",
}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_worker_family_carries_every_worker_knob_of_the_core():
    core = _fields(SamplingParams)
    wire = {WIRE_NAMES.get(f.name, f.name) for f in pb.SamplingParams.DESCRIPTOR.fields}
    worker = _fields(WorkerSamplingParams)
    assert wire == worker, f"wire and worker differ: {sorted(wire ^ worker)}"
    assert worker <= core, f"the worker has knobs the core lacks: {sorted(worker - core)}"
    unplaced = core - worker - set(CORE_ONLY)
    assert not unplaced, f"core knobs neither sent to the worker nor core-only: {sorted(unplaced)}"
    assert not (set(CORE_ONLY) & worker), "a core-only knob reached the worker"


def test_the_client_family_names_every_core_knob():
    client = {CLIENT_NAMES.get(n, n) for n in _fields(Sampling) - CLIENT_NOT_SAMPLING}
    core = _fields(SamplingParams)
    assert client <= core, f"client knobs the core does not know: {sorted(client - core)}"
    missing = core - client - set(CLIENT_LACKS)
    assert not missing, f"core knobs the client cannot set: {sorted(missing)}"
    assert not (set(CLIENT_LACKS) & client), "CLIENT_LACKS names a knob the client has"


def test_every_worker_knob_survives_core_wire_worker():
    sp = SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        min_p=0.05,
        frequency_penalty=0.25,
        presence_penalty=-0.5,
        repetition_penalty=1.125,
        min_new_tokens=3,
        stop_token_ids=frozenset({4, 9}),
        ignore_eos=True,
        logit_bias=((5, 1.5), (8, -2.0)),
        seed=2**63 + 1,
        grammar=("regex", "(yes|no)"),
        reasoning_end_token=0,  # id 0 is a token too (the wire sends id + 1)
    )
    m = pb.SamplingParams()
    sampling_to_proto(sp, m)
    spec = sampling_from_proto(m)
    for name in _fields(WorkerSamplingParams):
        core_value = getattr(sp, name)
        worker_value = getattr(spec, name)
        if name == "stop_token_ids":
            core_value = tuple(sorted(core_value))
        if isinstance(core_value, float):
            assert abs(worker_value - core_value) < 1e-6, name
        else:
            assert worker_value == core_value, name
        default = getattr(WorkerSamplingParams(), name)
        assert worker_value != default, f"{name} kept its default: the test does not cover it"
