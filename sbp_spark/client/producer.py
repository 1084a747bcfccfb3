"""The producer identity a client appends under (idempotent appends, docs/wire.md).

Each ``SbpClient`` is one producer: a random 63-bit id, and for every range it writes to, the
next sequence number to give a batch there (from 0). A batch keeps its sequence while it is
sent again to the same range, so the range server can tell a resend from a new batch."""

from __future__ import annotations

import os
import secrets
import threading

# How many times this process was forked off (``os.register_at_fork``): os.fork, which Spark's
# Python workers and multiprocessing use. A producer made before the last fork begins anew in
# the child; comparing a counter costs nothing next to asking the kernel for the pid at every
# append.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class Producer:
    """A producer id and its sequence counters, per (stream, range); thread-safe.

    A forked child (a Spark worker forked from a process that made the client) becomes a
    producer of its own at its first use: two processes numbering batches under one id would
    have the range server answer one's batch as the other's."""

    def __init__(self, producer_id: int | None = None) -> None:
        if producer_id is not None and int(producer_id) < 0:
            raise ValueError(f"producer id {producer_id} must be >= 0")
        self._lock = threading.Lock()
        self._fixed = None if producer_id is None else int(producer_id)
        self._begin()

    def _begin(self) -> None:
        # Random rather than handed out by the PD: no round trip before the first append,
        # and two clients meet on one id with odds of about n^2 / 2^64.
        self._id = self._fixed if self._fixed is not None else secrets.randbits(63)
        self._next: dict[tuple[int, int], int] = {}
        self._born = _forks

    def __repr__(self) -> str:
        return f"Producer({self.producer_id:#x})"

    @property
    def producer_id(self) -> int:
        """This process's producer id."""
        if self._born != _forks:
            with self._lock:
                if self._born != _forks:
                    self._begin()
        return self._id

    def take(self, stream_id: int, range_index: int, count: int) -> tuple[int, int]:
        """(producer id, first of ``count`` consecutive sequences) for new batches to a range.

        Every range's counter is kept (an int per range this client wrote to): a writer that
        has not heard of a seal yet may still number batches for the range before, and a
        sequence given out twice there would be answered as the other batch, not stored."""
        key = (stream_id, range_index)
        with self._lock:
            if self._born != _forks:
                self._begin()
            first = self._next.get(key, 0)
            self._next[key] = first + count
            return self._id, first
