"""Process memory from /proc (Linux): resident size, its peak, and Spark's Python workers.

psutil is not a dependency; /proc/<pid>/status has what we need (VmRSS, VmHWM), and writing 5 to
/proc/<pid>/clear_refs resets VmHWM so the peak of one phase can be read on its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

# Substrings of a Python worker's command line: pyspark starts workers through pyspark.daemon
# (forked children keep its command line) or, without the daemon, pyspark.worker.
PYSPARK_WORKER_MARKERS = ("pyspark.daemon", "pyspark.worker")


def status_kib(pid: int, keys: Iterable[str]) -> dict[str, int]:
    """The ``keys`` (e.g. ``VmRSS``, ``RssAnon``, ``Threads``) of ``/proc/<pid>/status`` that it
    has, as numbers (sizes in KiB); empty if the process is gone (or this is not Linux)."""
    wanted = set(keys)
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in wanted:
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def rss_kib(pid: int) -> int | None:
    """Current resident set size of ``pid`` in KiB (None if it has exited)."""
    return status_kib(pid, ("VmRSS",)).get("VmRSS")


def hwm_kib(pid: int) -> int | None:
    """Peak resident set size of ``pid`` in KiB since it started or since ``reset_peak``."""
    return status_kib(pid, ("VmHWM",)).get("VmHWM")


def reset_peak(pid: int) -> bool:
    """Reset ``pid``'s VmHWM to its current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def find_processes(markers: Iterable[str]) -> list[int]:
    """Pids whose command line contains any of ``markers``."""
    markers = tuple(markers)
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            line = cmdline(int(entry))
            if any(m in line for m in markers):
                pids.append(int(entry))
    return sorted(pids)


def parent_pid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    # The command name (2nd field) is in parentheses and may hold spaces: split after it.
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """Pids of every living process below ``root`` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = parent_pid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in out:
                out.add(child)
                stack.append(child)
    return out


def pyspark_workers(root: int | None = None) -> list[int]:
    """Pids of the Python workers (and their daemon) of Spark sessions started below ``root``
    (default: this process), so other users' Spark jobs on the machine are not counted."""
    mine = descendants(os.getpid() if root is None else root)
    return [pid for pid in find_processes(PYSPARK_WORKER_MARKERS) if pid in mine]


class PeakSampler:
    """Samples the RSS of some processes in a background thread and keeps the peaks.

    ``pids`` is either a fixed list or a callable returning the current list (Spark's workers
    come and go). Kernel peaks (VmHWM) are folded in as well, so a spike between two samples
    still counts for processes that live through the whole phase.
    """

    def __init__(self, pids, interval_s: float = 0.05) -> None:
        self._pids = pids
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self.peak_kib: dict[int, int] = {}

    def _current(self) -> list[int]:
        return list(self._pids() if callable(self._pids) else self._pids)

    def _sample(self) -> None:
        for pid in self._current():
            value = max(rss_kib(pid) or 0, hwm_kib(pid) or 0)
            if value > self.peak_kib.get(pid, 0):
                self.peak_kib[pid] = value

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakSampler:
        for pid in self._current():
            reset_peak(pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def max_mib(self) -> float | None:
        """Largest single-process peak, MiB (None when no process was seen)."""
        return max(self.peak_kib.values()) / 1024 if self.peak_kib else None
