"""Named consumers in the lone PD's SQLite database (the rules: ``consumers.py``).

The consumers' two tables live in the PD's database file beside the streams, written through a
connection of their own: WAL mode lets it commit beside the metadata store's, and each change
is one transaction, so a crash leaves a commit either recorded whole or not at all.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path

from .consumers import (
    ConsumerMeta,
    ConsumerOffset,
    advanced,
    check_consumer_name,
    check_generation,
    check_positions,
    consumer_missing,
)
from .meta import now_ms
from .sqlite_tx import immediate

_SCHEMA = """
CREATE TABLE IF NOT EXISTS consumers (
    name TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS consumer_positions (
    name TEXT NOT NULL REFERENCES consumers (name) ON DELETE CASCADE,
    stream_id INTEGER NOT NULL,
    committed_offset INTEGER NOT NULL,
    commit_time_ms INTEGER NOT NULL,
    PRIMARY KEY (name, stream_id)
);
"""


class SqliteConsumers:
    """The consumers kept in the SQLite database at ``path`` (the PD's ``pd.sqlite``)."""

    def __init__(self, path: str | Path, *, fsync: bool = True) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
            self._db.execute("PRAGMA foreign_keys=ON")
            # The other connection may hold the write lock for a moment.
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(_SCHEMA)
        except BaseException:
            self._db.close()
            raise
        self._closed = False

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return immediate(self._db, self._lock)

    @staticmethod
    def _read(db: sqlite3.Connection, name: str) -> ConsumerMeta | None:
        row = db.execute("SELECT * FROM consumers WHERE name=?", (name,)).fetchone()
        if row is None:
            return None
        positions = {
            p["stream_id"]: ConsumerOffset(p["committed_offset"], p["commit_time_ms"])
            for p in db.execute("SELECT * FROM consumer_positions WHERE name=? "
                                "ORDER BY stream_id", (name,))}
        return ConsumerMeta(name, row["generation"], row["created_ms"], positions)

    def join(self, name: str) -> ConsumerMeta:
        """The consumer at its next generation (created at generation 1 if new)."""
        check_consumer_name(name)
        with self._tx() as db:
            db.execute("INSERT INTO consumers (name, generation, created_ms) VALUES (?, 1, ?) "
                       "ON CONFLICT (name) DO UPDATE SET generation=generation+1",
                       (name, now_ms()))
            found = self._read(db, name)
            assert found is not None
            return found

    def commit(self, name: str, generation: int, positions: Mapping[int, int]) -> ConsumerMeta:
        """Move the positions of ``generation`` forward; CONSUMER_FENCED if it is not the
        consumer's current one."""
        check_consumer_name(name)
        check_positions(positions)
        with self._tx() as db:
            current = check_generation(name, self._read(db, name), generation)
            moved = advanced(current.positions, positions, now_ms())
            db.executemany(
                "INSERT INTO consumer_positions (name, stream_id, committed_offset, "
                "commit_time_ms) VALUES (?, ?, ?, ?) ON CONFLICT (name, stream_id) DO UPDATE "
                "SET committed_offset=excluded.committed_offset, "
                "commit_time_ms=excluded.commit_time_ms",
                [(name, sid, pos.committed_offset, pos.commit_time_ms)
                 for sid, pos in moved.items() if current.positions.get(sid) != pos])
            found = self._read(db, name)
            assert found is not None
            return found

    def get(self, name: str) -> ConsumerMeta:
        """The consumer, or INVALID_REQUEST naming it."""
        with self._lock:
            found = self._read(self._db, name)
        if found is None:
            raise consumer_missing(name)
        return found

    def list_all(self) -> list[ConsumerMeta]:
        """Every consumer, by name."""
        with self._lock:
            names = [r["name"] for r in
                     self._db.execute("SELECT name FROM consumers ORDER BY name")]
            return [c for c in (self._read(self._db, n) for n in names) if c is not None]

    def delete(self, name: str) -> ConsumerMeta:
        """Forget the consumer (its running generation is fenced from now on)."""
        with self._tx() as db:
            found = self._read(db, name)
            if found is None:
                raise consumer_missing(name)
            db.execute("DELETE FROM consumers WHERE name=?", (name,))
            return found
