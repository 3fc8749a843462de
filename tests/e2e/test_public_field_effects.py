"""The conformance table (tests/support/public_field_table.py) run against
real servers: every field whose row is ``Here`` shows its effect on the
simulated worker or, where meaning matters, the default model; every
``Refused`` field (each field under a whole refusal) gets its refusal."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.e2e.support.system import free_port, separate
from tests.support import public_field_checks as checks
from tests.support.public_field_table import FIELDS
from tests.support.public_fields import (
    Here,
    Refused,
    Server,
    leaf_paths,
    method_of,
    set_any,
)


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conformance")
    metrics = free_port()
    worker = ["--model", "simulated", "--simulated-step-ms", "2", "--log-level", "warning"]
    scheduler = ["--log-level", "warning", "--metrics-port", str(metrics)]
    with separate(tmp, worker, scheduler) as address:
        yield Server(address, metrics)


def _here(model: str) -> list:
    return [
        pytest.param(row, id=field)
        for field, row in FIELDS.items()
        if isinstance(row, Here) and row.model == model
    ]


def _refusals() -> list:
    cases = []
    for field, row in FIELDS.items():
        if isinstance(row, Refused):
            for path in leaf_paths(field) if row.whole else [field]:
                cases.append(pytest.param(path, row, id=path))
    return cases


@pytest.mark.parametrize("row", _here("simulated"))
def test_the_field_has_its_effect_on_the_simulated_worker(sim, row):
    row.check(sim)


@pytest.mark.slow
@pytest.mark.parametrize("row", _here("default"))
def test_the_field_has_its_effect_on_the_default_model(smollm2_address, row):
    row.check(Server(smollm2_address))


def _base_request(name: str):
    if name == "GenerateRequest":
        return checks.request()
    if name == "EmbedRequest":
        return pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=checks.PROMPT))
    for module in (pb, cpb):
        if hasattr(module, name):
            return getattr(module, name)()
    raise LookupError(name)


@pytest.mark.parametrize(("path", "row"), _refusals())
def test_the_field_is_refused_by_name(sim, path, row):
    method = method_of(path)
    req = _base_request(method.input_type.name)
    if row.value is not None:
        row.value(req)
    else:
        set_any(req, path)
    rpc = getattr(checks.stub(sim.address), method.name)

    def send() -> None:
        reply = rpc(req, timeout=30)
        if method.server_streaming:
            list(reply)

    checks.refused(send, grpc.StatusCode[row.code], row.needle)
