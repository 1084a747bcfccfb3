"""The PD's range operations a client asks for: seal-and-new, create the next range, list a
server's ranges."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import InvalidRequestError, RangeNotFoundError

from .meta import RangeMeta, SealedEnd, ServerMeta
from .succession import StreamLocks, Succeeded, Succession

log = logging.getLogger(__package__)


class RangeRecords(Protocol):
    """What range operations read of the metadata."""

    def list_ranges(self, stream_id: int) -> list[RangeMeta]: ...

    def last_range(self, stream_id: int) -> RangeMeta: ...

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]: ...

    def get_server(self, server_id: int) -> ServerMeta | None: ...

    def list_servers(self) -> list[ServerMeta]: ...


class SealCalls(Protocol):
    """How a seal reaches a range's replicas (``calls.RangeServerCalls``): the primary must
    answer; the range ends where they say."""

    def seal_on_servers(self, rng: RangeMeta, timeout_s: float | None = None,
                        skip: Iterable[int] = ()) -> SealedEnd: ...


class RangeOperations:
    """SEAL_RANGES, CREATE_RANGE and LIST_RANGES by server; refusals raise ``ServerError``s.
    ``went_silent`` says which servers liveness has evidence are down or cut off
    (``Liveness.went_silent``): a seal does not wait on them."""

    def __init__(self, records: RangeRecords, calls: SealCalls, succession: Succession,
                 locks: StreamLocks, went_silent: Callable[[int], bool]) -> None:
        self._records = records
        self._calls = calls
        self._succession = succession
        self._locks = locks
        self._went_silent = went_silent

    def on_server(self, server: m.RangeServer) -> tuple[int, list[RangeMeta]]:
        """The server's id (looked up by address when the id is unset) and its ranges."""
        sid = server.server_id
        if sid < 0:
            if not server.advertise_addr:
                raise InvalidRequestError("range_server needs a server_id or an advertise_addr")
            matches = [s.server_id for s in self._records.list_servers()
                       if s.advertise_addr == server.advertise_addr]
            if not matches:
                raise InvalidRequestError(
                    f"no range server has advertised address {server.advertise_addr}")
            sid = matches[-1]
        elif self._records.get_server(sid) is None:
            raise InvalidRequestError(f"no range server has id {sid} (this PD never issued it)")
        return sid, self._records.ranges_on_server(sid)

    def seal(self, stream_id: int, range_index: int, timeout_s: float | None = None
             ) -> RangeMeta:
        """Seal-and-new: seal the open range where its primary stopped, open the next one.

        Returns the stream's new open range. Asking to seal a range that is already sealed
        returns the open range that followed it (so racing writers all land on the same one);
        if none was opened yet (no server was live then), it is opened now.
        """
        with self._locks.hold(stream_id):
            last = self._records.list_ranges(stream_id)[-1]
            if range_index < 0 or range_index > last.range_index:
                raise RangeNotFoundError(f"stream {stream_id} has no range {range_index}")
            if range_index < last.range_index or not last.is_open:
                if last.is_open:
                    return last
                return self._succession.open_next(stream_id, timeout_s)
            # A secondary that went silent is not asked, as a failover would not ask it: a
            # stopped one would hold this seal, and the stream's lock, for the whole timeout.
            # Those that did not seal are not pushed the end either (they are resynced), and
            # are kept away from the next range with the secondaries the primary could not
            # reach: one that the PD still counts live may be stopped all the same, and the
            # next range's appends would wait on it again.
            silent = [sid for sid in last.server_ids
                      if sid != last.primary and self._went_silent(sid)]
            sealed = self._calls.seal_on_servers(last, timeout_s, skip=silent)
            done = self._succession.seal_and_open_next(
                last, sealed.end, timeout_s=timeout_s, skip=sealed.missed, announce=_log_seal,
                unreachable=tuple(dict.fromkeys(sealed.unreachable + sealed.missed)))
        if done.opened is None:
            assert done.unplaced is not None
            raise done.unplaced
        return done.opened

    def create(self, stream_id: int, range_index: int, timeout_s: float | None = None
               ) -> RangeMeta:
        """Open range ``range_index`` of a stream whose last range is sealed.

        ``range_index`` must be the last index + 1. Repeating a create whose range is already
        open (a retry after a lost answer) returns that range.
        """
        with self._locks.hold(stream_id):
            last = self._records.last_range(stream_id)
            if range_index == last.range_index and last.is_open:
                return last
            if last.is_open:
                raise InvalidRequestError(
                    f"cannot create range {range_index} of stream {stream_id}: its last range "
                    f"{last.range_index} is still open; seal it (SEAL_RANGES opens range "
                    f"{last.range_index + 1}) before creating the next one")
            if range_index != last.range_index + 1:
                raise InvalidRequestError(
                    f"cannot create range {range_index} of stream {stream_id}: its last range "
                    f"{last.range_index} is sealed, so the next range is "
                    f"{last.range_index + 1}")
            return self._succession.open_next(stream_id, timeout_s)


def _log_seal(done: Succeeded) -> None:
    if done.opened is not None:
        log.info("sealed range %d of stream %d at %d; range %d open on %s",
                 done.sealed.range_index, done.sealed.stream_id, done.sealed.end_offset,
                 done.opened.range_index, done.opened.server_ids)
