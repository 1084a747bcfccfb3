"""tests/processes.py: helper processes do not outlive the run that started them, however it
ends: stopped with their whole group, killed with their parent, reaped by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.polling import stays_true, wait_until
from tests.processes import reap_leftovers, spawn, stop

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="process groups and the parent-death signal as Linux has")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# A helper that starts a grandchild in its own group and prints the grandchild's pid.
_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_stop_ends_the_helper_and_what_it_started(tmp_path):
    proc = spawn([sys.executable, "-c", _PARENT], records=tmp_path, stdout=subprocess.PIPE,
                 text=True)
    grandchild = int(proc.stdout.readline())
    assert (tmp_path / str(proc.pid)).exists()
    stop(proc, tmp_path, timeout=10)
    wait_until(lambda: not _alive(grandchild), timeout=10, what="the grandchild to end")
    assert not (tmp_path / str(proc.pid)).exists()


def test_a_helper_dies_with_the_process_that_started_it(tmp_path):
    starter = """
import subprocess, sys
sys.path.insert(0, sys.argv[1])
from tests.processes import spawn
proc = spawn([sys.executable, "-c", "import time; time.sleep(120)"])
print(proc.pid, flush=True)
import time; time.sleep(120)
"""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parent = subprocess.Popen([sys.executable, "-c", starter, repo], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    helper = int(parent.stdout.readline())
    try:
        assert _alive(helper)
        os.kill(parent.pid, signal.SIGKILL)  # as a test run killed outright
        parent.wait()
        wait_until(lambda: not _alive(helper), timeout=10, what="the helper to die")
    finally:
        if _alive(helper):
            os.kill(helper, signal.SIGKILL)


def test_the_next_run_reaps_what_a_killed_run_left(tmp_path):
    leftover = spawn([sys.executable, "-c", "import time; time.sleep(120)"], records=tmp_path)
    # Never stopped: the run that started it "was killed". The next run reaps it.
    assert reap_leftovers(tmp_path) == [leftover.pid]
    leftover.wait(timeout=10)
    assert leftover.returncode == -signal.SIGKILL
    assert list(tmp_path.iterdir()) == []


def test_reaping_leaves_a_process_that_reuses_a_recorded_pid_alone(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             start_new_session=True)
    try:
        (tmp_path / str(other.pid)).write_text("1")  # started at another time than this one
        assert reap_leftovers(tmp_path) == []
        stays_true(lambda: other.poll() is None, "the other process running", duration=0.3)
        assert list(tmp_path.iterdir()) == []
    finally:
        other.kill()
        other.wait()
