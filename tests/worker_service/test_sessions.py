"""Session fencing and the worker token, the rules on their own (the end-to-end
behaviour is in tests/e2e/test_worker_sessions.py)."""

from __future__ import annotations

import re

import grpc
import pytest

from common.worker_token import TokenCheck, TokenFileError, metadata, read_token
from protos import worker_pb2 as pb
from tests.worker_service.support.raw_plans import negative_epoch_opening
from worker_service.rpc.session import SessionFence, SessionRefused, Undecodable, parse_plan


def _opening(session_id: str, epoch: int) -> pb.StepPlan:
    return pb.StepPlan(session=pb.SessionOpen(session_id=session_id, epoch=epoch))


def _refusal(fence: SessionFence, msg: object) -> grpc.StatusCode:
    with pytest.raises(SessionRefused) as info:
        fence.take(msg, "peer")
    return info.value.code


def test_only_a_higher_epoch_takes_the_worker_over():
    fence = SessionFence()
    assert fence.take(_opening("a", 10), "p1").epoch == 10
    assert fence.take(_opening("b", 20), "p2").session_id == "b"
    stale = grpc.StatusCode.FAILED_PRECONDITION
    assert _refusal(fence, _opening("a", 11)) == stale  # the replaced scheduler stays out
    assert _refusal(fence, _opening("b", 20)) == stale  # an epoch is used once
    assert fence.owner.session_id == "b" and fence.highest_epoch == 20


def test_malformed_openings_are_refused_and_change_nothing():
    fence = SessionFence()
    fence.take(_opening("a", 5), "p")
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    plan = pb.StepPlan(step_id=1, mode=pb.FORWARD_MODE_IDLE)
    with_plan = _opening("x", 99)
    with_plan.leaves.append(3)
    for msg in (
        None,
        parse_plan(b"\xff\xfe garbage"),
        plan,
        with_plan,
        _opening("", 99),
        _opening("x" * 300, 99),
        _opening("x", 0),
    ):
        assert _refusal(fence, msg) == invalid
    assert fence.owner.session_id == "a" and fence.highest_epoch == 5


def test_parse_plan_turns_garbage_into_a_value():
    assert isinstance(parse_plan(b"\xff\xff\xff"), Undecodable)
    assert parse_plan(_opening("a", 1).SerializeToString()).session.epoch == 1


def test_the_token_is_checked_from_metadata(tmp_path):
    path = tmp_path / "token"
    path.write_text("  tok-123\n")
    token = read_token(str(path))
    check = TokenCheck(token)
    assert check.accepts(metadata(token))
    assert check.accepts((("authorization", "bearer tok-123"),))
    assert not check.accepts(())
    assert not check.accepts((("authorization", "Bearer tok-124"),))
    assert not check.accepts((("authorization", "Bearer "),))
    path.write_text("\n")
    with pytest.raises(TokenFileError, match="empty"):
        read_token(str(path))
    path.write_text("two words\n")
    with pytest.raises(TokenFileError, match="one word"):
        read_token(str(path))


NOW = 1_800_000_000 * 10**9  # the worker's clock in these tests (ns)
LEAD = 1 << 40


def test_epochs_out_of_range_or_too_far_ahead_are_refused_and_change_nothing():
    fence = SessionFence(clock=lambda: NOW)
    fence.take(_opening("a", NOW - 5), "p")
    negative = parse_plan(negative_epoch_opening())
    assert negative.session.epoch == 2**64 - 1  # what a negative int64 arrives as
    top = "above the protocol's maximum 9223372036854775807 (2**63 - 1)"
    ahead = "more than 2**40 ns (18.3 min) ahead of"
    for msg, says in (
        (_opening("x", 2**64 - 1), top),
        (negative, top),
        (_opening("x", 2**63), top),
        (_opening("x", 2**63 - 1), ahead),  # in range, but it would fence out every scheduler
        (_opening("x", NOW + LEAD + 1), ahead),
        (_opening("x", 0), "must be > 0"),
    ):
        with pytest.raises(SessionRefused, match=re.escape(says)) as info:
            fence.take(msg, "peer")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fence.owner.session_id == "a" and fence.highest_epoch == NOW - 5


def test_the_epoch_lead_is_measured_from_the_clock_or_the_highest_epoch():
    fence = SessionFence(clock=lambda: NOW)
    assert fence.take(_opening("a", NOW + LEAD), "p").epoch == NOW + LEAD  # at the bound
    # A scheduler restarted after a stranger's far opening goes just above it.
    assert fence.take(_opening("b", NOW + LEAD + 1), "p").epoch == NOW + LEAD + 1
    assert fence.take(_opening("c", NOW + 2 * LEAD + 1), "p").session_id == "c"
    with pytest.raises(SessionRefused, match="ahead of"):
        fence.take(_opening("d", NOW + 3 * LEAD + 2), "p")
