"""The producer identity a client appends under (idempotent appends, docs/wire.md).

Each ``SbpClient`` is one producer: a random 63-bit id, and for every range it writes to, the
next sequence number to give a batch there (from 0). A batch keeps its sequence while it is
sent again to the same range, so the range server can tell a resend from a new batch."""

from __future__ import annotations

import secrets
import threading


class Producer:
    """A producer id and its sequence counters, per (stream, range); thread-safe."""

    def __init__(self, producer_id: int | None = None) -> None:
        # Random rather than handed out by the PD: no round trip before the first append,
        # and two clients meet on one id with odds of about n^2 / 2^64.
        self.producer_id = secrets.randbits(63) if producer_id is None else int(producer_id)
        if self.producer_id < 0:
            raise ValueError(f"producer id {self.producer_id} must be >= 0")
        self._next: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Producer({self.producer_id:#x})"

    def take(self, stream_id: int, range_index: int, count: int) -> int:
        """The first of ``count`` consecutive sequences for new batches to a range."""
        key = (stream_id, range_index)
        with self._lock:
            first = self._next.get(key, 0)
            self._next[key] = first + count
            if range_index > 0:
                # Sealed ranges take no more batches: their counters are of no more use.
                self._next.pop((stream_id, range_index - 1), None)
        return first
