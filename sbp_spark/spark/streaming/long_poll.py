"""Long polls at the tails of a streaming read's streams.

When no stream has new records, the driver-side reader waits for one instead of letting
Spark ask again every few milliseconds: one FETCH long poll per range server, over the tails
of the open ranges it leads, all at once; the wait ends as soon as any of them sees a record
(or at its limit). Which range servers to ask is worked out from the layouts
(``poll_targets``); the polls themselves go through a ``TailWaiter``, the one call they need.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from sbp_spark.protocol.errors import SbpError

from ..planning import StreamLayout

# What the stream reader reports goes to one logger, the one docs/streaming.md names.
log = logging.getLogger("sbp_spark.spark.streaming.reader")

# Long polls of one wait run on at most this many range servers at once.
MAX_POLL_THREADS = 8
# How much longer than the polls' own limit a wait gives them to answer (a server is allowed
# to hold a long poll to its limit, then the answer still has to arrive).
ANSWER_GRACE_S = 5.0


@dataclass(frozen=True)
class Tail:
    """Where the next record of a stream will stand: the end of its open range."""

    stream_id: int
    offset: int


class TailWaiter(Protocol):
    """One long poll on the range server at ``address`` over ``positions`` ((stream_id,
    offset) pairs): the indexes of the positions that hold a record once any does or
    ``wait_ms`` passed. Raises ``SbpError`` when the poll fails."""

    def __call__(self, address: str, positions: Sequence[tuple[int, int]], wait_ms: int
                 ) -> list[int]: ...


def poll_targets(layouts: Mapping[int, StreamLayout | None]) -> dict[str, list[Tail]]:
    """The tails to watch, by the address of the range server to ask (the first replica of
    each stream's open last range, its primary). Streams whose last range is sealed, or that
    are gone, have no tail to watch."""
    targets: dict[str, list[Tail]] = {}
    for sid, layout in layouts.items():
        if layout is None or not layout.ranges or not layout.ranges[-1].is_open:
            continue
        tail = layout.ranges[-1]
        if tail.replicas:
            targets.setdefault(tail.replicas[0].address, []).append(
                Tail(sid, layout.end_offset))
    return targets


class LongPoller:
    """Waits at the tails of streams through ``waiter``; polls on several range servers run
    side by side on a pool of its own (``close`` ends it)."""

    def __init__(self, waiter: TailWaiter) -> None:
        self._waiter = waiter
        self._pool: ThreadPoolExecutor | None = None

    def wait(self, layouts: Mapping[int, StreamLayout | None], wait_ms: int) -> list[int]:
        """Wait up to ``wait_ms`` until a record arrives at a tail of ``layouts``; the
        streams that got one (none: the time passed, nothing to watch, or the polls failed;
        the next call looks again)."""
        targets = poll_targets(layouts)
        if wait_ms <= 0 or not targets:
            return []
        if len(targets) == 1:
            ((address, tails),) = targets.items()
            return self._poll(address, tails, wait_ms)
        pool = self._get_pool()
        pending: set[Future] = {pool.submit(self._poll, address, tails, wait_ms)
                                for address, tails in targets.items()}
        woken: list[int] = []
        while pending and not woken:
            done, pending = wait(pending, timeout=wait_ms / 1000.0 + ANSWER_GRACE_S,
                                 return_when=FIRST_COMPLETED)
            if not done:
                break
            for future in done:
                woken.extend(future.result())
        return woken

    def _poll(self, address: str, tails: list[Tail], wait_ms: int) -> list[int]:
        """One long poll at ``tails`` on one range server; the streams that got a record.
        A failed poll ends quietly: the caller's next wait looks again."""
        try:
            found = self._waiter(address, [(t.stream_id, t.offset) for t in tails], wait_ms)
        except SbpError as exc:
            log.debug("sbp: long poll on %s ended: %s", address, exc)
            return []
        return sorted({tails[index].stream_id for index in found})

    def _get_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_POLL_THREADS, thread_name_prefix="sbp-poll")
        return self._pool

    def close(self) -> None:
        """Stop the pool (polls under way end at their limit)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["ANSWER_GRACE_S", "MAX_POLL_THREADS", "LongPoller", "Tail", "TailWaiter",
           "poll_targets"]
