"""Session fencing and the worker token, the rules on their own (the end-to-end
behaviour is in tests/e2e/test_worker_sessions.py)."""

from __future__ import annotations

import grpc
import pytest

from common.worker_token import TokenCheck, TokenFileError, metadata, read_token
from protos import worker_pb2 as pb
from worker_service.session import SessionFence, SessionRefused, Undecodable, parse_plan


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
