"""A killed run leaves nothing behind: no busy loop, server, etcd member, client driver or
network namespace outlives a pytest run killed with SIGKILL (``integration/netlab/reaper.py``).

The case starts ``leftover_tree.py`` in a pytest of its own, waits until its processes run,
kills that pytest (the process alone, as a CI timeout may) and waits, with a deadline, until
every one of them is gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration.netlab.network import run, unavailable
from integration.netlab.reaper import OWNER_ENV, alive, dying_with_parent, identity, marked
from tests.etcd import require_etcd

from .helpers import wait_until

TREE = Path(__file__).with_name("leftover_tree.py")
REPO = Path(__file__).resolve().parents[2]
# A cold pytest, an etcd, a PD node and a range server (and a network) on a busy machine.
READY_TIMEOUT_S = 180.0
# The watchdog looks every 0.2 s; killing and sweeping takes a few seconds at most.
GONE_TIMEOUT_S = 30.0


def _watchdogs(owner: str) -> list[int]:
    """Pids of watchdogs (``reaper.guard``) of the run ``owner`` names."""
    tail = f"-m\0integration.netlab.reaper\0watch\0{owner}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().endswith(tail):
                found.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return found


def _survivors(started: dict[str, str], owner: str, namespaces: list[str]) -> list[str]:
    left = [f"{name} ({mark})" for name, mark in started.items() if alive(mark)]
    left += [f"pid {pid} marked by the killed run" for pid, mark in marked().items()
             if mark == owner]
    left += [f"pid {pid}: the killed run's watchdog" for pid in _watchdogs(owner)]
    existing = set(run("ip", "netns", "list", check=False).split()) if namespaces else set()
    left += [f"namespace {ns}" for ns in namespaces if ns in existing]
    return left


@pytest.mark.timeout(300)
@pytest.mark.parametrize("network", [False, True], ids=["loopback", "namespaces"])
def test_a_killed_run_leaves_nothing_behind(tmp_path, network):
    require_etcd()
    if network and (reason := unavailable()) is not None:
        pytest.skip(f"network namespaces: {reason}")
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("SBP_FAULTS_REPORT", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    env.update(SBP_LEFTOVER_READY=str(ready), SBP_LEFTOVER_NETWORK="1" if network else "0")
    log_path = tmp_path / "run.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", str(TREE), "-q", "-p", "no:cacheprovider",
             "--basetemp", str(tmp_path / "run"), "--timeout", "900"],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=dying_with_parent())
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, READY_TIMEOUT_S,
                   f"the run to kill to start its processes (log: {log_path})")
        assert proc.poll() is None, f"the run ended by itself: {log_path.read_text()[-3000:]}"
        info = json.loads(ready.read_text())
        started: dict[str, str] = info["processes"]
        owner = identity(proc.pid)
        assert owner is not None
        assert all(alive(mark) for mark in started.values()), started
        assert any(mark == owner for mark in marked().values()), \
            f"no process carries the run's {OWNER_ENV} mark"
        assert _watchdogs(owner), "the run has no watchdog"
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while left := _survivors(started, owner, info["namespaces"]):
        assert time.monotonic() < deadline, \
            f"{GONE_TIMEOUT_S:g} s after the run was killed, still there: {left}"
        time.sleep(0.1)
