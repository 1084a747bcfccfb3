"""The PD's failover duty: notice range servers that went silent and fail their ranges over.

``Failover`` runs the liveness sweep on its own thread, while this PD leads: servers whose
heartbeats stopped (and registered servers that never heartbeated to this PD, once it has
heard the others for one liveness timeout since it took office) are owed a failover; every
sweep fails over the open ranges of the servers owed one that are still not live
(``RangeFailover``). A lone PD takes office when it starts; a node of a PD cluster when it is
elected, so range servers whose heartbeats went to the old leader get one liveness timeout,
counted from when the first of them reached this node, to find it before they count as gone.

Less for a server the old leader had already heard nothing from for a while, as the
heartbeats it recorded show: its silence then counts toward the timeout, down to
``ABSENT_GRACE_S`` of hearing others. A primary killed shortly before the PD leader was failed
over one whole liveness timeout after the election, its writers waiting through both (11 s in
the 1-hour nemesis).

And less for a server that is dead and says so: one quiet for half the liveness timeout (a
missed heartbeat), or registered and not heard since this PD took office, has its port probed
(``listening.refuses_connections``); a refused connection means no process listens there, and
it is failed over at once. A stopped process's kernel still takes connections and a partition
drops them, so both still get the timeout. With a primary and the PD leader killed 0.6 s apart
the nemesis saw writers wait 9.1 s: the election, then the new leader's grace for a server
that was already dead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from sbp_spark.protocol.errors import ErrorCode, SbpError, ServerError

from .listening import refuses_connections
from .meta import RangeMeta, SealedEnd, ServerMeta
from .placement import Liveness
from .succession import StreamLocks, Succeeded, Succession

log = logging.getLogger(__package__)

# Ranges a failover's log line names, at most (it counts the rest).
STRANDED_SHOWN = 10
# The least a new leader hears others before it counts a registered server it has not heard
# as gone, however long the old leader had heard nothing from it: a live range server sends
# a failed heartbeat again within a quarter second, and a call to a PD node that is stopped
# is given up after a one-second PING.
ABSENT_GRACE_S = 1.0
# How often the sweep looks for such servers until it has decided on every one.
ABSENT_SWEEP_S = 0.25
# The part of the liveness timeout a server may be quiet (about one missed heartbeat) before
# the sweep asks its port whether a process still listens there.
QUIET_PART = 0.5
# How often one quiet server's port is asked, at most.
PROBE_EVERY_S = 0.5


class Failover:
    """The liveness sweep: which servers are owed a failover, and when it is tried.

    ``registered()`` lists the servers this PD issued ids to, ``fail_over(server_id,
    stopped)`` fails over one server's open ranges (True when nothing is left to do;
    ``stopped``: it said it stops, rather than going silent), and ``leads()`` says whether
    this node leads now.
    """

    def __init__(self, liveness: Liveness, registered: Callable[[], Iterable[ServerMeta]],
                 fail_over: Callable[[int, bool], bool], leads: Callable[[], bool],
                 timeout_s: float, name: str,
                 refuses: Callable[[str], bool] = refuses_connections) -> None:
        self._liveness = liveness
        self._registered = registered
        self._fail_over = fail_over
        self._leads = leads
        self._timeout_s = timeout_s
        self._name = name
        self._owed: set[int] = set()  # gone servers whose open ranges await a failover
        self._stopped: set[int] = set()  # those of them that said they stop (a planned stop)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_office = False  # this PD leads (it took office and has not left)
        self._checked_absent = False
        # Registered servers the old leader had heard nothing from, by how long before it
        # last heard anyone (seconds, by the heartbeats it recorded), as this PD took office;
        # and those of them owed a failover since.
        self._silent_before: dict[int, float] = {}
        self._absent_owed: set[int] = set()
        # Whether a process listens at an address (``listening.refuses_connections``), the
        # servers' addresses on record as this PD took office, and when each quiet server's
        # port was last asked.
        self._refuses = refuses
        self._recorded: dict[int, str] = {}
        self._probed: dict[int, float] = {}
        self._probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"{name}-probe")

    def took_office(self) -> None:
        """This PD leads from now on: start the grace period, forget older debts."""
        try:
            registered = [s for s in self._registered() if s.registered]
            silent_before = _silent_before(registered)
        except Exception as exc:  # the metadata store failed: every server gets the timeout
            log.warning("PD %s: the servers' last heartbeats could not be read (%s): every "
                        "server it does not hear gets a full liveness timeout", self._name, exc)
            registered, silent_before = [], {}
        with self._lock:
            self._owed.clear()
            self._stopped.clear()
            self._in_office, self._checked_absent = True, False
            self._silent_before, self._absent_owed = silent_before, set()
            self._recorded = {s.server_id: s.advertise_addr for s in registered
                              if s.advertise_addr}
            self._probed = {}

    def left_office(self) -> None:
        """This PD no longer leads: sweep nothing until it leads again."""
        with self._lock:
            self._owed.clear()
            self._stopped.clear()
            self._in_office = False

    def start(self) -> None:
        """Start the sweep thread."""
        self._thread = threading.Thread(target=self._sweep, daemon=True,
                                        name=f"{self._name}-liveness")
        self._thread.start()

    def stop(self) -> None:
        """Stop the sweep (a failover under way ends at its next server)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self._probes.shutdown(wait=False)

    def _sweep(self) -> None:
        """Every third of a liveness timeout: notice servers that went silent, fail them over."""
        interval = max(0.05, self._timeout_s / 3)
        while not self._stop.wait(interval if self._checked_absent
                                  else min(interval, ABSENT_SWEEP_S)):
            if self._in_office and self._leads():
                self.sweep_once()

    def sweep_once(self) -> None:
        """One sweep: servers whose heartbeats stopped are owed a failover, and so are, once
        this PD has heard other servers for one liveness timeout since it took office,
        registered servers that never heartbeated to it; then every failover owed is tried."""
        timeout = self._timeout_s
        for gone in self._liveness.expire():
            log.warning("range server %d (%s) missed heartbeats for %.1f s: not live",
                        gone.server_id, gone.advertise_addr, timeout)
            self.owe(gone.server_id)
        if self._in_office:
            self._probe_quiet()
        # Servers that heartbeated to the old leader find the new one at their own pace (a
        # call to the old leader, cut off, may hang for its whole timeout first), so an absent
        # server counts as gone only once the PD has heard others for a full timeout, less
        # the time the old leader had already heard nothing from it (``ABSENT_GRACE_S`` at
        # the least).
        if not self._checked_absent and self._in_office:
            self._check_absent(self._liveness.in_contact_for())
        self.run_failovers()

    def _probe_quiet(self) -> None:
        """Owe a failover at once to each server that is quiet (for ``QUIET_PART`` of the
        liveness timeout, or not heard since this PD took office while it has heard others for
        ``ABSENT_GRACE_S``) and whose port refuses connections: no process listens there, so
        it is dead, and waiting out the timeout (or a new leader's grace) would only keep its
        writers waiting. The server is no longer live from then on (as after its goodbye); its
        next heartbeat, after a restart, makes it live again. Each quiet server is asked at
        most every ``PROBE_EVERY_S``, all of them at once (a partition makes each probe wait
        out its timeout)."""
        now = time.monotonic()
        quiet = {s.server_id: s.advertise_addr
                 for s in self._liveness.quiet(self._timeout_s * QUIET_PART)}
        with self._lock:
            owed = set(self._owed)
            unheard = {sid: addr for sid, addr in self._recorded.items()
                       if sid not in self._absent_owed}
        # A registered server this PD has not heard is asked only once it has heard others
        # for ``ABSENT_GRACE_S``: its failover seals its ranges on the replicas this PD hears,
        # and a new leader that has heard none yet would find them "no other live replica"
        # and leave them open until the dead server returns.
        if self._liveness.in_contact_for() <= ABSENT_GRACE_S:
            unheard = {}
        for sid, addr in unheard.items():
            if self._liveness.silent_for(sid) is None:  # not heard since this PD took office
                quiet.setdefault(sid, addr)
        due = {sid: addr for sid, addr in quiet.items() if addr and sid not in owed
               and now - self._probed.get(sid, float("-inf")) >= PROBE_EVERY_S}
        if not due:
            return
        for sid in due:
            self._probed[sid] = now
        refused = dict(zip(due, self._probes.map(self._refuses, due.values()), strict=True))
        for sid, addr in due.items():
            silent = self._liveness.silent_for(sid)
            if not refused[sid] or (silent is not None and
                                    silent <= self._timeout_s * QUIET_PART):
                continue  # a process listens, or the server spoke meanwhile
            self._liveness.forget(sid)
            with self._lock:
                self._absent_owed.add(sid)
            log.warning("range server %d (%s) refuses connections after %s: no process "
                        "listens there, not live", sid, addr,
                        "no heartbeat since this PD took office" if silent is None else
                        f"{silent:.1f} s without a heartbeat")
            self.owe(sid)

    def _check_absent(self, heard_for: float) -> None:
        """Owe a failover to each registered server this PD has not heard, once it has heard
        others long enough for that server (see ``sweep_once``)."""
        if heard_for <= ABSENT_GRACE_S:  # no server can be owed before (the rule below)
            return
        timeout = self._timeout_s
        for server in self._registered():
            sid = server.server_id
            if not server.registered or sid in self._absent_owed or \
                    self._liveness.is_live(sid):
                continue
            before = self._silent_before.get(sid, 0.0)
            if heard_for > max(ABSENT_GRACE_S, timeout - before):
                self._absent_owed.add(sid)
                log.warning("range server %d (%s) has not heartbeated since this PD took "
                            "office (%.1f s of hearing others; the old leader had heard "
                            "nothing from it for %.1f s): not live", sid,
                            server.advertise_addr, heard_for, before)
                self.owe(sid)
        if heard_for > timeout:
            self._checked_absent = True

    def owe(self, server_id: int, stopped: bool = False) -> None:
        """``server_id`` is gone: fail its open ranges over. ``stopped``: it said it stops (an
        operator's stop or restart), not a crash or a silence."""
        with self._lock:
            self._owed.add(server_id)
            if stopped:
                self._stopped.add(server_id)
            else:
                self._stopped.discard(server_id)

    def run_failovers(self) -> None:
        """Fail over the open ranges of every server owed a failover that is still not live.

        Runs on the liveness thread; a failover that could not finish (a surviving replica did
        not answer) is tried again on the next sweep.
        """
        with self._lock:
            owed = sorted(self._owed)
        for server_id in owed:
            if self._stop.is_set():
                return
            done = True
            if not self._liveness.is_live(server_id):
                with self._lock:
                    stopped = server_id in self._stopped
                try:
                    done = self._fail_over(server_id, stopped)
                except SbpError as exc:
                    log.warning("failover of range server %d not finished (retried): %s",
                                server_id, exc)
                    done = False
            if done:
                with self._lock:
                    self._owed.discard(server_id)
                    self._stopped.discard(server_id)


def _silent_before(servers: Iterable[ServerMeta]) -> dict[int, float]:
    """For each registered server, how long before the newest heartbeat recorded (of any
    server) its own last one was recorded, in seconds: the silence the PD that recorded them
    had seen. Heartbeats are stamped by the PD node that took them, so the stamps of one
    leader's tenure compare without clock skew."""
    stamps = {s.server_id: s.last_heartbeat_ms for s in servers if s.registered}
    if not stamps:
        return {}
    newest = max(stamps.values())
    return {sid: (newest - ms) / 1000 for sid, ms in stamps.items()}


class FailoverRecords(Protocol):
    """What a failover reads of the metadata."""

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]: ...

    def get_range(self, stream_id: int, range_index: int) -> RangeMeta: ...


class SurvivorCalls(Protocol):
    """How a failover seals a range on one surviving replica (``calls.RangeServerCalls``): where
    that replica ended it."""

    def seal(self, server_id: int, rng: RangeMeta, timeout_s: float | None = None
             ) -> SealedEnd: ...


class RangeFailover:
    """The failover of a dead server's open ranges: each is sealed on its live replicas and
    its successor opened (``Succession``). ``is_live`` says which servers are live now."""

    def __init__(self, records: FailoverRecords, is_live: Callable[[int], bool],
                 calls: SurvivorCalls, succession: Succession, locks: StreamLocks) -> None:
        self._records = records
        self._is_live = is_live
        self._calls = calls
        self._succession = succession
        self._locks = locks

    def fail_over_server(self, server_id: int, stopped: bool = False) -> bool:
        """Seal every open range that has a replica on the dead ``server_id`` and open its
        successor on live servers. True when nothing is left to do for this server.
        ``stopped``: it said it stops (an operator's stop or rolling restart, or the whole
        cluster's), so this is information rather than a warning in the log.

        Where a range survives on other live replicas, those are sealed first (so a primary
        that is only cut off from the PD can no longer get appends acknowledged: its forwards
        are refused), and the range ends at the smallest end they report. Every acknowledged
        record is on every replica (the primary acknowledges only what all secondaries
        stored), so that end keeps all of them; records past it were never acknowledged.

        A range whose every replica is down is left open: for R = 1 the acknowledged records
        exist only on the dead server, and sealing it anywhere else would either lose them or
        let new records take their offsets. Its writers wait (retriable errors) until the
        server returns and carries on where it stopped.
        """
        level = logging.INFO if stopped else logging.WARNING
        finished = True
        stranded: list[tuple[int, int]] = []  # (stream, range) with no live replica left
        try:
            for rng in self._records.ranges_on_server(server_id):
                if not rng.is_open:
                    continue
                try:
                    finished &= self._fail_over_range(rng.stream_id, rng.range_index,
                                                      server_id, level, stranded)
                except ServerError as exc:
                    if exc.code == ErrorCode.STREAM_NOT_FOUND:
                        continue  # deleted meanwhile
                    raise
        finally:
            if stranded:
                self._log_stranded(server_id, level, stranded)
        return finished

    @staticmethod
    def _log_stranded(server_id: int, level: int, stranded: list[tuple[int, int]]) -> None:
        """One line for the open ranges ``server_id`` leaves with no live replica: a warning
        when it went silent, information when it said it stops (every R = 1 range of a server
        stopped on purpose, as in a rolling restart or a whole cluster's stop, is one)."""
        shown = ", ".join(f"{sid}/{index}" for sid, index in stranded[:STRANDED_SHOWN])
        more = len(stranded) - STRANDED_SHOWN
        log.log(level,
                "range server %d %s: %d open range(s) on it have no other live replica and "
                "stay open until it returns, their writers waiting (stream/range: %s%s)",
                server_id, "stopped" if level == logging.INFO else "is not live",
                len(stranded), shown, f" and {more} more" if more > 0 else "")

    def _fail_over_range(self, stream_id: int, range_index: int, dead: int, level: int,
                         stranded: list[tuple[int, int]]) -> bool:
        """One range of ``fail_over_server``: True when handled (or left for the server to
        return, then added to ``stranded``), False when it should be tried again."""
        with self._locks.hold(stream_id):
            rng = self._records.get_range(stream_id, range_index)
            if not rng.is_open or dead not in rng.server_ids or self._is_live(dead):
                return True
            survivors = [sid for sid in rng.server_ids if sid != dead and self._is_live(sid)]
            if not survivors:
                stranded.append((stream_id, range_index))
                return True
            ends = {sid: self._calls.seal(sid, rng).end for sid in survivors}
            end = min(ends.values())

            def announce(done: Succeeded) -> None:
                if done.unplaced is not None:
                    # Not enough live servers for a new range: sealed anyway (no write could
                    # be acknowledged on this one); writers open the next range when they can.
                    log.warning("range %d of stream %d: no successor yet (%s)", range_index,
                                stream_id, done.unplaced.message)
                log.log(level, "failover: range %d of stream %d (server %d %s) sealed at %d "
                        "from replicas %s%s", range_index, stream_id, dead,
                        "stopped" if level == logging.INFO else "gone", end, ends,
                        "" if done.opened is None else f"; range {done.opened.range_index} "
                        f"open on {done.opened.server_ids}")

            # Among the servers live now, with no wait for others: this runs on the sweep
            # thread, which a wait would hold up for every other failover owed. Writers that
            # find no successor open it through SEAL_RANGES, which waits.
            # The replicas that did not seal (the dead one, any other not live) are not
            # pushed to: each would hold the stream's lock for a timeout. They are resynced.
            self._succession.seal_and_open_next(rng, end, skip=set(rng.server_ids) - ends.keys(),
                                                wait_for_servers=False, announce=announce)
        return True
