"""The range servers a PD knows: their ids, heartbeats, goodbyes and metrics.

Only ids this PD issued (ALLOCATE_ID) are accepted: they live in the metadata store, so they
survive a PD restart. A heartbeat makes its server live (``placement.Liveness``) at the address
it carries. Whenever a server (re)appears (its first heartbeat after a PD start, a new address
after a restart, or a heartbeat after silence past the liveness timeout) it may have missed
pushes, so it is owed a resync of every range it holds, which its heartbeat then starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import fields
from typing import Protocol

from sbp_spark.client.connection import parse_address
from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import InvalidRequestError

from .meta import UNKNOWN_SERVER_ID, ServerMeta
from .placement import Liveness

log = logging.getLogger(__package__)

# Names of the ReportMetricsRequest fields kept as a server's metrics.
METRIC_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(m.ReportMetricsRequest) if f.name != "range_server")


class ServerRecords(Protocol):
    """What the registry reads and writes of the metadata."""

    def allocate_server_id(self, host: str = "") -> int: ...

    def get_server(self, server_id: int) -> ServerMeta | None: ...

    def record_heartbeat(self, server_id: int, advertise_addr: str,
                         now_ms: int | None = None) -> ServerMeta: ...

    def record_metrics(self, server_id: int, metrics: dict[str, int],
                       now_ms: int | None = None) -> None: ...

    def list_servers(self) -> list[ServerMeta]: ...

    def open_range_counts(self) -> dict[int, int]: ...


class Resyncs(Protocol):
    """The resyncs a (re)appearing server is owed (``pushes.RangePushes``)."""

    def owe_resync(self, server_id: int) -> None: ...

    def resync_owed(self, server_id: int) -> bool: ...

    def resync(self, server_id: int) -> None: ...


class RangeServerRegistry:
    """Range servers' ids, heartbeats, goodbyes and metrics.

    ``run_soon(fn, server_id)`` runs a resync off the heartbeat's thread; ``stopped(server_id)``
    is told of a server that said it stops (its open ranges are failed over); ``address_of``
    names a server's current address.
    """

    def __init__(self, records: ServerRecords, liveness: Liveness, resyncs: Resyncs,
                 run_soon: Callable[[Callable[[int], None], int], object],
                 stopped: Callable[[int], None],
                 address_of: Callable[[ServerMeta], str]) -> None:
        self._records = records
        self._liveness = liveness
        self._resyncs = resyncs
        self._run_soon = run_soon
        self._stopped = stopped
        self._address_of = address_of
        self._refused: set[tuple[int, str]] = set()  # unknown ids already logged

    def allocate_id(self, host: str = "") -> int:
        """A server id never handed out before."""
        sid = self._records.allocate_server_id(host)
        log.info("allocated server id %d to %s", sid, host or "an unnamed host")
        return sid

    def heartbeat(self, server_id: int, advertise_addr: str) -> None:
        """Record a range server's heartbeat and its current address."""
        if server_id < 0:
            raise InvalidRequestError(f"range server heartbeat without a server_id ({server_id})")
        try:
            parse_address(advertise_addr)
        except ValueError as exc:
            raise InvalidRequestError(f"range server {server_id}: {exc}") from None
        before = self._records.get_server(server_id)
        try:
            self._records.record_heartbeat(server_id, advertise_addr)
        except InvalidRequestError as exc:
            key = (server_id, advertise_addr)
            if exc.detail == UNKNOWN_SERVER_ID and key not in self._refused:
                self._refused.add(key)  # once per server: it keeps heartbeating
                log.warning("refusing heartbeats of range server id %d at %s: %s", server_id,
                            advertise_addr, exc.message)
            raise
        arrived = self._liveness.beat(server_id, advertise_addr)
        previous = before.advertise_addr if before is not None else ""
        moved = previous not in ("", advertise_addr)
        if moved:
            log.info("range server %d is live at %s (was %s)", server_id, advertise_addr,
                     previous)
        elif arrived:
            log.info("range server %d is live at %s", server_id, advertise_addr)
        # New, back from silence, or restarted elsewhere: it may have missed pushes.
        if arrived or moved:
            self._resyncs.owe_resync(server_id)
        if self._resyncs.resync_owed(server_id):
            self._run_soon(self._resyncs.resync, server_id)

    def stopping(self, server_id: int) -> None:
        """A range server said it stops (GOAWAY on the connection of its heartbeats): not
        live from now on, so no new range is placed on it, and its open ranges are failed
        over on the next sweep instead of after the heartbeat timeout. Its next heartbeat
        (it restarted) makes it live again."""
        if not self._liveness.is_live(server_id):
            return
        self._liveness.forget(server_id)
        self._stopped(server_id)
        log.info("range server %d is stopping: not live", server_id)

    def report_metrics(self, report: m.ReportMetricsRequest) -> None:
        """Keep a server's REPORT_METRICS (refused for an id this PD never issued)."""
        metrics = {name: int(getattr(report, name)) for name in METRIC_FIELDS}
        self._records.record_metrics(report.range_server.server_id, metrics)

    def states(self) -> list[m.RangeServerState]:
        """Every range server that ever heartbeated, with liveness, how long ago this view
        heard it, load and its last metrics, as DESCRIBE_PD_CLUSTER reports them."""
        load = self._records.open_range_counts()
        out = []
        for s in self._records.list_servers():
            if not s.registered:
                continue
            server = m.RangeServer(s.server_id, self._address_of(s))
            metrics = None
            if s.metrics_ms >= 0:
                known = {k: v for k, v in s.metrics.items() if k in METRIC_FIELDS}
                metrics = m.ReportMetricsRequest(range_server=server, **known)
            silent = self._liveness.silent_for(s.server_id)
            out.append(m.RangeServerState(
                server=server, live=self._liveness.is_live(s.server_id),
                last_heartbeat_ms=s.last_heartbeat_ms, open_ranges=load.get(s.server_id, 0),
                metrics=metrics, metrics_ms=s.metrics_ms,
                silent_ms=-1 if silent is None else int(silent * 1000)))
        return out
