"""Helper processes that cannot outlive the test run that started them.

Each one is started in a process group of its own (so a stop reaches what it started, such as
Spark's JVM) with a parent-death signal (the kernel kills it when the test process dies, even
by SIGKILL), and, given a ``records`` directory, is written down there until it is stopped:
``reap_leftovers`` at the start of the next run kills the groups a killed run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (field 22 of /proc/PID/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def spawn(argv: Sequence[str], records: Path | None = None, **kwargs: Any) -> subprocess.Popen:
    """Start ``argv`` as a helper (see the module docstring); ``kwargs`` go to Popen."""
    proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent,
                            **kwargs)
    if records is not None:
        records.mkdir(parents=True, exist_ok=True)
        (records / str(proc.pid)).write_text(_start_time(proc.pid) or "")
    return proc


def stop(proc: subprocess.Popen, records: Path | None = None,
         timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the helper's process group, SIGKILL it if the helper is still there after
    ``timeout`` seconds, and forget it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    # What the helper started may linger after it exits: the group goes in any case.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if records is not None:
        (records / str(proc.pid)).unlink(missing_ok=True)


def reap_leftovers(records: Path) -> list[int]:
    """SIGKILL the process groups of helpers a killed run wrote down in ``records`` and never
    stopped, if their leader is still the process started then; return the pids reaped."""
    reaped = []
    if not records.is_dir():
        return reaped
    for record in records.iterdir():
        if not record.name.isdigit():
            continue
        pid = int(record.name)
        now = _start_time(pid)
        # A live leader started at another time is a new process that reuses the pid. A dead
        # leader whose group lives on is ours: Linux hands out no pid that a group still uses.
        if now is None or now == record.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
                reaped.append(pid)
        record.unlink(missing_ok=True)
    return reaped
