"""The PD's failover duty: notice range servers that went silent and fail their ranges over.

``Failover`` runs the liveness sweep on its own thread, while this PD leads: servers whose
heartbeats stopped (and registered servers that never heartbeated to this PD, once it has
heard the others for one liveness timeout since it took office) are owed a failover; every
sweep fails over the open ranges of the servers owed one that are still not live. A lone PD
takes office when it starts; a node of a PD cluster when it is elected, so range servers whose
heartbeats went to the old leader get one liveness timeout, counted from when the first of
them reached this node, to find it before they count as gone. The metadata and the
calls to range servers are the ``PlacementDriver``'s (``pd.store``, ``pd.calls``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import ErrorCode, SbpError, ServerError

if TYPE_CHECKING:
    from .driver import PlacementDriver

log = logging.getLogger("sbp_spark.server.pd")

# Ranges a failover's log line names, at most (it counts the rest).
STRANDED_SHOWN = 10


class Failover:
    """The liveness sweep and the failover of a dead server's open ranges."""

    def __init__(self, pd: PlacementDriver) -> None:
        self.pd = pd
        self._owed: set[int] = set()  # gone servers whose open ranges await a failover
        self._stopped: set[int] = set()  # those of them that said they stop (a planned stop)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_office = False  # this PD leads (it took office and has not left)
        self._checked_absent = False

    def took_office(self) -> None:
        """This PD leads from now on: start the grace period, forget older debts."""
        with self._lock:
            self._owed.clear()
            self._stopped.clear()
            self._in_office, self._checked_absent = True, False

    def left_office(self) -> None:
        """This PD no longer leads: sweep nothing until it leads again."""
        with self._lock:
            self._owed.clear()
            self._stopped.clear()
            self._in_office = False

    def start(self) -> None:
        """Start the sweep thread (a lone PD leads from now on)."""
        if not self.pd.config.etcd:
            self.took_office()
        self._thread = threading.Thread(target=self._sweep, daemon=True,
                                        name=f"{self.pd.config.name}-liveness")
        self._thread.start()

    def stop(self) -> None:
        """Stop the sweep (a failover under way ends at its next server)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _sweep(self) -> None:
        """Every third of a liveness timeout: notice servers that went silent, fail them over."""
        interval = max(0.05, self.pd.config.heartbeat_timeout_s / 3)
        while not self._stop.wait(interval):
            if self._in_office and self.pd.is_leader():
                self.sweep_once()

    def sweep_once(self) -> None:
        """One sweep: servers whose heartbeats stopped are owed a failover, and so are, once
        this PD has heard other servers for one liveness timeout since it took office,
        registered servers that never heartbeated to it; then every failover owed is tried."""
        timeout = self.pd.config.heartbeat_timeout_s
        for gone in self.pd.liveness.expire():
            log.warning("range server %d (%s) missed heartbeats for %.1f s: not live",
                        gone.server_id, gone.advertise_addr, timeout)
            self.owe(gone.server_id)
        # Servers that heartbeated to the old leader find the new one at their own pace (a
        # call to the old leader, cut off, may hang for its whole timeout first), so an absent
        # server counts as gone only once the PD has heard others for a full timeout.
        if not self._checked_absent and self._in_office and \
                self.pd.liveness.in_contact_for() > timeout:
            self._checked_absent = True
            for server in self.pd.store.list_servers():
                if server.registered and not self.pd.liveness.is_live(server.server_id):
                    log.warning("range server %d (%s) has not heartbeated since this PD took "
                                "office: not live", server.server_id, server.advertise_addr)
                    self.owe(server.server_id)
        self.run_failovers()

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
            if not self.pd.liveness.is_live(server_id):
                try:
                    done = self.fail_over_server(server_id)
                except SbpError as exc:
                    log.warning("failover of range server %d not finished (retried): %s",
                                server_id, exc)
                    done = False
            if done:
                with self._lock:
                    self._owed.discard(server_id)
                    self._stopped.discard(server_id)

    def fail_over_server(self, server_id: int) -> bool:
        """Seal every open range that has a replica on the dead ``server_id`` and open its
        successor on live servers. True when nothing is left to do for this server.

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
        finished = True
        stranded: list[tuple[int, int]] = []  # (stream, range) with no live replica left
        try:
            for rng in self.pd.store.ranges_on_server(server_id):
                if not rng.is_open:
                    continue
                try:
                    finished &= self._fail_over_range(rng.stream_id, rng.range_index,
                                                      server_id, stranded)
                except ServerError as exc:
                    if exc.code == ErrorCode.STREAM_NOT_FOUND:
                        continue  # deleted meanwhile
                    raise
        finally:
            if stranded:
                self._log_stranded(server_id, stranded)
        return finished

    def _level(self, server_id: int) -> int:
        """How loud a failover of ``server_id`` is: information when it said it stops (an
        operator's stop or rolling restart, or the whole cluster's), a warning otherwise."""
        with self._lock:
            return logging.INFO if server_id in self._stopped else logging.WARNING

    def _log_stranded(self, server_id: int, stranded: list[tuple[int, int]]) -> None:
        """One line for the open ranges ``server_id`` leaves with no live replica: a warning
        when it went silent, information when it said it stops (every R = 1 range of a server
        stopped on purpose, as in a rolling restart or a whole cluster's stop, is one)."""
        level = self._level(server_id)
        stopped = level == logging.INFO
        shown = ", ".join(f"{sid}/{index}" for sid, index in stranded[:STRANDED_SHOWN])
        more = len(stranded) - STRANDED_SHOWN
        log.log(level,
                "range server %d %s: %d open range(s) on it have no other live replica and "
                "stay open until it returns, their writers waiting (stream/range: %s%s)",
                server_id, "stopped" if stopped else "is not live", len(stranded), shown,
                f" and {more} more" if more > 0 else "")

    def _fail_over_range(self, stream_id: int, range_index: int, dead: int,
                         stranded: list[tuple[int, int]]) -> bool:
        """One range of ``fail_over_server``: True when handled (or left for the server to
        return, then added to ``stranded``), False when it should be tried again."""
        with self.pd.stream_lock(stream_id):
            rng = self.pd.store.get_range(stream_id, range_index)
            if not rng.is_open or dead not in rng.server_ids or self.pd.liveness.is_live(dead):
                return True
            survivors = [sid for sid in rng.server_ids
                         if sid != dead and self.pd.liveness.is_live(sid)]
            if not survivors:
                stranded.append((stream_id, range_index))
                return True
            request = m.SealRangesRequest(
                timeout_ms=int(self.pd.config.range_server_timeout_s * 1000),
                ranges=[m.RangeId(stream_id, range_index)])
            ends = {sid: self.pd.calls.seal_one(sid, request, rng, None) for sid in survivors}
            end = min(ends.values())
            stream = self.pd.store.get_stream(stream_id)
            with self.pd.placement_lock:
                try:
                    servers = self.pd._choose(stream.replica_nums)
                except ServerError as exc:
                    # Not enough live servers for a new range: seal anyway (no write could be
                    # acknowledged on this one); writers open the next range when they can.
                    log.warning("range %d of stream %d: no successor yet (%s)", range_index,
                                stream_id, exc.message)
                    servers = None
                sealed, new = self.pd.store.seal_range(stream_id, range_index, end, servers)
            level = self._level(dead)
            log.log(level, "failover: range %d of stream %d (server %d %s) sealed at %d from "
                    "replicas %s%s", range_index, stream_id, dead,
                    "stopped" if level == logging.INFO else "gone", end, ends,
                    "" if new is None else f"; range {new.range_index} open on "
                    f"{new.server_ids}")
            # Under the stream's lock, as a seal's push: a seal of the new range must not
            # reach its servers before the range does.
            self.pd.calls.push_ranges([sealed] if new is None else [sealed, new], skip={dead})
        return True
