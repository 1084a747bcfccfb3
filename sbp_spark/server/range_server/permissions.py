"""The permissions a range server enforces on APPEND and FETCH, learned from the PD
(docs/wire.md, "Who may do what").

Each heartbeat answer names the version of the permissions in force (``acl_version``); when it
differs from the copy held here, the PD link asks for the permissions (DESCRIBE_PERMISSIONS,
as a server) and the copy is replaced, long polls woken so that a FETCH waiting at the tail
finds a revocation at once. A revoked permission so stops new requests within about a
heartbeat interval, and a waiting FETCH within half a second more. Until the first copy
arrives, requests that need a permission are answered THROTTLED (retriable): the server does
not know yet, and must not refuse for good nor serve.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ...protocol.errors import ThrottledError
from ...protocol.messages import Permission
from ..auth.acl import EVERY_STREAM, AclEntry, AclTable

log = logging.getLogger(__name__)


class LearnedPermissions:
    """The copy of the PD's permissions a range server holds; ``wake`` wakes its long polls
    after a change."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._table: AclTable | None = None
        self._announced: int | None = None

    def table(self) -> AclTable:
        """The permissions now; THROTTLED while none were learned yet."""
        table = self._table
        if table is None:
            raise ThrottledError("this range server has not learned the permissions from the "
                                 "PD yet; try again in a moment")
        return table

    @property
    def version(self) -> int | None:
        """The version the PD announced for the copy held (None: none held)."""
        return self._announced

    def announced(self, version: int, fetch: Callable[[], tuple[int, list[Permission]]]
                  ) -> None:
        """The PD says ``version`` is in force: take the permissions with ``fetch`` unless
        the copy held is of that version already."""
        if version < 0 or version == self._announced:
            return
        with self._lock:
            if version == self._announced:
                return
            acl_version, permissions = fetch()
            entries = [AclEntry(p.principal, p.operation, p.stream) for p in permissions]
            resolved = {p.stream: p.stream_id for p in permissions
                        if p.stream_id >= 0 and p.stream != EVERY_STREAM
                        and not p.stream.isdigit()}
            self._table = AclTable.of(acl_version, entries, resolved)
            self._announced = version
        log.info("permissions of version %d in force (%d entries)", acl_version, len(entries))
        self._wake()


__all__ = ["LearnedPermissions"]
