"""The scheduler's connection to its worker group: one Execute stream per rank.

Every rank receives every plan (tensor parallelism); rank 0's result carries
the tokens, the others' are checked for errors only. Sending never blocks
(plans queue in the stream), so plan N+1 can be on its way while the worker
computes N.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc
import structlog

from common import tokenizer_archive
from protos import worker_pb2 as pb
from protos import worker_pb2_grpc

logger = structlog.get_logger(__name__)


class WorkerError(RuntimeError):
    """The worker group cannot serve (unreachable, inconsistent, or failed)."""


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
    ) -> None:
        """``credentials``: mutual TLS to the workers (None: plaintext)."""
        if not urls:
            raise ValueError("at least one worker address is needed")
        limit = max_message_mb << 20
        self._credentials = credentials
        self._options = [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # A restarted worker is found within a second or so, not after
            # gRPC's default reconnect backoff (up to two minutes).
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 1000),
            *options,
        ]
        self.ranks = [self._rank(parse_worker_address(url)) for url in urls]
        self.info: pb.WorkerInfo | None = None

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
                    infos.append(rank.stub.GetInfo(pb.GetInfoRequest(), timeout=5))
                    break
                except grpc.RpcError as e:
                    details = e.details() or str(e)
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
        return self._form_group(infos)

    def try_connect(self, timeout_s: float = 2.0) -> pb.WorkerInfo:
        """One attempt to reach every rank (after a loss); WorkerError if any is missing."""
        infos = []
        for rank in self.ranks:
            try:
                infos.append(rank.stub.GetInfo(pb.GetInfoRequest(), timeout=timeout_s))
            except grpc.RpcError as e:
                details = e.details() if hasattr(e, "details") else str(e)
                raise WorkerError(f"worker {rank.address} did not answer: {details}") from e
        return self._form_group(infos)

    def _form_group(self, infos: list[pb.WorkerInfo]) -> pb.WorkerInfo:
        by_rank = sorted(zip(infos, self.ranks, strict=True), key=lambda p: p[0].tp_rank)
        ranks = [i.tp_rank for i, _ in by_rank]
        if ranks != list(range(len(infos))) or any(i.tp_size != len(infos) for i in infos):
            raise WorkerError(
                f"workers {ranks} do not form one tensor-parallel group of {len(infos)}"
            )
        shapes = {(i.page_size, i.num_pages, i.model.vocab_size) for i in infos}
        if len(shapes) != 1:
            raise WorkerError(f"worker ranks disagree on page size / pages / vocabulary: {shapes}")
        self.ranks = [r for _, r in by_rank]
        self.info = by_rank[0][0]
        logger.info(
            "worker group connected",
            ranks=len(self.ranks),
            model=self.info.model.name,
            pages=self.info.num_pages,
            page_size=self.info.page_size,
        )
        return self.info

    def open(self) -> None:
        """Start one Execute stream per rank (the workers drop any old state)."""
        for rank in self.ranks:
            rank.plans = queue.SimpleQueue()
            rank.results = rank.stub.Execute(iter(rank.plans.get, None))

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

    def receive(self) -> pb.StepResult:
        """The next result (rank 0's); blocks until every rank has answered."""
        results = []
        for rank in self.ranks:
            try:
                results.append(next(rank.results))
            except (grpc.RpcError, StopIteration) as e:
                raise WorkerError(f"the stream to worker {rank.address} broke: {e}") from e
        for rank, r in zip(self.ranks[1:], results[1:], strict=True):
            if r.error and not results[0].error:
                raise WorkerError(f"worker {rank.address} refused step {r.step_id}: {r.error}")
        return results[0]

    def ended(self) -> str | None:
        """Why a rank's stream has ended, or None while all are open. An idle
        loop reads no result, so this is how it learns of a worker lost meanwhile."""
        for rank in self.ranks:
            results = rank.results
            if results is not None and results.done():
                return f"the stream to worker {rank.address} ended: {results.details()}"
        return None

    def load_adapter(self, name: str, path: str, max_rank: int, timeout_s: float) -> list:
        """Start loading an adapter on every rank: one gRPC future per rank."""
        request = pb.LoadAdapterRequest(name=name, path=path, max_rank=max_rank)
        return [rank.stub.LoadAdapter.future(request, timeout=timeout_s) for rank in self.ranks]

    def unload_adapter(self, name: str, timeout_s: float = 10.0) -> None:
        """Forget an adapter on every rank (a rank that fails is logged: it
        only keeps some memory until it restarts)."""
        for rank in self.ranks:
            try:
                rank.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout_s)
            except grpc.RpcError as e:
                logger.warning("unloading an adapter failed", worker=rank.address, error=str(e))

    def tokenizer_archive(self) -> bytes:
        """The model's tokenizer files as a zip (from rank 0), checked against its sha256."""
        pieces = self.ranks[0].stub.GetTokenizer(pb.GetTokenizerRequest(), timeout=120)
        try:
            return tokenizer_archive.join(pieces)
        except tokenizer_archive.ArchiveError as e:
            raise WorkerError(f"from worker {self.ranks[0].address}: {e}") from e

    def close(self) -> None:
        for rank in self.ranks:
            if rank.plans is not None:
                rank.plans.put(None)
            rank.channel.close()
