"""A child process that dies with its parent, however the parent dies.

A launcher killed with SIGKILL runs no ``finally:``; without this its
children (worker processes, the core, span and compile processes) are
reparented to PID 1 and keep running, holding ports and memory.

Two mechanisms, because neither covers everything alone:

- ``PR_SET_PDEATHSIG`` (Linux): the kernel signals the child when the
  *thread* that forked it ends. Immediate, but only for a parent thread that
  lives as long as the child should (spawn children from long-lived threads),
  and only on Linux.
- A watch thread: polls ``os.getppid()`` and signals the process itself when
  its parent changed (it was reparented). Portable, at most ``poll_s`` late.

The parent's pid is passed down explicitly (``PARENT_PID_ENV`` for exec'd
children, an argument for spawned ones), so a parent that died before the
child got here is noticed too. The variable is taken out of the environment
once read: a grandchild that inherits the environment must not mistake its
grandparent for its parent (it would kill itself at once).

The default signal is SIGKILL: a child's parent is what drives it (the
scheduler drives the workers and the core), so once it is gone there is
nothing left to drain, and a process in the middle of a long step would run
a Python SIGTERM handler only after it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import structlog

logger = structlog.get_logger(__name__)

PARENT_PID_ENV = "RADIXSERVE_PARENT_PID"
PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2
# The process that armed itself: a fork()ed child inherits this module's
# state but neither the death signal nor the watch thread, so it must arm again.
_armed_pid: int | None = None


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an exec'd child: ``env`` (default: ours) plus our pid."""
    out = dict(os.environ if env is None else env)
    out[PARENT_PID_ENV] = str(os.getpid())
    return out


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def set_pdeathsig(sig: int) -> bool:
    """PR_SET_PDEATHSIG; False where it is not available (the watch still works)."""
    libc = _libc()
    if libc is None:
        return False
    zero = ctypes.c_ulong(0)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), zero, zero, zero) != 0:
        logger.warning("PR_SET_PDEATHSIG failed", errno=ctypes.get_errno())
        return False
    return True


def pdeathsig() -> int:
    """The death signal set for this process (0: none, or not Linux)."""
    libc = _libc()
    if libc is None:
        return 0
    out = ctypes.c_int(0)
    zero = ctypes.c_ulong(0)
    libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(out), zero, zero, zero)
    return out.value


def die_with_parent(
    parent_pid: int | None = None, sig: int = signal.SIGKILL, poll_s: float = 0.5
) -> None:
    """Arrange for this process to get ``sig`` when its parent goes away.

    ``parent_pid``: the parent to outlive no longer; default the pid in
    ``PARENT_PID_ENV`` if set, else the current parent. Idempotent within a
    process (a forked child arms itself again)."""
    global _armed_pid
    env = os.environ.pop(PARENT_PID_ENV, "")
    if _armed_pid == os.getpid():
        return
    if parent_pid is None:
        parent_pid = int(env) if env.isdigit() else os.getppid()
    set_pdeathsig(sig)
    _armed_pid = os.getpid()
    if os.getppid() != parent_pid:  # gone before we got here
        os.kill(os.getpid(), sig)
        return

    def watch() -> None:
        event = threading.Event()
        while not event.wait(poll_s):
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), sig)
                return

    threading.Thread(target=watch, daemon=True, name="lifeline").start()


def die_with_launcher(sig: int = signal.SIGKILL) -> bool:
    """For a program that can also run on its own (``radixserve-worker``): die
    with the parent only if a launcher asked for it (``child_env``), so that a
    worker started by hand, by a shell that exits or by ``nohup``, runs on.
    Returns whether it armed."""
    if not os.environ.get(PARENT_PID_ENV, "").isdigit():
        return False
    die_with_parent(sig=sig)
    return True
