"""Nothing a test run starts outlives it, even when the run is killed (SIGKILL included).

A fault run starts servers, etcd members, client drivers, Spark (a JVM and its Python workers),
busy loops that load the CPU, and network namespaces with processes inside. A run killed from
outside (a CI timeout, a SIGKILL) runs no teardown, and its children used to live on: busy
loops spinning for hours, servers holding ports, namespaces holding addresses. Three layers
make sure they go:

- Every process of the run carries a mark. ``guard()`` puts ``SBP_TEST_OWNER=<pid>-<start
  time>`` of the run's own process into its environment, which every process it starts
  inherits, however deep (``ip netns exec`` and Spark pass the environment on).
- A watchdog per run. ``guard()`` starts ``python -m integration.netlab.reaper watch OWNER``
  in a session of its own (a kill of the run's process group spares it). When the run's
  process is gone, however it ended, the watchdog kills every process carrying the run's mark
  and removes the network namespaces of processes that are gone (``network.remove_leftovers``).
- A reaper at start. ``guard()`` first does the same for every run whose process is gone (in
  case its watchdog was killed with it, say by a kill of the whole session).

``dying_with_parent()`` is a ``preexec_fn`` for the processes a test starts itself: the kernel
kills the child (SIGKILL) as soon as the thread that started it ends (Linux's parent-death
signal: the thread, not the process, so start long-lived children from the test's own thread).

    python -m integration.netlab.reaper sweep      # kill what dead runs left behind, now
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

OWNER_ENV = "SBP_TEST_OWNER"
# How often the watchdog looks whether its run is still there: the longest a leftover process
# outlives a killed run.
WATCH_INTERVAL_S = 0.2
# Killed processes may have started others meanwhile: sweep again until none is left, this
# long at most.
SWEEP_DEADLINE_S = 15.0
_PROC = Path("/proc")
_PR_SET_PDEATHSIG = 1
# Looked up now, not in the forked child (which should run as little as possible before exec).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def identity(pid: int) -> str | None:
    """``<pid>-<start time>`` of a live process (None when there is none, or a zombie): a pid
    the kernel hands out again later gets another start time."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # Fields after the name start with the state (field 3); the start time is field 22.
    if fields[0] in ("Z", "X"):
        return None
    return f"{pid}-{fields[19]}"


def alive(owner: str) -> bool:
    """Whether the process an owner mark names still runs."""
    pid, _, _ = owner.partition("-")
    return pid.isdigit() and identity(int(pid)) == owner


def marked() -> dict[int, str]:
    """Every live process carrying a mark: pid -> the owner it names."""
    found = {}
    needle = f"{OWNER_ENV}=".encode()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(needle):
                found[int(entry.name)] = item[len(needle):].decode(errors="replace")
                break
    return found


def _describe(pid: int) -> str:
    try:
        command = (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return str(pid)
    return f"{pid} {command.decode(errors='replace').strip()[:120]}"


def reap(owner: str | None = None) -> list[str]:
    """SIGKILL every process marked by ``owner`` (None: by any run that is gone), again until
    none is left, then remove the namespaces of runs that are gone; what was removed."""
    removed: list[str] = []
    deadline = time.monotonic() + SWEEP_DEADLINE_S
    while time.monotonic() < deadline:
        victims = [pid for pid, mark in marked().items()
                   if (mark == owner if owner is not None else not alive(mark))]
        if not victims:
            break
        for pid in victims:
            removed.append(_describe(pid))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return removed + _remove_namespaces()


def _remove_namespaces() -> list[str]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []  # no namespaces can have been made here
    from .network import remove_leftovers

    return remove_leftovers()


def guard() -> str:
    """Mark this process's children, reap what dead runs left, and start this run's watchdog
    (once per process); this run's owner mark."""
    owner = identity(os.getpid())
    assert owner is not None
    # The environment says it was done (this module may be imported under two names).
    if os.environ.get(OWNER_ENV) == owner:
        return owner
    left = reap()
    if left:
        print(f"killed and removed what earlier runs left behind: {'; '.join(left)}",
              file=sys.stderr)
    os.environ[OWNER_ENV] = owner
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), *filter(None, [env.get("PYTHONPATH")])])
    # Its output goes nowhere: a watchdog holding the run's stdout would keep whoever reads
    # it waiting until the watchdog ends.
    subprocess.Popen([sys.executable, "-m", "integration.netlab.reaper", "watch", owner],
                     start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return owner


def dying_with_parent() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread starting it ends (see the
    module doc), and at once if that thread's process is already gone."""
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was set up
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def watch(owner: str) -> None:
    """Wait until the process ``owner`` names is gone, then reap what it left."""
    while alive(owner):
        time.sleep(WATCH_INTERVAL_S)
    reap(owner)


def main(argv: list[str]) -> int:
    if argv[:1] == ["watch"] and len(argv) == 2:
        watch(argv[1])
        return 0
    if argv == ["sweep"]:
        for what in reap():
            print(what)
        return 0
    print("usage: python -m integration.netlab.reaper sweep | watch OWNER", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
