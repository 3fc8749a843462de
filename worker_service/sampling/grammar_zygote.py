"""THE GRAMMAR COMPILE PROCESSES: ``python -m worker_service.sampling.grammar_zygote FD``.

The *zygote* is started once by a worker's compile pool (grammar_pool.py). It
imports xgrammar (2.5-4 s: torch and transformers come with it), takes the
model's tokenizer info from the worker, and then forks one *compile child*
per request. Forking a process that has all of that loaded costs
milliseconds where a fresh interpreter costs seconds; forking the worker
itself (gRPC and torch threads) would be unsafe, so the zygote stays a clean
single-threaded process. It runs at lower CPU priority (``NICE``; its
children inherit it): the worker's step loop keeps its cores.

Lifelines: the zygote reads its control socket (FD) and nothing else, so it
sees end-of-file as soon as its worker is gone, however the worker died, and
exits. Each child arms ``die_with_parent`` (the zygote, single-threaded, is
the thread that forked it), so the children go with the zygote. The kernel
reaps the children (SIGCHLD ignored): a child the worker SIGKILLs is gone
from /proc at once.

Wire format (no pickle: the worker trusts nothing it did not ask for):
control socket, worker -> zygote: the tokenizer info JSON (8-byte length,
bytes), then per child one byte with the child's socket attached
(SCM_RIGHTS); zygote -> worker: ``READY`` once, then each child's pid (8
bytes). Child socket (multiprocessing ``Connection`` frames): worker -> child
a JSON header ``{"kind", "text"}``; child -> worker a JSON header ``{"ms",
"error"}`` and, when it compiled, a second frame with xgrammar's
``CompiledGrammar.serialize_json()``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

NICE = 10
READY = b"R"
_LEN = struct.Struct("!q")


def send_blob(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the socket")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_blob(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return recv_exact(sock, n)


def recv_int(sock: socket.socket) -> int:
    return _LEN.unpack(recv_exact(sock, _LEN.size))[0]


def send_int(sock: socket.socket, value: int) -> None:
    sock.sendall(_LEN.pack(value))


def main(argv: list[str]) -> int:
    # A terminal's Ctrl-C reaches the whole process group: it is the worker's
    # to handle, and the worker's end ends us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    os.nice(NICE)
    ctrl = socket.socket(fileno=int(argv[0]))
    try:
        info_json = recv_blob(ctrl).decode()
    except (EOFError, OSError):
        return 0
    import xgrammar

    # Loaded once here rather than in every child.
    import common.lifeline  # noqa: F401
    import worker_service.sampling.grammar_compile  # noqa: F401

    info = xgrammar.TokenizerInfo.deserialize_json(info_json)
    ctrl.sendall(READY)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 1, 1)
        except OSError:
            return 0
        if not msg:
            return 0  # the worker is gone
        if not fds:
            continue
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            status = 0
            try:
                _child(fds[0], info)
            except BaseException:
                traceback.print_exc()  # to the worker's stderr
                status = 1
            os._exit(status)  # never the zygote's cleanup
        os.close(fds[0])
        try:
            send_int(ctrl, pid)
        except OSError:
            return 0


def _child(fd: int, info: Any) -> None:
    from common.lifeline import die_with_parent

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Explicitly the zygote: the environment names the worker (child_env).
    die_with_parent(os.getppid())
    import xgrammar

    from worker_service.sampling.grammar_compile import GrammarError, compile_grammar

    conn = Connection(fd)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            compiled = compile_grammar(compiler, job["kind"], job["text"])
        except GrammarError as e:
            ms = (time.perf_counter() - t0) * 1e3
            conn.send_bytes(json.dumps({"ms": ms, "error": str(e)}).encode())
            continue
        payload = compiled.serialize_json().encode()
        ms = (time.perf_counter() - t0) * 1e3
        conn.send_bytes(json.dumps({"ms": ms, "error": ""}).encode())
        conn.send_bytes(payload)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
