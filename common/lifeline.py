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
children), so a parent that died before the child got here is noticed too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

PARENT_PID_ENV = "RADIXSERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_armed = False


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for an exec'd child: ``env`` (default: ours) plus our pid."""
    out = dict(os.environ if env is None else env)
    out[PARENT_PID_ENV] = str(os.getpid())
    return out


def _set_pdeathsig(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the watch thread still covers it


def die_with_parent(
    parent_pid: int | None = None, sig: int = signal.SIGKILL, poll_s: float = 0.5
) -> None:
    """Arrange for this process to get ``sig`` when its parent goes away.

    ``parent_pid``: the parent to outlive no longer; default the pid in
    ``PARENT_PID_ENV`` if set, else the current parent. Idempotent."""
    global _armed
    if _armed:
        return
    if parent_pid is None:
        env = os.environ.get(PARENT_PID_ENV, "")
        parent_pid = int(env) if env.isdigit() else os.getppid()
    _set_pdeathsig(sig)
    _armed = True
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
