"""Where ranges go and which range servers are alive.

Kept apart from the PD's wire handling so the rules can be tested on their own:
``Liveness`` tracks heartbeats on a monotonic clock, ``choose_servers`` picks the replicas of a
new range, and ``Placement`` makes each choice, one at a time, with what it records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sbp_spark.protocol.errors import InvalidRequestError, NotEnoughServersError, ServerError

from .meta import ServerMeta

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ServerState:
    """What liveness knows about one range server."""

    server_id: int
    advertise_addr: str
    last_seen: float  # the Liveness clock's time of the last heartbeat


class Liveness:
    """Heartbeat bookkeeping: a server is live while its last heartbeat is younger than
    ``timeout_s``.

    Only heartbeats received by this process count, so after a PD restart no server is live
    until it heartbeats again. ``expire()`` reports servers that went silent, once each, which
    is the hook for failover (sealing their ranges elsewhere). Silence alone is not enough
    there: a PD cut off from the network hears nobody, and must not take every server for
    dead and fail their ranges over the moment the network heals. So a server is reported
    only when it was silent for ``timeout_s`` *while the PD kept hearing other servers*:
    another server's heartbeat arrived more than ``timeout_s`` after its last one, and after
    a stretch in which the PD heard nobody for ``timeout_s`` (it was the one cut off, or every
    server was down), every server gets ``timeout_s`` from the first heartbeat to speak up.

    The same goes for placement: a view younger than ``timeout_s`` (a PD that just started or
    took office) may not have heard yet from servers that are alive; ``wait_for_live`` gives
    them the rest of that time before a placement counts them out.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError(f"liveness timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._servers: dict[int, ServerState] = {}
        self._dead: set[int] = set()
        self._left: set[int] = set()  # servers that said goodbye since the view began
        self._changed = threading.Condition(self._lock)  # a heartbeat arrived
        self._since = clock()  # when this view began: creation or the last ``clear()``
        self._heard: float | None = None  # the newest heartbeat from any server
        # Since when heartbeats kept arriving without a gap longer than the timeout.
        self._contact_since = 0.0

    def beat(self, server_id: int, advertise_addr: str) -> bool:
        """Record a heartbeat. True when the server was not live before (new or returning)."""
        now = self._clock()
        with self._lock:
            if self._heard is None or now - self._heard > self.timeout_s:
                self._contact_since = now
            self._heard = now
            prev = self._servers.get(server_id)
            returning = prev is None or server_id in self._dead or \
                now - prev.last_seen > self.timeout_s
            self._servers[server_id] = ServerState(server_id, advertise_addr, now)
            self._dead.discard(server_id)
            self._left.discard(server_id)
            self._changed.notify_all()
            return returning

    def forget(self, server_id: int) -> None:
        """Drop a server at once (it said goodbye)."""
        with self._lock:
            self._servers.pop(server_id, None)
            self._dead.discard(server_id)
            self._left.add(server_id)

    def clear(self) -> None:
        """Forget every server (a PD taking or leaving office starts over), and what it heard:
        silence before this counts as no evidence."""
        with self._lock:
            self._servers.clear()
            self._dead.clear()
            self._left.clear()
            self._heard = None
            self._contact_since = 0.0
            self._since = self._clock()

    def young(self) -> bool:
        """Whether this view is younger than the timeout: a server that is alive may not have
        reached it yet, so a placement short of servers has reason to wait (``wait_for_live``).
        Once it is old, every live server has had a whole timeout to be heard."""
        with self._lock:
            return self._young_for_locked() > 0

    def _young_for_locked(self) -> float:
        """Seconds until this view is ``timeout_s`` old, on the liveness clock (caller holds
        ``_lock``); 0 or less once it is."""
        return self._since + self.timeout_s - self._clock()

    def wait_for_live(self, count: int, known: Iterable[int], rather_not: Iterable[int] = ()
                      ) -> bool:
        """Whether ``count`` servers are live, after waiting, while this view is younger than
        the timeout, for those of the ``known`` servers (ids the PD issued) it has not heard
        from yet: they may be alive and still looking for this PD. No wait when they could not
        make up ``count`` even then (a server that said goodbye or went silent in this view
        is not waited for), and none once the view is ``timeout_s`` old.

        ``rather_not``: servers a placement uses only when it must (``choose_servers``'s
        ``succeeding``). While fewer than ``count`` others are live, the unheard ones among
        the others are waited for too, even with ``count`` live: each one heard gives the
        placement a better choice."""
        known = set(known)
        rather_not = set(rather_not)
        with self._lock:
            # The wait is bounded on the real clock: the liveness clock may be a test's.
            deadline = time.monotonic() + self._young_for_locked()
            while True:
                live = [st.server_id for st in self._live_locked(self._clock())]
                unheard = [sid for sid in known
                           if sid not in self._servers and sid not in self._left]
                possible = len(live) + len(unheard) >= count
                lacking = len(live) < count
                better = sum(1 for sid in live if sid not in rather_not) < count and \
                    any(sid not in rather_not for sid in unheard)
                left = deadline - time.monotonic()
                if not possible or not (lacking or better) or left <= 0:
                    return len(live) >= count
                self._changed.wait(left)

    def in_contact_for(self) -> float:
        """Seconds since heartbeats began arriving without a gap longer than the timeout
        (0 while the PD hears nobody): how long every server has had to reach it."""
        now = self._clock()
        with self._lock:
            if self._heard is None or now - self._heard > self.timeout_s:
                return 0.0
            return now - self._contact_since

    def is_live(self, server_id: int) -> bool:
        now = self._clock()
        with self._lock:
            st = self._servers.get(server_id)
            return st is not None and self._fresh(st, now)

    def silent_for(self, server_id: int) -> float | None:
        """Seconds since this view last heard ``server_id`` (None: not heard in this view).
        A writer that lost its primary asks whether the PD heard it after that
        (``RangeServerState.silent_ms``): only then is the link between the two broken
        rather than the server stopped."""
        now = self._clock()
        with self._lock:
            st = self._servers.get(server_id)
            return None if st is None else now - st.last_seen

    def quiet(self, longer_than: float) -> list[ServerState]:
        """Servers heard in this view and not since ``longer_than`` seconds (short of the
        timeout, it may be a missed heartbeat), not yet reported by ``expire``."""
        now = self._clock()
        with self._lock:
            return [s for s in self._servers.values() if s.server_id not in self._dead
                    and now - s.last_seen > longer_than]

    def went_silent(self, server_id: int) -> bool:
        """Whether this view has evidence that ``server_id`` is down or cut off: it heard the
        server, then nothing for ``timeout_s`` while it kept hearing others (the evidence
        failover acts on). A server not heard yet in this view (a PD that just took office)
        is not silent, only unknown."""
        now = self._clock()
        with self._lock:
            st = self._servers.get(server_id)
            if st is None or self._fresh(st, now):
                return False
            return self._heard is not None and now - self._heard <= self.timeout_s \
                and self._heard - st.last_seen > self.timeout_s

    def live(self) -> list[ServerState]:
        """Live servers in id order."""
        now = self._clock()
        with self._lock:
            return sorted(self._live_locked(now), key=lambda s: s.server_id)

    def _fresh(self, st: ServerState, now: float) -> bool:
        """Whether ``st`` was heard within the timeout: what live means."""
        return now - st.last_seen <= self.timeout_s

    def _live_locked(self, now: float) -> list[ServerState]:
        """The live servers (caller holds ``_lock``)."""
        return [s for s in self._servers.values() if self._fresh(s, now)]

    def address(self, server_id: int) -> str | None:
        """The address the server announced last (live or not), if it ever heartbeated."""
        with self._lock:
            st = self._servers.get(server_id)
            return None if st is None else st.advertise_addr

    def expire(self) -> list[ServerState]:
        """Servers found silent since the last call (each reported once): silent for the
        timeout while other servers were heard (see the class doc)."""
        with self._lock:
            heard = self._heard
            if heard is None:
                return []
            gone = [s for s in self._servers.values() if s.server_id not in self._dead
                    and heard - max(s.last_seen, self._contact_since) > self.timeout_s]
            self._dead.update(s.server_id for s in gone)
            return sorted(gone, key=lambda s: s.server_id)


def choose_servers(live: Iterable[int], load: Mapping[int, int], count: int,
                   succeeding: Sequence[int] = ()) -> list[int]:
    """Pick ``count`` distinct servers for a new range, least loaded first.

    ``load`` maps server id to its number of open ranges (absent = 0); ties go to the lower id
    so placement is deterministic. The first server returned is the primary.

    ``succeeding``: the primaries of the ranges this one follows that were sealed lately, the
    newest first. They are left out when enough other servers are live; otherwise they serve
    as secondaries, and the primary is one of them only when every live server is one (then
    the one sealed longest ago). A range is mostly sealed because its primary could not be
    used: a writer could not reach it, or it could not reach its secondaries
    (``docs/reliability.md``, "Partitions"); the PD hears it all the same, and choosing by
    load alone would hand the next range to it again, every time. Looking back past the last
    seal keeps two such primaries from taking turns: a seal of the next range (another
    writer's, or its primary's own) would otherwise put the range back on the first.
    """
    if count < 1:
        raise InvalidRequestError(f"a range needs at least 1 replica, got {count}")
    candidates = sorted(set(live), key=lambda sid: (load.get(sid, 0), sid))
    if count > len(candidates):
        raise NotEnoughServersError(
            f"{count} replicas requested but only {len(candidates)} range "
            f"server{'s are' if len(candidates) != 1 else ' is'} live")
    recent = list(dict.fromkeys(sid for sid in succeeding if sid in candidates))
    others = [sid for sid in candidates if sid not in recent]
    # The recent primaries last, the one sealed longest ago first among them.
    return (others + recent[::-1])[:count]


class ServerLoad(Protocol):
    """What placement reads of the metadata."""

    def open_range_counts(self) -> dict[int, int]: ...

    def list_servers(self) -> list[ServerMeta]: ...


class Placement:
    """Chooses the servers of new ranges among the live ones, least loaded first.

    One choice at a time, each with what records it (``record``), so concurrent choices see
    each other's load: two streams created at once do not both land on the emptiest server.
    """

    def __init__(self, liveness: Liveness, load: ServerLoad) -> None:
        self._liveness = liveness
        self._load = load
        self._lock = threading.Lock()

    def place(self, count: int, record: Callable[[list[int]], T]) -> T:
        """``record(servers)`` for ``count`` servers chosen now (the first is the primary):
        its result. Too few live servers raise ``NotEnoughServersError``, after those the PD
        has not heard from yet had their chance (``_await_live``)."""
        self._await_live(count)
        with self._lock:
            return record(self._choose(count))

    def place_if_possible(self, count: int, record: Callable[[list[int] | None], T], *,
                          wait: bool = True, succeeding: Sequence[int] = ()
                          ) -> tuple[T, ServerError | None]:
        """As ``place``, but too few live servers are no failure: ``record(None)`` runs then,
        and the refusal comes back beside its result. ``wait``: first wait as ``place`` does.
        ``succeeding``: the primaries of the ranges the new one follows that were sealed
        lately, newest first (``choose_servers``)."""
        if wait:
            self._await_live(count, succeeding)
        with self._lock:
            try:
                servers: list[int] | None = self._choose(count, succeeding)
                refusal = None
            except ServerError as exc:
                servers, refusal = None, exc
            return record(servers), refusal

    def _await_live(self, count: int, avoid: Sequence[int] = ()) -> None:
        """Before placing ``count`` replicas: a PD that just started or took office has not
        heard yet from every server that is alive (their heartbeats went elsewhere, or not yet
        anywhere); the registered servers it has not heard from get the rest of one liveness
        timeout to find it (``Liveness.wait_for_live``). The choice is made after that.

        ``avoid``: servers the range should go to only when too few others are live (the
        primaries sealed lately, ``choose_servers``); the unheard servers are waited for
        until enough others are live. A new leader asked to seal-and-new a range whose primary
        was cut off from its secondaries otherwise put the next range back on those three
        servers when it had heard them first, and the writers waited out a second give-up."""
        if not self._liveness.young():
            return  # every live server has been heard: nobody to wait for, no metadata read
        avoided = set(avoid)
        if sum(1 for s in self._liveness.live() if s.server_id not in avoided) >= count:
            return
        known = [s.server_id for s in self._load.list_servers() if s.registered]
        self._liveness.wait_for_live(count, known, rather_not=avoided)

    def _choose(self, count: int, succeeding: Sequence[int] = ()) -> list[int]:
        live = [s.server_id for s in self._liveness.live()]
        return choose_servers(live, self._load.open_range_counts(), count, succeeding)
