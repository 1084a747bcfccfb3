"""One server per data directory: an exclusive lock held while a server has it open.

Two servers on one directory would each recover, append to and truncate the same files; the
second must refuse to start instead. The lock is ``flock`` on a ``LOCK`` file in the
directory: the kernel drops it when its holder exits, however it exits, so a crash never
leaves a stale lock behind. The file holds the holder's pid, only to name it in the error.
"""

from __future__ import annotations

import fcntl
import os

LOCK_FILE = "LOCK"


class DataDirInUseError(RuntimeError):
    """Another server (process or object) has the data directory open."""


class DataDirLock:
    """Holds the lock on ``directory`` from construction until ``release()``."""

    def __init__(self, directory: str | os.PathLike[str], what: str) -> None:
        self.path = os.path.join(os.fspath(directory), LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            by = f"process {holder}" if holder else "another server"
            raise DataDirInUseError(
                f"{what} data directory {os.fspath(directory)} is in use by {by}: stop that "
                "server first, or give this one a different data directory") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Let another server open the directory (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops the flock


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
