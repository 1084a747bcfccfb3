"""A stream moving on to its next range: seal the open one, open the next, tell their servers.

``Succession.seal_and_open_next`` is the one place where that happens, for a client's
SEAL_RANGES (``ranges.py``) and for a failover (``failover.py``) alike, once the range's
replicas said where it ends: the range is sealed in the metadata at that end and, in the same
change, the next range opens on the servers placement chose (under its lock, so that choices
see each other's load; away from the primaries of the stream's ranges sealed lately where
it can, see ``RecentPrimaries`` and ``placement.choose_servers``); then both ranges are
pushed to their servers. With too few live servers the range is sealed all the same (no
write can be acknowledged on it any more) and the next one opens later (``open_next``: a
seal repeated, or CREATE_RANGE).

The caller holds the stream's lock (``StreamLocks``) from before it asked the replicas until
this returns, so the push is done before anyone else may change the stream: a seal right
behind this one (a script sealing in a loop, racing writers) would otherwise reach the new
range's primary before the range did, and fail with RANGE_NOT_FOUND. The sealed range's
replicas are fenced until they hear its end (read_cap.py), which the same push tells them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from sbp_spark.protocol.errors import ServerError

from .meta import RangeMeta, StreamMeta
from .placement import Placement


class StreamLocks:
    """One lock per stream: changes of its ranges, and the pushes telling its servers about
    them, happen one at a time."""

    def __init__(self) -> None:
        self._locks: defaultdict[int, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()

    @contextmanager
    def hold(self, stream_id: int) -> Iterator[None]:
        """Hold the lock of ``stream_id`` for the ``with`` block."""
        with self._guard:
            lock = self._locks[stream_id]
        with lock:
            yield


class SuccessionStore(Protocol):
    """What a succession reads and changes in the metadata."""

    def get_stream(self, stream_id: int) -> StreamMeta: ...

    def seal_range(self, stream_id: int, range_index: int, end_offset: int,
                   next_servers: Sequence[int] | None = None
                   ) -> tuple[RangeMeta, RangeMeta | None]: ...

    def open_next_range(self, stream_id: int, servers: Sequence[int]) -> RangeMeta: ...


class Pusher(Protocol):
    """How a succession tells range servers about their ranges (``pushes.RangePushes``)."""

    def push(self, ranges: Iterable[RangeMeta], timeout_s: float | None = None,
             skip: Iterable[int] = ()) -> None: ...


@dataclass(frozen=True, slots=True)
class Succeeded:
    """What ``seal_and_open_next`` did: the range sealed and the one opened after it, or None
    and why none (too few live servers)."""

    sealed: RangeMeta
    opened: RangeMeta | None
    unplaced: ServerError | None = None


# How long the primary of a sealed range is kept away from being its stream's primary again
# (``RecentPrimaries``): long enough for a writer to give up on a second unreachable primary
# (a few seconds each), short enough that a server back from a fault soon takes its share.
RECENT_SEAL_S = 60.0
# How long it is kept away from the next range of any other stream: a fault that made one
# stream's range unusable on that server (a primary cut off from its secondaries) usually
# hits every range it leads, and their seals come within seconds of each other.
RECENT_SEAL_ANY_STREAM_S = 15.0


class RecentPrimaries:
    """The primaries of ranges sealed lately, and the secondaries those primaries said they
    could not reach: where placement should not put a stream's next range
    (``choose_servers``). Those of the stream's own ranges count for ``stream_s`` seconds,
    those of any stream's for ``any_stream_s``.

    A primary that could not reach a secondary sealed its range itself; the broken link has
    two ends, and the PD cannot tell which one is at fault (it hears both). Keeping only the
    primary away would let the next range pair the other end with a third server it cannot
    reach either (a server cut off from all its peers), and its writers would wait out the
    forward's give-up time a second time.

    Kept in memory by the PD in office: a new leader starts without it, and places by load
    alone until the next seals."""

    def __init__(self, stream_s: float = RECENT_SEAL_S,
                 any_stream_s: float = RECENT_SEAL_ANY_STREAM_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream_s = stream_s
        self.any_stream_s = any_stream_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seals: list[tuple[float, int, int]] = []  # (when, stream, primary), oldest first

    def add(self, stream_id: int, primary: int, unreachable: Sequence[int] = ()) -> None:
        """``primary``'s range of ``stream_id`` was sealed now; ``unreachable``: the
        secondaries it could not reach (they count as sealed just after it)."""
        now = self._clock()
        keep = max(self.stream_s, self.any_stream_s)
        with self._lock:
            # Seals are rare: the list holds those of the last minute.
            self._seals = [seal for seal in self._seals if now - seal[0] <= keep]
            self._seals.append((now, stream_id, primary))
            self._seals.extend((now, stream_id, sid) for sid in unreachable if sid != primary)

    def of(self, stream_id: int) -> list[int]:
        """The servers to keep ``stream_id``'s next primary away from, newest seal first."""
        now = self._clock()
        with self._lock:
            newest_first = self._seals[::-1]
        return list(dict.fromkeys(
            primary for at, sid, primary in newest_first
            if now - at <= (self.stream_s if sid == stream_id else self.any_stream_s)))


class Succession:
    """Seals a stream's open range and opens the next one (see the module doc)."""

    def __init__(self, store: SuccessionStore, placement: Placement, pushes: Pusher,
                 recent: RecentPrimaries | None = None) -> None:
        self._store = store
        self._placement = placement
        self._pushes = pushes
        self._recent = RecentPrimaries() if recent is None else recent

    def seal_and_open_next(self, rng: RangeMeta, end_offset: int, *,
                           timeout_s: float | None = None, skip: Iterable[int] = (),
                           wait_for_servers: bool = True,
                           announce: Callable[[Succeeded], None] | None = None,
                           unreachable: Sequence[int] = ()) -> Succeeded:
        """Seal ``rng`` at ``end_offset`` (what its replicas reported), open its successor,
        push both; the caller holds the stream's lock. ``skip``: servers known to be down
        (owed a resync instead of a push). ``wait_for_servers``: give the servers this PD has
        not heard from yet their chance before counting them out (``Placement.place``).
        ``announce`` is told what was decided as soon as the metadata holds it, before the
        push (which may take a server's timeout): the caller's log line. ``unreachable``: the
        secondaries the primary said it could not reach, kept away from the next range with
        the primary (``RecentPrimaries``)."""
        stream = self._store.get_stream(rng.stream_id)
        if rng.primary is not None:
            self._recent.add(rng.stream_id, rng.primary, unreachable)
        (sealed, opened), unplaced = self._placement.place_if_possible(
            stream.replica_nums,
            lambda servers: self._store.seal_range(rng.stream_id, rng.range_index, end_offset,
                                                   servers),
            wait=wait_for_servers, succeeding=self._recent.of(rng.stream_id))
        done = Succeeded(sealed, opened, unplaced)
        if announce is not None:
            announce(done)
        self._pushes.push([sealed] if opened is None else [sealed, opened], timeout_s, skip)
        return done

    def open_next(self, stream_id: int, timeout_s: float | None = None) -> RangeMeta:
        """Open the range after the stream's last one, which is sealed, and push it; the caller
        holds the stream's lock. Too few live servers raise ``NotEnoughServersError``."""
        stream = self._store.get_stream(stream_id)
        opened = self._placement.place(
            stream.replica_nums, lambda servers: self._store.open_next_range(stream_id, servers))
        self._pushes.push([opened], timeout_s)
        return opened
