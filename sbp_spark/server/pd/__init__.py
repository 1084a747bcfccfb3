"""sbp_spark.server.pd: the placement driver (PD), owner of stream and range metadata and of
range placement.

A PD runs alone, its metadata in SQLite (``sqlite_store``; the default, nothing to set up), or as
one node of a PD cluster whose metadata lives in etcd (``PdConfig.etcd``; ``etcd_store``). In a
cluster the nodes elect a leader through etcd (``leader``); only the leader answers
metadata requests and runs the liveness sweep and failover, and followers answer
PD_NOT_LEADER naming it. A PD serves the admin opcodes over the shared frame server core
(``net.FrameServer``); which range servers are alive comes from their heartbeats to the leader
(``placement.Liveness``). The PD calls range servers itself, with the ordinary client, to seal
ranges (SEAL_RANGES) and to tell them about new or changed ranges (SYNC_RANGES).

Batch opcodes answer one result per item, in request order; a bad item fails with its own
status and never hides the others. Whole-request problems (a header that does not parse) are
SYSTEM_ERROR frames.

Decisions the specification leaves open, made here:

* CREATE_STREAMS: a stream_id other than -1 asks for that id (importing metadata); taken or
  once-used ids fail with STREAM_ALREADY_EXISTS. Range 0 opens at once on the least loaded
  live servers; too few live servers fail the item with NOT_ENOUGH_SERVERS.
* UPDATE_STREAMS replaces replica_nums and retention_period_ms (both are validated); a new
  replica count applies to ranges opened later.
* SEAL_RANGES (seal-and-new) on a range that is already sealed answers the open range that
  followed it, so writers racing on one seal all land on the same range; if the seal was
  recorded but no successor could be opened then, it is opened now.
* CREATE_RANGE repeated for a range that is already open returns it (a retried create).
* TRIM_STREAMS below the current start changes nothing; beyond the stream's end (the open
  range's live next_offset, asked from its primary) fails with OFFSET_OUT_OF_RANGE.
* DESCRIBE_STREAMS with no ids lists every live stream; DESCRIBE_PD_CLUSTER also lists the
  range servers this PD knows, with liveness, load and their last REPORT_METRICS.
* A range server that cannot be reached fails only the items that needed it, with the
  retriable REQUEST_TIMEOUT naming the server.
* A RANGE_SERVER HEARTBEAT must carry an id this PD issued (ALLOCATE_ID; the ids live in the
  metadata store, so they survive a PD restart). Any other id is refused with INVALID_REQUEST
  naming it (detail ``meta.UNKNOWN_SERVER_ID``) and the server never becomes live here.
* Failover: when a range server stops heartbeating, each open range with a replica on it is
  sealed on its live replicas, at the smallest end they report (every acknowledged record is on
  every replica, so none is lost; records past that end were never acknowledged), and the next
  range opens on live servers; writers find it when they ask the PD again. A range with no
  live replica left (always the case for R = 1) stays open and waits for its server: its
  acknowledged records exist only there. A new range needs replica_nums live servers; with
  fewer, the range is sealed and the next one opens once enough servers are live.

Range servers learn about their ranges in two ways: the PD pushes each new range to its servers
when it opens it, and whenever a server (re)appears (its first heartbeat after a PD start, a new
address after a restart, or a heartbeat after silence past the liveness timeout) or a push to it
failed, the PD pushes it every range it holds. So a server that missed a push catches up within
one heartbeat.

The owner, ``PlacementDriver`` (``driver.py``), builds the parts and hands each only what it
uses, as small interfaces (``typing.Protocol``s or callables); no part imports the owner:

* ``handler.py``: ``PdHandler``, the dispatch table; decodes requests, encodes answers.
* ``streams.py`` and ``ranges.py``: the operations clients ask for (create, update, delete and
  trim streams; seal-and-new, create a range, list a server's ranges).
* ``succession.py``: ``Succession``, the one way a stream moves on to its next range (seal,
  open the next, push both), for a client's seal and a failover alike; ``StreamLocks``.
* ``servers.py``: ``RangeServerRegistry``, ids, heartbeats, goodbyes and metrics.
* ``failover.py``: ``Failover``, the liveness sweep, and ``RangeFailover``, what it does to a
  dead server's open ranges.
* ``calls.py``: ``RangeServerCalls``, requests to range servers; ``pushes.py``:
  ``RangePushes``, which ranges each server is told about, and the resyncs owed.
* ``placement.py``: ``Liveness``, ``Placement``; ``wire.py``: records in their wire form.
* ``meta.py`` (records, rules, ``MetadataStore``), ``sqlite_store.py``, ``etcd_store.py``,
  ``leader.py`` (``Leadership``, ``LoneOffice``); ``config.py``: ``PdConfig``.

``PlacementDriver`` and ``PdConfig`` load on first use, so the small modules of this package
(``etcd_store`` for the CLI's defaults, ``meta`` for the range server's PD link) import without
the whole PD.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import DEFAULT_HEARTBEAT_INTERVAL_S, PdConfig
    from .driver import PlacementDriver

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL_S", "PdConfig", "PlacementDriver"]
# Where each name above is defined.
_HOMES = {"DEFAULT_HEARTBEAT_INTERVAL_S": "config", "PdConfig": "config",
          "PlacementDriver": "driver"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
