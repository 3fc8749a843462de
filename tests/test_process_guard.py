"""The `server` marker is enforced (tests/support/process_guard.py): a test
that starts a process beside it without the mark fails, whichever door it
uses; a command run to completion is allowed; tests/e2e/ is marked by path,
so `-m "not server"` (make test-fast) leaves it out. Each case runs in a
pytest session of its own, inside this test (no process starts)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

CONFTEST = """
from pathlib import Path

from tests.support import process_guard


def pytest_configure(config):
    config.addinivalue_line("markers", "server: starts a process beside the test")
    process_guard.install()
    config.pluginmanager.register(process_guard.ProcessGuardPlugin(Path(__file__).parent))
"""

REFUSED = """
import multiprocessing
import multiprocessing.util
import os
import subprocess


def test_popen():
    subprocess.Popen(["true"]).wait()


def test_a_multiprocessing_child():
    p = multiprocessing.get_context("spawn").Process(target=print)
    p.start()
    p.join()


def test_a_multiprocessing_helper():  # how the resource tracker and forkserver start
    multiprocessing.util.spawnv_passfds("/bin/true", ["true"], ())


def test_a_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_posix_spawn():
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)


def test_a_refusal_the_code_under_test_swallows():
    try:
        subprocess.Popen(["true"])
    except Exception:
        pass
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    return pytester


def test_every_door_to_a_new_process_fails_an_unmarked_test(project):
    project.makepyfile(test_refused=REFUSED)
    result = project.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=6)
    out = result.stdout.str()
    for door in (
        "subprocess.Popen true",
        "multiprocessing child",
        "multiprocessing helper true",
        "os.fork",
        "os.posix_spawn",
    ):
        assert f"started a process ({door}" in out, door
    result.stdout.fnmatch_lines(
        ["*test_a_refusal_the_code_under_test_swallows*refusal was caught*"]
    )


def test_a_command_run_to_completion_is_allowed(project):
    project.makepyfile(
        test_one_shot="""
        import subprocess

        def test_run():
            assert subprocess.run(["true"]).returncode == 0
            assert subprocess.check_output(["echo", "hi"]) == b"hi\\n"
        """
    )
    project.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_tests_under_e2e_are_marked_server_and_the_fast_lane_leaves_them_out(project):
    project.makepyfile(test_plain="def test_plain():\n    pass\n")
    e2e = project.mkpydir("e2e")
    (e2e / "test_served.py").write_text("def test_served():\n    pass\n")
    result = project.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not server")
    result.assert_outcomes(passed=1, deselected=1)


@pytest.mark.server
def test_a_marked_test_may_start_processes(project):
    project.makepyfile(
        test_marked="""
        import subprocess

        import pytest

        @pytest.mark.server
        def test_popen():
            subprocess.Popen(["true"]).wait()
        """
    )
    project.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)
