"""Helper processes of tests: each runs in a process group of its own, dies with the test
process (a parent-death signal, so a killed test run leaves none behind), and is killed with
its whole group when it overruns its time."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

# prctl(2) option that has the kernel signal a process when its parent dies.
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill what is left of ``proc``'s process group (it, or a JVM it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return  # the group is gone
    proc.wait()


def run_child(args: Sequence[str], env: Mapping[str, str], timeout_s: float,
              cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``args`` to the end (output captured as text); fail the test when it overruns
    ``timeout_s``, after killing its process group (a JVM it started included)."""
    proc = subprocess.Popen(list(args), env=dict(env), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_die_with_parent)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(args)} did not finish within {timeout_s:.0f} s:\n"
                             f"{out[-3000:]}\n{err[-5000:]}") from None
    finally:
        _kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
