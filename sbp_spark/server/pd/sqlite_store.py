"""The placement driver's durable metadata: streams, ranges, replicas and range servers.

Everything lives in one SQLite database in WAL mode. Every change is one transaction, so a crash
(even kill -9) leaves either the old or the new state, never half of a seal or a stream without
its first range. One connection guarded by a lock serves all threads: the PD's metadata traffic
is small and a single writer is what SQLite wants anyway.

Rows come back as small frozen dataclasses; the PD turns them into wire messages. Bad requests
raise the matching ``ServerError`` subclass so the PD can put it in that item's status.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

from sbp_spark.protocol.errors import InvalidRequestError

from ..auth.acl import AclEntry
from .meta import (
    RangeHolder,
    RangeMeta,
    RetentionHold,
    ServerMeta,
    StreamMeta,
    check_asked_stream_id,
    check_new_stream,
    check_stream_name,
    check_trim,
    name_missing,
    name_taken,
    new_range,
    next_range,
    not_registered,
    range_missing,
    sealed_range,
    stream_missing,
    stream_taken,
    unknown_server,
)
from .meta import now_ms as _now_ms
from .sqlite_tx import immediate

SCHEMA_VERSION = 1


def _or_none(value: int | None) -> int:
    """A cap column: NULL (rows from before the column existed) is no cap, -1."""
    return -1 if value is None else int(value)

# The on-disk layout. Streams are never removed, only marked deleted, so their ids are never
# handed out twice (AUTOINCREMENT guarantees that even for the highest id).
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS streams (
    stream_id INTEGER PRIMARY KEY AUTOINCREMENT,
    replica_nums INTEGER NOT NULL,
    retention_period_ms INTEGER NOT NULL,
    start_offset INTEGER NOT NULL DEFAULT 0,
    deleted INTEGER NOT NULL DEFAULT 0,
    created_ms INTEGER NOT NULL,
    name TEXT
);
CREATE TABLE IF NOT EXISTS ranges (
    stream_id INTEGER NOT NULL REFERENCES streams (stream_id),
    range_index INTEGER NOT NULL,
    base_start_offset INTEGER NOT NULL,
    start_offset INTEGER NOT NULL,
    end_offset INTEGER NOT NULL DEFAULT -1,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY (stream_id, range_index)
);
CREATE TABLE IF NOT EXISTS replicas (
    stream_id INTEGER NOT NULL,
    range_index INTEGER NOT NULL,
    server_id INTEGER NOT NULL,
    is_primary INTEGER NOT NULL,
    position INTEGER NOT NULL,
    PRIMARY KEY (stream_id, range_index, server_id),
    FOREIGN KEY (stream_id, range_index) REFERENCES ranges (stream_id, range_index)
        ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS replicas_by_server ON replicas (server_id);
CREATE TABLE IF NOT EXISTS range_servers (
    server_id INTEGER PRIMARY KEY AUTOINCREMENT,
    host TEXT NOT NULL DEFAULT '',
    advertise_addr TEXT NOT NULL DEFAULT '',
    allocated_ms INTEGER NOT NULL,
    last_heartbeat_ms INTEGER NOT NULL DEFAULT -1,
    metrics TEXT NOT NULL DEFAULT '{}',
    metrics_ms INTEGER NOT NULL DEFAULT -1
);
CREATE TABLE IF NOT EXISTS acl (
    principal TEXT NOT NULL,
    operation TEXT NOT NULL,
    stream TEXT NOT NULL,
    PRIMARY KEY (principal, operation, stream)
);
"""

# Columns added after the first release of the layout, each with its type: a database made
# before gets them on open (NULL in the rows it has), so it needs no new schema version.
_ADDED_COLUMNS = {"streams": {"name": "TEXT", "retain_for_consumers": "INTEGER",
                              "retain_cap_bytes": "INTEGER", "retain_cap_ms": "INTEGER"}}

# A name belongs to one live stream at a time; a deleted stream gives its name up. The index
# makes SQLite refuse a second live stream of one name whatever the caller checked before.
_NAME_INDEX = ("CREATE UNIQUE INDEX IF NOT EXISTS streams_by_name ON streams (name) "
               "WHERE deleted=0 AND name IS NOT NULL")


class PdStore:
    """Thread-safe SQLite metadata store of the placement driver.

    ``fsync=True`` makes every commit durable against power loss (``synchronous=FULL``);
    with False a commit still survives a process crash, which is what WAL guarantees.
    """

    def __init__(self, path: str | Path, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a transaction takes the
        # write lock up front and never fails half-way on an upgrade.
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        try:
            self._open(fsync)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            # Not repaired, not replaced: the file may be the only copy of the metadata.
            raise RuntimeError(
                f"{self.path} is not a readable PD metadata database ({exc}); it was left as "
                "it is: restore it from a backup, or give the PD another data directory"
            ) from exc
        self._closed = False

    def _open(self, fsync: bool) -> None:
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        self._db.execute("PRAGMA foreign_keys=ON")
        # executescript commits on its own, so the schema is applied outside _tx.
        with self._lock:
            self._db.executescript(_SCHEMA)
            for table, columns in _ADDED_COLUMNS.items():
                have = {r["name"] for r in self._db.execute(f"PRAGMA table_info({table})")}
                for column, kind in columns.items():
                    if column not in have:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
            self._db.execute(_NAME_INDEX)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                                 (str(SCHEMA_VERSION),))
            elif int(row["value"]) != SCHEMA_VERSION:
                version = row["value"]
                self._db.close()
                raise ValueError(
                    f"{self.path}: metadata schema version {version} is not supported "
                    f"(this build reads version {SCHEMA_VERSION})")

    # -- plumbing ---------------------------------------------------------------------------

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate(self._db, self._lock)

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def __enter__(self) -> PdStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- streams ----------------------------------------------------------------------------

    @staticmethod
    def _stream(row: sqlite3.Row) -> StreamMeta:
        return StreamMeta(stream_id=row["stream_id"], replica_nums=row["replica_nums"],
                          retention_period_ms=row["retention_period_ms"],
                          start_offset=row["start_offset"], deleted=bool(row["deleted"]),
                          name=row["name"] or "",
                          retain_for_consumers=bool(row["retain_for_consumers"]),
                          retain_cap_bytes=_or_none(row["retain_cap_bytes"]),
                          retain_cap_ms=_or_none(row["retain_cap_ms"]))

    def _live_stream(self, db: sqlite3.Connection, stream_id: int) -> StreamMeta:
        row = db.execute("SELECT * FROM streams WHERE stream_id=?", (stream_id,)).fetchone()
        if row is None or row["deleted"]:
            raise stream_missing(stream_id, row is not None)
        return self._stream(row)

    def create_stream(self, replica_nums: int, retention_period_ms: int,
                      servers: Sequence[int], stream_id: int | None = None,
                      name: str = "") -> tuple[StreamMeta, RangeMeta]:
        """Create a stream and its open range 0 on ``servers`` (the first is the primary).

        The id is the next free one unless ``stream_id`` asks for a particular id (importing
        metadata from elsewhere); an id in use, or once used by a deleted stream, fails with
        StreamAlreadyExistsError. So does a ``name`` a live stream has.
        """
        check_new_stream(replica_nums, servers, stream_id, name)
        with self._tx() as db:
            if stream_id is not None:
                row = db.execute("SELECT deleted FROM streams WHERE stream_id=?",
                                 (stream_id,)).fetchone()
                if row is not None:
                    raise stream_taken(stream_id, bool(row["deleted"]))
            if name:
                self._check_name_free(db, name)
            cur = db.execute(
                "INSERT INTO streams (stream_id, replica_nums, retention_period_ms, created_ms, "
                "name) VALUES (?, ?, ?, ?, ?)",
                (stream_id, replica_nums, retention_period_ms, _now_ms(), name or None))
            stream_id = cur.lastrowid
            assert stream_id is not None
            rng = self._insert_range(db, new_range(stream_id, 0, 0, servers))
            return self._live_stream(db, stream_id), rng

    def check_stream_id_free(self, stream_id: int) -> None:
        """Refuse, as ``create_stream`` would, an id a create asks for that is out of bounds,
        in use or once used by a deleted stream (a create still checks again)."""
        check_asked_stream_id(stream_id)
        with self._lock:
            row = self._db.execute("SELECT deleted FROM streams WHERE stream_id=?",
                                   (stream_id,)).fetchone()
        if row is not None:
            raise stream_taken(stream_id, bool(row["deleted"]))

    @staticmethod
    def _check_name_free(db: sqlite3.Connection, name: str) -> None:
        row = db.execute("SELECT stream_id FROM streams WHERE name=? AND deleted=0",
                         (name,)).fetchone()
        if row is not None:
            raise name_taken(name, row["stream_id"])

    def check_name_free(self, name: str) -> None:
        """Refuse, as ``create_stream`` would, a name that is not valid or that a live stream
        has (a create still checks again)."""
        check_stream_name(name)
        with self._lock:
            self._check_name_free(self._db, name)

    def get_stream(self, stream_id: int) -> StreamMeta:
        """The stream, or StreamNotFoundError if it never existed or was deleted."""
        with self._lock:
            return self._live_stream(self._db, stream_id)

    def stream_named(self, name: str) -> StreamMeta:
        """The live stream named ``name``, or StreamNotFoundError."""
        with self._lock:
            row = self._db.execute("SELECT * FROM streams WHERE name=? AND deleted=0",
                                   (name,)).fetchone()
        if row is None:
            raise name_missing(name)
        return self._stream(row)

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]:
        """All streams in id order."""
        sql = "SELECT * FROM streams"
        if not include_deleted:
            sql += " WHERE deleted=0"
        with self._lock:
            return [self._stream(r) for r in self._db.execute(sql + " ORDER BY stream_id")]

    def update_stream(self, stream_id: int, replica_nums: int,
                      retention_period_ms: int, hold: RetentionHold | None = None
                      ) -> StreamMeta:
        """Change a stream's settings; replica_nums applies to ranges opened from now on.
        ``hold`` (None: as it was) is its retention that waits for consumers."""
        with self._tx() as db:
            self._live_stream(db, stream_id)
            db.execute("UPDATE streams SET replica_nums=?, retention_period_ms=? "
                       "WHERE stream_id=?", (replica_nums, retention_period_ms, stream_id))
            if hold is not None:
                db.execute("UPDATE streams SET retain_for_consumers=?, retain_cap_bytes=?, "
                           "retain_cap_ms=? WHERE stream_id=?",
                           (int(hold.retain_for_consumers), hold.retain_cap_bytes,
                            hold.retain_cap_ms, stream_id))
            return self._live_stream(db, stream_id)

    def delete_stream(self, stream_id: int) -> tuple[StreamMeta, list[RangeMeta]]:
        """Mark the stream deleted and drop its ranges; returns it and the ranges it had."""
        with self._tx() as db:
            stream = self._live_stream(db, stream_id)
            ranges = self._ranges(db, "r.stream_id=?", (stream_id,))
            db.execute("DELETE FROM ranges WHERE stream_id=?", (stream_id,))
            db.execute("UPDATE streams SET deleted=1 WHERE stream_id=?", (stream_id,))
            return replace(stream, deleted=True), ranges

    def trim_stream(self, stream_id: int, trim_offset: int,
                    end_offset: int | None = None) -> tuple[StreamMeta, RangeMeta]:
        """Move the stream's start to ``trim_offset``; drop ranges wholly below it.

        ``end_offset`` is the stream's current end (the open range's live next_offset, when the
        caller knows it); trimming beyond the end fails with OffsetOutOfRangeError. A trim
        point below the current start changes nothing (trimming never brings data back).
        The last range is never dropped, so the stream always has a range to continue from.
        Returns the stream and its first remaining range.
        """
        with self._tx() as db:
            stream = self._live_stream(db, stream_id)
            ranges = self._ranges(db, "r.stream_id=?", (stream_id,))
            check_trim(stream_id, trim_offset, ranges[-1], end_offset)
            if trim_offset > stream.start_offset:
                for rng in ranges[:-1]:
                    if rng.end_offset <= trim_offset:
                        db.execute("DELETE FROM ranges WHERE stream_id=? AND range_index=?",
                                   (stream_id, rng.range_index))
                # Shrink whatever range now starts below the trim point (at most one: ranges
                # are contiguous). The open range's next_offset is never below its start.
                db.execute(
                    "UPDATE ranges SET start_offset=?, next_offset=MAX(next_offset, ?) "
                    "WHERE stream_id=? AND start_offset<?",
                    (trim_offset, trim_offset, stream_id, trim_offset))
                db.execute("UPDATE streams SET start_offset=? WHERE stream_id=?",
                           (trim_offset, stream_id))
            first = self._ranges(db, "r.stream_id=?", (stream_id,))[0]
            return self._live_stream(db, stream_id), first

    # -- ranges -----------------------------------------------------------------------------

    @staticmethod
    def _insert_range(db: sqlite3.Connection, rng: RangeMeta) -> RangeMeta:
        db.execute("INSERT INTO ranges (stream_id, range_index, base_start_offset, "
                   "start_offset, end_offset, next_offset) VALUES (?, ?, ?, ?, -1, ?)",
                   (rng.stream_id, rng.range_index, rng.start_offset, rng.start_offset,
                    rng.start_offset))
        db.executemany(
            "INSERT INTO replicas (stream_id, range_index, server_id, is_primary, position) "
            "VALUES (?, ?, ?, ?, ?)",
            [(rng.stream_id, rng.range_index, r.server_id, int(r.is_primary), i)
             for i, r in enumerate(rng.holders)])
        return rng

    @staticmethod
    def _ranges(db: sqlite3.Connection, where: str, args: tuple) -> list[RangeMeta]:
        rows = db.execute(
            "SELECT r.stream_id, r.range_index, r.base_start_offset, r.start_offset, "
            "r.end_offset, r.next_offset, p.server_id, p.is_primary FROM ranges r "
            "LEFT JOIN replicas p ON p.stream_id=r.stream_id AND p.range_index=r.range_index "
            f"WHERE {where} ORDER BY r.stream_id, r.range_index, p.position", args).fetchall()
        out: list[RangeMeta] = []
        key: tuple[int, int] | None = None
        holders: list[RangeHolder] = []
        head: sqlite3.Row | None = None

        def flush() -> None:
            assert head is not None
            out.append(RangeMeta(head["stream_id"], head["range_index"], head["start_offset"],
                                 head["end_offset"], head["next_offset"], tuple(holders),
                                 head["base_start_offset"]))

        for row in rows:
            k = (row["stream_id"], row["range_index"])
            if k != key:
                if head is not None:
                    flush()
                key, head, holders = k, row, []
            if row["server_id"] is not None:
                holders.append(RangeHolder(row["server_id"], bool(row["is_primary"])))
        if head is not None:
            flush()
        return out

    def list_ranges(self, stream_id: int) -> list[RangeMeta]:
        """Every range of a live stream in index order (StreamNotFoundError otherwise)."""
        with self._lock:
            self._live_stream(self._db, stream_id)
            return self._ranges(self._db, "r.stream_id=?", (stream_id,))

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]:
        """Every range (open or sealed) of a live stream that has a replica on ``server_id``."""
        with self._lock:
            return self._ranges(
                self._db,
                "r.stream_id IN (SELECT stream_id FROM streams WHERE deleted=0) AND "
                "EXISTS (SELECT 1 FROM replicas q WHERE q.stream_id=r.stream_id AND "
                "q.range_index=r.range_index AND q.server_id=?)", (server_id,))

    def get_range(self, stream_id: int, range_index: int) -> RangeMeta:
        """One range; StreamNotFoundError / RangeNotFoundError if absent."""
        with self._lock:
            self._live_stream(self._db, stream_id)
            found = self._ranges(self._db, "r.stream_id=? AND r.range_index=?",
                                 (stream_id, range_index))
            if not found:
                raise range_missing(stream_id, range_index)
            return found[0]

    def last_range(self, stream_id: int) -> RangeMeta:
        """The stream's highest-index range (the open one, unless it was sealed)."""
        with self._lock:
            return self.list_ranges(stream_id)[-1]

    def open_range_counts(self) -> dict[int, int]:
        """server_id -> number of open ranges of live streams it holds (the placement load)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT p.server_id AS sid, COUNT(*) AS n FROM replicas p "
                "JOIN ranges r ON r.stream_id=p.stream_id AND r.range_index=p.range_index "
                "JOIN streams s ON s.stream_id=r.stream_id "
                "WHERE r.end_offset=-1 AND s.deleted=0 GROUP BY p.server_id").fetchall()
            return {row["sid"]: row["n"] for row in rows}

    def seal_range(self, stream_id: int, range_index: int, end_offset: int,
                   next_servers: Sequence[int] | None = None) -> tuple[RangeMeta, RangeMeta | None]:
        """Seal the open range at ``end_offset`` and, given servers, open the next one there.

        Both happen in one transaction. Sealing an already sealed range at the same offset is
        accepted (a retried seal); at another offset it fails with RangeSealedError.
        """
        with self._tx() as db:
            self._live_stream(db, stream_id)
            found = self._ranges(db, "r.stream_id=? AND r.range_index=?",
                                 (stream_id, range_index))
            if not found:
                raise range_missing(stream_id, range_index)
            sealed = sealed_range(found[0], end_offset)
            db.execute("UPDATE ranges SET end_offset=?, next_offset=? "
                       "WHERE stream_id=? AND range_index=?",
                       (end_offset, end_offset, stream_id, range_index))
            new = None
            if next_servers is not None:
                new = self._open_next(db, stream_id, next_servers)
            return sealed, new

    def open_next_range(self, stream_id: int, servers: Sequence[int]) -> RangeMeta:
        """Open the range after the stream's last one, which must be sealed."""
        with self._tx() as db:
            self._live_stream(db, stream_id)
            return self._open_next(db, stream_id, servers)

    def _open_next(self, db: sqlite3.Connection, stream_id: int,
                   servers: Sequence[int]) -> RangeMeta:
        last = self._ranges(db, "r.stream_id=? AND r.range_index=(SELECT MAX(range_index) "
                                "FROM ranges WHERE stream_id=?)", (stream_id, stream_id))[0]
        return self._insert_range(db, next_range(last, servers))

    def update_next_offset(self, stream_id: int, range_index: int, next_offset: int) -> None:
        """Refresh the PD's snapshot of an open range's next_offset (never moves it back)."""
        with self._tx() as db:
            db.execute("UPDATE ranges SET next_offset=MAX(next_offset, ?) "
                       "WHERE stream_id=? AND range_index=? AND end_offset=-1",
                       (next_offset, stream_id, range_index))

    # -- range servers ----------------------------------------------------------------------

    @staticmethod
    def _server(row: sqlite3.Row) -> ServerMeta:
        return ServerMeta(server_id=row["server_id"], host=row["host"],
                          advertise_addr=row["advertise_addr"],
                          last_heartbeat_ms=row["last_heartbeat_ms"],
                          metrics=json.loads(row["metrics"]), metrics_ms=row["metrics_ms"])

    def allocate_server_id(self, host: str = "") -> int:
        """A new server id, never handed out before (ids start at 1)."""
        with self._tx() as db:
            cur = db.execute("INSERT INTO range_servers (host, allocated_ms) VALUES (?, ?)",
                             (host, _now_ms()))
            assert cur.lastrowid is not None
            return cur.lastrowid

    def record_heartbeat(self, server_id: int, advertise_addr: str,
                         now_ms: int | None = None) -> ServerMeta:
        """Note a heartbeat and the server's current address.

        Only ids this PD allocated are accepted (they are kept here, so a restarted PD still
        knows them); any other id raises ``meta.unknown_server``'s error.
        """
        if server_id < 0:
            raise InvalidRequestError(f"server_id must be >= 0, got {server_id}")
        ts = _now_ms() if now_ms is None else now_ms
        with self._tx() as db:
            cur = db.execute("UPDATE range_servers SET advertise_addr=?, last_heartbeat_ms=? "
                             "WHERE server_id=?", (advertise_addr, ts, server_id))
            if cur.rowcount == 0:
                (issued,) = db.execute("SELECT COUNT(*) FROM range_servers").fetchone()
                raise unknown_server(server_id, advertise_addr, issued)
            row = db.execute("SELECT * FROM range_servers WHERE server_id=?",
                             (server_id,)).fetchone()
            return self._server(row)

    def record_metrics(self, server_id: int, metrics: dict[str, int],
                       now_ms: int | None = None) -> None:
        """Keep the latest metrics a range server reported."""
        ts = _now_ms() if now_ms is None else now_ms
        with self._tx() as db:
            cur = db.execute("UPDATE range_servers SET metrics=?, metrics_ms=? WHERE server_id=?",
                             (json.dumps(metrics, sort_keys=True), ts, server_id))
            if cur.rowcount == 0:
                raise not_registered(server_id)

    def get_server(self, server_id: int) -> ServerMeta | None:
        """The server's record, or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM range_servers WHERE server_id=?",
                                   (server_id,)).fetchone()
            return None if row is None else self._server(row)

    def list_servers(self) -> list[ServerMeta]:
        """Every server that has an id here, in id order."""
        with self._lock:
            return [self._server(r) for r in
                    self._db.execute("SELECT * FROM range_servers ORDER BY server_id")]

    # -- permissions (docs/wire.md, "Who may do what") --------------------------------------

    def acl(self) -> tuple[int, list[AclEntry]]:
        """The permissions granted and their version (0 before any change)."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key='acl_version'").fetchone()
            rows = self._db.execute(
                "SELECT principal, operation, stream FROM acl ORDER BY principal, operation, "
                "stream").fetchall()
        return (int(row["value"]) if row else 0,
                [AclEntry(r["principal"], r["operation"], r["stream"]) for r in rows])

    def change_acl(self, grant: bool, entries: Sequence[AclEntry]) -> int:
        """Grant (or revoke) ``entries`` in one transaction; the new version."""
        with self._tx() as db:
            for e in entries:
                if grant:
                    db.execute("INSERT OR IGNORE INTO acl (principal, operation, stream) "
                               "VALUES (?, ?, ?)", (e.principal, e.operation, e.stream))
                else:
                    db.execute("DELETE FROM acl WHERE principal=? AND operation=? AND stream=?",
                               (e.principal, e.operation, e.stream))
            row = db.execute("SELECT value FROM meta WHERE key='acl_version'").fetchone()
            version = (int(row["value"]) if row else 0) + 1
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('acl_version', ?)",
                       (str(version),))
        return version
