"""The PD's permissions: grants and revocations kept in its metadata (SQLite or etcd alike),
and the current table its authorizer checks against (docs/wire.md, "Who may do what").

Every PD node reads the table from the store, so a follower that becomes the leader enforces
what the old leader granted. A node keeps the table it read for ``refresh_s`` (another node,
the leader before, may have changed it since) and reads it again at once after its own
changes.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Protocol

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import InvalidRequestError, SbpError, StreamNotFoundError

from ..auth.acl import EVERY_STREAM, AclEntry, AclTable
from .meta import StreamMeta

log = logging.getLogger(__name__)

# How long a PD node trusts the table it read: a change made through another node (the
# leader before a failover) is enforced here within this.
DEFAULT_ACL_REFRESH_S = 1.0


class AclRecords(Protocol):
    """What this part reads and writes of the metadata (``meta.MetadataStore``)."""

    def acl(self) -> tuple[int, list[AclEntry]]: ...

    def change_acl(self, grant: bool, entries: Sequence[AclEntry]) -> int: ...

    def get_stream(self, stream_id: int) -> StreamMeta: ...

    def stream_named(self, name: str) -> StreamMeta: ...


def entry_of(permission: m.Permission) -> AclEntry:
    """A permission of a request as an entry; ``InvalidRequestError`` saying what is wrong."""
    entry = AclEntry(permission.principal, permission.operation, permission.stream)
    problem = entry.problem()
    if problem is not None:
        raise InvalidRequestError(f"permission {entry}: {problem}")
    return entry


class Permissions:
    """Grants, revocations and the current table of one PD node."""

    def __init__(self, records: AclRecords, refresh_s: float = DEFAULT_ACL_REFRESH_S) -> None:
        self._records = records
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._table: AclTable | None = None
        self._read_at = 0.0

    # -- the table the authorizer checks against -----------------------------------------------

    def table(self) -> AclTable:
        """The permissions now: read again from the store when older than ``refresh_s``."""
        table = self._table
        if table is not None and time.monotonic() - self._read_at < self._refresh_s:
            return table
        with self._lock:
            if self._table is not None and time.monotonic() - self._read_at < self._refresh_s:
                return self._table
            try:
                version, entries = self._records.acl()
            except SbpError as exc:
                if self._table is None:
                    raise
                # The store out of reach serves nothing else either; what was read stays.
                log.warning("cannot read the permissions again (%s); the last read stays", exc)
                return self._table
            self._table = AclTable.of(version, entries)
            self._read_at = time.monotonic()
            return self._table

    def forget(self) -> None:
        """Read the table again at its next use (this node changed it, or took office)."""
        with self._lock:
            self._read_at = 0.0

    def view_version(self) -> int:
        """What range servers compare to know their copy is current: the version, and with
        entries naming streams by name also the streams those names name now (a stream
        created or deleted under a granted name changes what a range server must enforce)."""
        table = self.table()
        if not table.names_streams:
            return table.version
        named = sorted({e.stream for e in table.entries
                        if e.stream and e.stream != EVERY_STREAM and not e.stream.isdigit()})
        resolved = [(name, self._id_or_none(name)) for name in named]
        return (table.version << 32) | zlib.crc32(repr(resolved).encode())

    def _id_or_none(self, name: str) -> int | None:
        try:
            return self.id_of(name)
        except StreamNotFoundError:
            return None

    # -- names of streams (the authorizer's StreamNames) ----------------------------------------

    def name_of(self, stream_id: int) -> str:
        return self._records.get_stream(stream_id).name

    def id_of(self, name: str) -> int:
        return self._records.stream_named(name).stream_id

    # -- requests --------------------------------------------------------------------------------

    def change(self, grant: bool, permissions: Sequence[m.Permission]) -> int:
        """Grant or revoke ``permissions`` (all or, for an invalid one, none); the new
        version."""
        if not permissions:
            raise InvalidRequestError("name at least one permission")
        entries = [entry_of(p) for p in permissions]
        version = self._records.change_acl(grant, entries)
        self.forget()
        log.info("permissions %s (version %d): %s", "granted" if grant else "revoked",
                 version, "; ".join(str(e) for e in entries))
        return version

    def describe(self, principal: str = "") -> tuple[int, list[m.Permission]]:
        """The permissions of ``principal`` ("" every principal's), each with the live stream
        its name names now (what a range server, which knows streams by id, matches)."""
        self.forget()
        table = self.table()
        out = []
        for e in sorted(table.entries):
            if principal and e.principal != principal:
                continue
            stream_id = -1
            if e.stream.isdigit():
                stream_id = int(e.stream)
            elif e.stream and e.stream != EVERY_STREAM:
                try:
                    stream_id = self.id_of(e.stream)
                except StreamNotFoundError:
                    stream_id = -1
            out.append(m.Permission(e.principal, e.operation, e.stream, stream_id))
        return table.version, out


__all__ = ["DEFAULT_ACL_REFRESH_S", "AclRecords", "Permissions", "entry_of"]
