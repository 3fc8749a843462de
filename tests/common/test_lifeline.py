"""common/lifeline.py with real processes: a child armed by die_with_parent
dies when its parent is SIGKILLed (by the kernel's death signal, or by the
watch thread alone), at once if its parent was gone before it armed; the
parent pid it was handed is not passed on to its own children; a forked
child arms again; die_with_launcher arms only when a launcher asked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from common.lifeline import PARENT_PID_ENV, child_env
from tests.support.process_tree import read, still_running

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, **kw)


def _wait_file(path: Path, timeout_s: float = 30) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().endswith("\n")):
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.02)
    return path.read_text().strip()


def _orphaned_child(tmp_path: Path, arm: str) -> float:
    """A parent starts a child that runs ``arm``; the parent is SIGKILLed.
    Returns how long the child outlived it (fails past 2 s)."""
    armed = tmp_path / "armed"
    parent = _python(
        f"""
        import subprocess, sys, time
        from common.lifeline import child_env
        code = '''
        import time
        {arm}
        open({str(armed)!r}, "w").write("armed\\\\n")
        time.sleep(60)
        '''
        child = subprocess.Popen([sys.executable, "-c", code], env=child_env())
        open({str(tmp_path / "child")!r}, "w").write(f"{{child.pid}}\\n")
        time.sleep(60)
        """
    )
    try:
        child = read(int(_wait_file(tmp_path / "child")))
        assert child is not None
        _wait_file(armed)
        parent.kill()
        parent.wait()
        t0 = time.monotonic()
        left = still_running([child], 2.0)
        assert not left, "the child outlived its parent by 2 s"
        return time.monotonic() - t0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.server  # children it watches
def test_a_child_dies_at_once_when_its_parent_is_killed(tmp_path):
    # the watch would take 30 s: only the kernel's death signal is this fast
    arm = "from common.lifeline import die_with_parent; die_with_parent(poll_s=30)"
    assert _orphaned_child(tmp_path, arm) < 0.5


@pytest.mark.server  # children it watches
def test_the_watch_thread_alone_notices_a_dead_parent(tmp_path):
    # as where PR_SET_PDEATHSIG is missing, or its forking thread outlives the parent
    arm = (
        "from common import lifeline; lifeline.set_pdeathsig = lambda sig: False; "
        "lifeline.die_with_parent(poll_s=0.1)"
    )
    assert _orphaned_child(tmp_path, arm) < 1.5


@pytest.mark.server  # children it watches
def test_a_child_whose_parent_died_before_it_armed_dies_at_once():
    # the pid handed down is not the parent's any more: it was reparented
    env = {**os.environ, PARENT_PID_ENV: str(os.getppid())}
    proc = _python(
        "from common.lifeline import die_with_parent; die_with_parent(); print('alive')",
        env=env,
        stdout=subprocess.PIPE,
    )
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL and b"alive" not in out


@pytest.mark.server  # children it watches
def test_the_parent_pid_is_not_handed_on_to_grandchildren():
    """A grandchild that inherits the environment and arms with the default
    (its own parent) must not take its grandparent's pid for its parent."""
    code = """
        import os, subprocess, sys
        from common.lifeline import PARENT_PID_ENV, die_with_parent
        die_with_parent()
        print("env:", os.environ.get(PARENT_PID_ENV), flush=True)
        grandchild = subprocess.run(
            [sys.executable, "-c",
             "from common.lifeline import die_with_parent; die_with_parent(); print('alive')"],
            capture_output=True, text=True,
        )
        print("grandchild:", grandchild.returncode, grandchild.stdout.strip(), flush=True)
    """
    proc = _python(code, env=child_env(), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "env: None" in out
    assert "grandchild: 0 alive" in out


def test_a_forked_child_arms_again():
    """fork() clears the death signal and leaves the watch thread behind; a
    process that armed, forked, and arms in the child must be armed there."""
    code = """
        import os
        from common.lifeline import die_with_parent, pdeathsig
        die_with_parent(os.getppid())
        pid = os.fork()
        if pid == 0:
            before = pdeathsig()
            die_with_parent(os.getppid())
            print("child:", before, pdeathsig(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent:", pdeathsig(), flush=True)
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    kill = int(signal.SIGKILL)
    assert f"child: 0 {kill}" in out.stdout and f"parent: {kill}" in out.stdout


@pytest.mark.server  # children it watches
def test_die_with_launcher_arms_only_when_a_launcher_asked():
    code = """
        from common.lifeline import die_with_launcher, pdeathsig
        print(die_with_launcher(), pdeathsig(), flush=True)
    """
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
    alone = _python(code, env=env, stdout=subprocess.PIPE, text=True).communicate(timeout=30)[0]
    launched = _python(code, env=child_env(env), stdout=subprocess.PIPE, text=True)
    assert alone.split() == ["False", "0"]
    assert launched.communicate(timeout=30)[0].split() == ["True", str(int(signal.SIGKILL))]
