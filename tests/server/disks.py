"""Disks that tests stand in for the storage's (``storage/disk.py``): the real calls, with one
of them held until the test lets it go."""

from __future__ import annotations

import threading

from sbp_spark.server.storage.disk import Disk


class HeldSyncs(Disk):
    """Every datasync of segment data waits (at most ``timeout_s``) for ``release`` before it
    runs; ``entered`` is set once one has begun."""

    def __init__(self, timeout_s: float) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.timeout_s = timeout_s

    def datasync(self, fd: int) -> None:
        self.entered.set()
        self.release.wait(self.timeout_s)
        super().datasync(fd)
