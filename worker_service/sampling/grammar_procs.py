"""The compile pool's handles on its processes (grammar_zygote.py holds the
other end and the wire format): the zygote, started with the model's
tokenizer info, which forks a child per ``fork()``; a child, sent one
grammar at a time, read for its answer, signalled (paused, resumed, killed).
Used by the pool's manager thread only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from common.lifeline import child_env
from worker_service.sampling.grammar_zygote import READY, recv_int, send_blob

ZYGOTE_MODULE = "worker_service.sampling.grammar_zygote"


@dataclass(eq=False)
class Child:
    pid: int
    conn: Connection
    job: Any = None  # the pool's job it compiles, if any

    def send(self, kind: str, text: str) -> None:
        self.conn.send_bytes(json.dumps({"kind": kind, "text": text}).encode())

    def answer(self) -> tuple[str, float, bytes]:
        """(error, milliseconds, compiled grammar): what it says when done; raises
        EOFError or OSError if it ended instead."""
        header = json.loads(self.conn.recv_bytes())
        error, ms = str(header["error"]), float(header["ms"])
        if error:
            return error, ms, b""
        # Paused between its two frames, it would never send the second.
        self.signal(signal.SIGCONT)
        return "", ms, self.conn.recv_bytes()

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # gone: its socket says so next
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL (a paused child too); the zygote reaps it."""
        self.signal(signal.SIGKILL)
        self.conn.close()


class Zygote:
    """The process that forks the compile children, and its control socket."""

    def __init__(self, info_json: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=child_env(),
        )
        theirs.close()
        self.sock = ours
        self.ready = False
        self.dead = False
        try:
            send_blob(ours, info_json.encode())
        except OSError:
            self.dead = True

    def fileno(self) -> int:
        return self.sock.fileno()

    def readable(self) -> None:
        """It said it is ready, or it is gone (it says nothing else unasked)."""
        try:
            got = self.sock.recv(1)
        except OSError:
            got = b""
        if got == READY:
            self.ready = True
        else:
            self.dead = True

    def fork(self) -> Child:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(self.sock, [b"F"], [theirs.fileno()])
            pid = recv_int(self.sock)
        except (OSError, EOFError):
            ours.close()
            self.dead = True
            raise
        finally:
            theirs.close()
        return Child(pid, Connection(ours.detach()))

    def close(self) -> None:
        self.sock.close()  # it exits on end-of-file; make sure
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
