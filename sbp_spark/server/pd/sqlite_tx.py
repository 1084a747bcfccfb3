"""A write transaction on a SQLite connection the PD's stores share between threads."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager


@contextmanager
def immediate(db: sqlite3.Connection, lock: AbstractContextManager[object]
              ) -> Iterator[sqlite3.Connection]:
    """``BEGIN IMMEDIATE`` on ``db`` under ``lock`` (the store's, plain or re-entrant):
    committed when the block ends, rolled back when it raises."""
    with lock:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            # SQLite has rolled back already after some errors (SQLITE_FULL): a ROLLBACK then
            # fails and would hide the error that matters.
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        else:
            db.execute("COMMIT")
