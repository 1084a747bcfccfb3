"""A range server's role in each local range: its primary, a secondary, or neither.

The PD places every range on its replicas, one of them the primary; SYNC_RANGES tells each
replica the whole list. Which of them this server is follows from its server id, which the
PD may allocate after the server started (``identity.py``): roles are asked for each time.
"""

from __future__ import annotations

from typing import Protocol

from ...protocol.messages import RangeReplica
from ..storage.range_log import RangeLog


class ServerId(Protocol):
    """Where the server's current id is read (-1 until it has one)."""

    @property
    def server_id(self) -> int: ...


class Roles:
    """This server's role in each local range, by its current id."""

    def __init__(self, identity: ServerId) -> None:
        self._identity = identity

    @property
    def server_id(self) -> int:
        """This server's id (-1 until the PD allocated one)."""
        return self._identity.server_id

    def is_replica(self, rlog: RangeLog) -> bool:
        """Whether this server holds a copy of ``rlog`` (primary or secondary)."""
        me = self._identity.server_id
        return any(r.server.server_id == me for r in rlog.replicas)

    def is_primary(self, rlog: RangeLog) -> bool:
        """Whether appends for ``rlog`` belong here (a range with no replica list is local)."""
        if not rlog.replicas:
            return True
        me = self._identity.server_id
        for r in rlog.replicas:  # a loop, not any(): this runs for every append
            if r.is_primary and r.server.server_id == me:
                return True
        return False

    def secondaries(self, rlog: RangeLog) -> list[RangeReplica]:
        """The replicas of ``rlog`` a primary forwards to: every one but the primary and this
        server."""
        me = self._identity.server_id
        return [r for r in rlog.replicas if not r.is_primary and r.server.server_id != me]
