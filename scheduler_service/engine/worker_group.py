"""The scheduler's connection to its worker group: one Execute stream per rank.

Every rank receives every plan (tensor parallelism); rank 0's result carries
the tokens, the others' are checked for errors only. Sending never blocks
(plans queue in the stream), so plan N+1 can be on its way while the worker
computes N.

Each stream opens a fenced session (worker_service/rpc/session.py): this
scheduler's session id and an epoch. The epoch is fixed at the first
connect as max(wall-clock time in ns, the highest epoch any rank reports + 1)
and goes up by one for each session a rank accepted, so a restarted
scheduler always opens above its predecessor (even with a clock behind the
old one's), while a scheduler that was replaced never climbs back over its
successor: a refused opening does not raise its next epoch. An opening
that was not refused but not answered in time does: a busy worker takes an
opening only once its running step ends, possibly after this scheduler gave
up waiting, and then holds that epoch (reusing it, every later opening was
refused as stale, by our own abandoned session, until the worker restarted).
A rank that
reports an epoch at the protocol's maximum (common/session_epoch.py) leaves
no room above it: it is refused by name like a rank of another protocol
version (a starting scheduler stops, a reconnecting one keeps trying, as the
worker may be restarted), never turned into an epoch the field cannot hold.

A hung worker is noticed two ways: gRPC keepalive pings on the channels
(``--worker-keepalive``: a stopped process or a dead host leaves them
unanswered) and a deadline on every wait for a result (step_deadline.py).
Either breaks the streams, which the engine treats as a lost group.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from common import tokenizer_archive, worker_token
from common.session_epoch import MAX_SESSION_EPOCH, MAX_SESSION_EPOCH_TEXT
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc
from scheduler_service.engine.step_deadline import StepDeadline, Watchdog
from scheduler_service.engine.storage_reports import StorageReports

logger = structlog.get_logger(__name__)


PROTOCOL_VERSION = 3  # the workers' WorkerInfo.protocol_version this scheduler speaks
OPEN_TIMEOUT_S = 10.0  # a session opening not answered by then fails the attempt
# How a worker refuses an opening: it decided, and does not hold the epoch.
REFUSALS = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class WorkerError(RuntimeError):
    """The worker group cannot serve (unreachable, inconsistent, or failed)."""


class StepFailed(WorkerError):
    """A rank answered a step with an error: its request state is gone or out
    of step with ours, so the group is treated as lost (and the plan's
    requests are charged with the failure)."""

    def __init__(self, step_id: int, message: str) -> None:
        super().__init__(message)
        self.step_id = step_id


def _refusal(address: str, e: grpc.RpcError) -> str:
    """What a refused RPC means, for the log and the errors."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return (
            f"worker {address} refused this scheduler's token: {details} (--worker-token-file "
            "must hold the same token on both sides)"
        )
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return f"worker {address} is held by a newer scheduler session: {details}"
    return f"worker {address}: {details}"


def parse_worker_address(url: str) -> str:
    """'grpc://host:port' or 'host:port' -> 'host:port'."""
    address = url.removeprefix("grpc://")
    if ":" not in address:
        raise ValueError(f"worker address {url!r} needs a port (grpc://HOST:PORT)")
    return address


# Handshake failures that waiting will not cure: the worker's certificate is not
# trusted or not for the name asked, or the worker does not speak TLS at all.
_TLS_FAILURES = ("certificate_verify_failed", "verification check failed", "wrong_version_number")


def _tls_misconfigured(details: str) -> bool:
    return any(f in details.lower() for f in _TLS_FAILURES)


@dataclass
class _Rank:
    address: str
    channel: grpc.Channel
    stub: worker_pb2_grpc.WorkerStub
    plans: queue.SimpleQueue | None = None
    results: Iterator[pb.StepResult] | None = None


class WorkerGroup:
    def __init__(
        self,
        urls: list[str],
        max_message_mb: int = 64,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, str | int]] = (),
        *,
        token: str | None = None,
        keepalive_s: float = 10.0,
        step_timeout_s: float = 0.0,
    ) -> None:
        """``credentials``: mutual TLS to the workers (None: plaintext);
        ``token``: the shared worker token (None: send none)."""
        if not urls:
            raise ValueError("at least one worker address is needed")
        limit = max_message_mb << 20
        self._credentials = credentials
        keepalive_ms = int(keepalive_s * 1000)
        self._options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # A restarted worker is found within a second or so, not after
            # gRPC's default reconnect backoff (up to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # Ping busy and idle channels alike; an unanswered ping closes the
            # channel, which breaks the streams (a lost worker group).
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # Any ping (flow-control probes too) unanswered as long: without
            # it a probe in flight waits 60 s and holds the keepalive back.
            ("grpc.http2.ping_timeout_ms", keepalive_ms),
            *options,
        ]
        self._metadata = worker_token.metadata(token)
        self.ranks = [self._rank(parse_worker_address(url)) for url in urls]
        self.info: pb.WorkerInfo | None = None
        # The file tier's blocks every rank holds (at the last connect).
        self.stored_hashes: list[int] = []
        self._storage_reports = StorageReports(1)  # the ranks' file reads, merged
        self.session_id = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        self._epoch_base = 0  # fixed at the first connect
        self._sessions = 0  # sessions opened that some rank accepted
        self.deadline = StepDeadline(step_timeout_s)
        self._hung = ""  # why the watchdog broke the streams ("" if it did not)
        self._watchdog = Watchdog(self._expired)

    def _rank(self, address: str) -> _Rank:
        if self._credentials is None:
            channel = grpc.insecure_channel(address, options=self._options)
        else:
            channel = grpc.secure_channel(address, self._credentials, options=self._options)
        return _Rank(address, channel, worker_pb2_grpc.WorkerStub(channel))

    def connect(self, timeout_s: float = 600.0) -> pb.WorkerInfo:
        """Wait for every rank, check they form one group, return rank 0's info."""
        deadline = time.monotonic() + timeout_s
        infos = []
        for rank in self.ranks:
            log_at = time.monotonic() + 3
            while True:
                try:
                    infos.append(
                        rank.stub.GetInfo(pb.GetInfoRequest(), timeout=5, metadata=self._metadata)
                    )
                    break
                except grpc.RpcError as e:
                    details = e.details() or str(e)
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise WorkerError(_refusal(rank.address, e)) from e
                    if _tls_misconfigured(details):
                        raise WorkerError(
                            f"TLS with worker {rank.address} failed: {details} (check "
                            "--worker-tls-ca, --worker-tls-server-name and the worker's "
                            "--worker-tls-* flags)"
                        ) from e
                    if time.monotonic() > deadline:
                        raise WorkerError(f"worker {rank.address} did not answer: {e}") from e
                    if time.monotonic() > log_at:
                        # A worker that accepts and then closes the connection may
                        # be refusing our certificate; TLS 1.3 tells the client no more.
                        logger.info("waiting for worker", worker=rank.address, error=details)
                        log_at = time.monotonic() + 30
                    time.sleep(0.5)
        info = self._form_group(infos)
        if not self._epoch_base:
            highest = max(i.session_epoch for i in infos)
            self._epoch_base = max(time.time_ns(), highest + 1)
        return info

    def try_connect(self, timeout_s: float = 2.0) -> pb.WorkerInfo:
        """One attempt to reach every rank (after a loss); WorkerError if any is missing."""
        infos = []
        for rank in self.ranks:
            try:
                infos.append(
                    rank.stub.GetInfo(
                        pb.GetInfoRequest(), timeout=timeout_s, metadata=self._metadata
                    )
                )
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise WorkerError(_refusal(rank.address, e)) from e
                details = e.details() if hasattr(e, "details") else str(e)
                raise WorkerError(f"worker {rank.address} did not answer: {details}") from e
        return self._form_group(infos)

    def _form_group(self, infos: list[pb.WorkerInfo]) -> pb.WorkerInfo:
        for info, rank in zip(infos, self.ranks, strict=True):
            if info.protocol_version != PROTOCOL_VERSION:
                raise WorkerError(
                    f"worker {rank.address} speaks worker protocol {info.protocol_version}, this "
                    f"scheduler {PROTOCOL_VERSION}: upgrade schedulers and workers together"
                )
            if info.session_epoch >= MAX_SESSION_EPOCH:
                raise WorkerError(
                    f"worker {rank.address} reports session epoch {info.session_epoch}, at or "
                    f"above the protocol's maximum {MAX_SESSION_EPOCH_TEXT}, so no session can "
                    "open above it: restart that worker"
                )
        by_rank = sorted(zip(infos, self.ranks, strict=True), key=lambda p: p[0].tp_rank)
        ranks = [i.tp_rank for i, _ in by_rank]
        if ranks != list(range(len(infos))) or any(i.tp_size != len(infos) for i in infos):
            raise WorkerError(
                f"workers {ranks} do not form one tensor-parallel group of {len(infos)}"
            )
        shapes = {(i.page_size, i.num_pages, i.model.vocab_size, i.num_host_pages) for i in infos}
        if len(shapes) != 1:
            raise WorkerError(
                f"worker ranks disagree on page size / pages / vocabulary / host pages: {shapes}"
            )
        self.ranks = [r for _, r in by_rank]
        self.info = by_rank[0][0]
        self.stored_hashes = _stored_everywhere(infos)
        self._storage_reports = StorageReports(len(infos))
        logger.info(
            "worker group connected",
            ranks=len(self.ranks),
            model=self.info.model.name,
            pages=self.info.num_pages,
            host_pages=self.info.num_host_pages,
            page_size=self.info.page_size,
        )
        return self.info

    @property
    def epoch(self) -> int:
        """The epoch of the next session this scheduler opens."""
        return self._epoch_base + self._sessions

    def open(self) -> None:
        """Open a session on every rank (each drops its old state and ends the
        previous session's stream); WorkerError if any rank refuses or does
        not answer within OPEN_TIMEOUT_S."""
        if not self._epoch_base:
            raise WorkerError("open() before connect()")
        if self.epoch > MAX_SESSION_EPOCH:
            raise WorkerError(
                f"this scheduler's next session epoch {self.epoch} is above the protocol's "
                f"maximum {MAX_SESSION_EPOCH_TEXT}: restart the workers, then this scheduler"
            )
        self._hung = ""
        self._storage_reports.reset()
        opening = pb.StepPlan(session=pb.SessionOpen(session_id=self.session_id, epoch=self.epoch))
        for rank in self.ranks:
            rank.plans = queue.SimpleQueue()
            rank.plans.put(opening)
            rank.results = rank.stub.Execute(iter(rank.plans.get, None), metadata=self._metadata)
        refused, error = 0, None
        self._watchdog.arm(OPEN_TIMEOUT_S, "the session opening")
        try:
            for rank in self.ranks:
                try:
                    ack = self._next(rank)
                except WorkerError as e:
                    refused += self._refused(e)
                    error = error or e
                    continue
                if ack.error and error is None:  # not a session-speaking worker
                    error = WorkerError(f"worker {rank.address} refused the session: {ack.error}")
        finally:
            self._watchdog.disarm()
            # A rank that did not refuse this epoch holds it now, or may soon
            # (it answered late, or not yet): the next session goes above it.
            if refused < len(self.ranks):
                self._sessions += 1
        if error is not None:
            raise error
        logger.info(
            "worker session opened", session_id=self.session_id, epoch=opening.session.epoch
        )

    def _refused(self, e: WorkerError) -> bool:
        """Whether a failed opening was the worker's refusal (not a timeout,
        a cancel or a broken connection, after which it may hold the epoch)."""
        cause = e.__cause__
        return not self._hung and isinstance(cause, grpc.RpcError) and cause.code() in REFUSALS

    def drop_streams(self) -> None:
        """Abandon the streams and channels after a loss. Every rank's stream
        goes, the healthy ones' too: a group that lost a rank cannot run a step,
        and a new stream makes each worker drop its old requests."""
        for rank in self.ranks:
            if rank.plans is not None:
                rank.plans.put(None)
            if rank.results is not None:
                with contextlib.suppress(Exception):
                    rank.results.cancel()
            rank.channel.close()
        self.ranks = [self._rank(r.address) for r in self.ranks]

    def send(self, plan: pb.StepPlan) -> None:
        for rank in self.ranks:
            rank.plans.put(plan)

    def receive(self, tokens: int = 0) -> pb.StepResult:
        """The next result (rank 0's), of a step computing ``tokens`` tokens;
        blocks until every rank has answered, at most the step deadline for
        that many. StepFailed if a rank answered an error."""
        deadline = self.deadline
        t0 = time.monotonic()
        self._watchdog.arm(deadline.for_step(tokens), "a step result (--worker-step-timeout)")
        try:
            results = [self._next(rank) for rank in self.ranks]
        finally:
            self._watchdog.disarm()
        deadline.observe(time.monotonic() - t0, tokens)
        for rank, r in zip(self.ranks, results, strict=True):
            if r.error:
                raise StepFailed(
                    r.step_id, f"worker {rank.address} failed step {r.step_id}: {r.error}"
                )
        self._storage_reports.merge(results)
        return results[0]

    def ended(self) -> str | None:
        """Why a rank's stream has ended, or None while all are open. An idle
        loop reads no result, so this is how it learns of a worker lost meanwhile."""
        for rank in self.ranks:
            results = rank.results
            if results is not None and results.done():
                return f"the stream to worker {rank.address} ended: {results.details()}"
        return None

    def _next(self, rank: _Rank) -> pb.StepResult:
        try:
            return next(rank.results)
        except (grpc.RpcError, StopIteration) as e:
            if self._hung:
                raise WorkerError(self._hung) from e
            if isinstance(e, grpc.RpcError):
                raise WorkerError(f"the stream to {_refusal(rank.address, e)}") from e
            raise WorkerError(f"worker {rank.address} ended the stream") from e

    def _expired(self, what: str, timeout_s: float) -> None:
        """The watchdog's thread: no answer in time. Breaking every stream ends
        the wait at once (the engine then recovers the group)."""
        self._hung = (
            f"no answer from the worker group within {timeout_s:g} s, waiting for {what}: "
            "a hung worker"
        )
        logger.error("worker group hung: breaking its streams", waited_for=what, s=timeout_s)
        for rank in self.ranks:
            if rank.results is not None:
                with contextlib.suppress(Exception):
                    rank.results.cancel()

    def load_adapter(self, name: str, path: str, max_rank: int, timeout_s: float) -> list:
        """Start loading an adapter on every rank: one gRPC future per rank."""
        request = pb.LoadAdapterRequest(name=name, path=path, max_rank=max_rank)
        return [
            rank.stub.LoadAdapter.future(request, timeout=timeout_s, metadata=self._metadata)
            for rank in self.ranks
        ]

    def unload_adapter(self, name: str, timeout_s: float = 10.0) -> None:
        """Forget an adapter on every rank (a rank that fails is logged: it
        only keeps some memory until it restarts)."""
        for rank in self.ranks:
            try:
                rank.stub.UnloadAdapter(
                    pb.UnloadAdapterRequest(name=name), timeout=timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as e:
                logger.warning("unloading an adapter failed", worker=rank.address, error=str(e))

    def tokenizer_archive(self) -> bytes:
        """The model's tokenizer files as a zip (from rank 0), checked against its sha256."""
        pieces = self.ranks[0].stub.GetTokenizer(
            pb.GetTokenizerRequest(), timeout=120, metadata=self._metadata
        )
        try:
            return tokenizer_archive.join(pieces)
        except tokenizer_archive.ArchiveError as e:
            raise WorkerError(f"from worker {self.ranks[0].address}: {e}") from e

    def close(self) -> None:
        self._watchdog.close()
        for rank in self.ranks:
            if rank.plans is not None:
                rank.plans.put(None)
            rank.channel.close()


def _stored_everywhere(infos: list[pb.WorkerInfo]) -> list[int]:
    """The file tier's blocks every rank's folder holds (each rank stores its
    own shard of a page: a block is readable only where all of them have it)."""
    common = set(infos[0].stored_block_hashes)
    for info in infos[1:]:
        common.intersection_update(info.stored_block_hashes)
    return [h for h in infos[0].stored_block_hashes if h in common]
