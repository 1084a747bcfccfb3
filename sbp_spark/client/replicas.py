"""Where a range's replicas are: ranges known from an earlier look-up, and the replica a read
goes to next, asking the PD again when the addresses it knows may be stale."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from sbp_spark.protocol.errors import DataCorruptError, RangeNotFoundError, SbpError, ServerError
from sbp_spark.protocol.messages import Range, RangeReplica, RangeServer

from .pd import PdClient
from .retry import is_retriable
from .types import ReplicaLocation

_log = logging.getLogger(__name__)

# A read asks the PD where a range's replicas are now between its attempts, and waits for the
# answer this long at most: meanwhile it goes on with the replicas it knows, and asks again
# after its next failure (a PD electing a leader must not hold up a read that another replica
# can serve).
REFRESH_WAIT_S = 2.0


def known_range(stream_id: int, range_index: int, replicas: Sequence[ReplicaLocation],
                start: int = 0, end: int = -1, is_open: bool = True) -> Range:
    """The client's description of a range known from an earlier look-up, for ``fetch`` and
    ``TimeSearch`` (no PD round trip): open ranges read up to ``end`` as their
    ``next_offset``, sealed ones end there."""
    return Range(stream_id=stream_id, range_index=range_index, start_offset=start,
                 next_offset=max(end, start), end_offset=-1 if is_open else end,
                 servers=[RangeReplica(RangeServer(r.server_id, r.address), r.is_primary)
                          for r in replicas])


class ReplicaCursor:
    """Where one read of a range goes: its replicas, primary first, moving to the next one
    after each failure and asking the PD again where they live when a failure says the
    address may be stale (a server restarted on another port, the range moved or was sealed).
    """

    def __init__(self, pd: PdClient, range: Range) -> None:
        self.pd = pd
        self.range = range
        self.servers = servers_of(range)
        self.primary = primary_of(range)
        self.index = 0
        self.sealed_end: int | None = None if range.is_open else range.end_offset
        if not self.servers:
            # Planned without a replica (every server was gone): the PD may know one now.
            self.refresh(None)
        if not self.servers:
            raise RangeNotFoundError(
                f"range {range.stream_id}/{range.range_index} lists no range server to read "
                f"from")

    def current(self) -> str:
        return self.servers[self.index % len(self.servers)]

    def after_failure(self, error: SbpError, deadline: float) -> bool:
        """Move on after ``error`` (a ``Retrier`` hook): True to try again at once (another
        replica, or new addresses from the PD), False to back off first."""
        self.index += 1
        round_done = self.index % len(self.servers) == 0
        if isinstance(error, DataCorruptError):
            # The same server would send the same bytes: the next replica, without waiting.
            return True
        if (error.invalid_metadata or round_done) and self.refresh(deadline):
            return True
        return not round_done

    def refresh(self, deadline: float | None) -> bool:
        """Ask the PD for the range's replicas, until ``deadline`` (a ``time.monotonic()``
        value) but ``REFRESH_WAIT_S`` at most; True when it said something new (other
        addresses, or that the range is sealed)."""
        rng = self.range
        wait_until = time.monotonic() + REFRESH_WAIT_S
        if deadline is not None:
            wait_until = min(wait_until, deadline)
        try:
            (result,) = self.pd.describe_ranges([rng], deadline=wait_until)
        except SbpError as exc:
            # The PD is unreachable too: keep reading from the addresses known so far.
            _log.debug("re-resolving range %d/%d from the PD failed: %s", rng.stream_id,
                       rng.range_index, exc)
            return False
        error = result.exception()
        if error is not None:
            if is_retriable(error):
                return False
            # Deleted meanwhile, say: reading on would only fail the same way.
            raise error.with_context(f"range {rng.range_index} of stream {rng.stream_id}")
        fresh = result.value
        if fresh is None:
            return False
        learned = False
        if not fresh.is_open and self.sealed_end != fresh.end_offset:
            self.sealed_end, learned = fresh.end_offset, True
        servers = servers_of(fresh)
        self.primary = primary_of(fresh) or self.primary
        if not servers or servers == self.servers:
            return learned
        _log.info("range %d/%d: replicas now at %s (were %s)", rng.stream_id, rng.range_index,
                  ", ".join(servers), ", ".join(self.servers) or "none")
        self.servers, self.index = servers, 0
        return True


def corrupt_everywhere(stream_id: int, range_index: int, offset: int,
                       reports: dict[str, str]) -> ServerError:
    """The error of a read whose every replica holds a corrupt copy at ``offset``."""
    detail = "; ".join(f"{address}: {message}" for address, message in reports.items())
    return DataCorruptError(
        f"stream {stream_id} range {range_index}: offset {offset} is corrupt on every replica "
        f"({', '.join(reports)}), no sound copy to read: {detail}")


def servers_of(range: Range) -> list[str]:
    """Addresses to read ``range`` from: the primary first, then the other replicas."""
    replicas = sorted(range.servers, key=lambda r: not r.is_primary)
    return [r.server.advertise_addr for r in replicas if r.server.advertise_addr]


def primary_of(range: Range) -> str | None:
    """The primary's address (None when the range names none)."""
    return next((r.server.advertise_addr for r in range.servers
                 if r.is_primary and r.server.advertise_addr), None)


__all__ = ["ReplicaCursor", "corrupt_everywhere", "known_range", "primary_of", "servers_of"]
