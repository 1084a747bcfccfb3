"""Result types of the client API."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

from sbp_spark.protocol.errors import ErrorCode, SbpError, ServerError
from sbp_spark.protocol.messages import OK, Status
from sbp_spark.protocol.records import BatchHeader

T = TypeVar("T")

_KNOWN_CODES = {int(code): code for code in ErrorCode}


class Outcome(enum.Enum):
    """What became of one item of a request."""

    DONE = "done"  # carried out: the item succeeded
    NOT_DONE = "not done"  # known not carried out: never sent, or refused by the server
    UNKNOWN = "unknown"  # sent, and nothing says whether it was carried out


@dataclass
class ItemResult(Generic[T]):
    """The outcome of one item of a batch request: a value, or why there is none.

    ``status`` is the server's answer for the item; ``error`` is set instead when the item got
    no answer at all: never sent (the connection could not be opened, an earlier frame
    failed), or sent with its answer lost (``in_doubt``: the connection failed, or no answer
    came in time).
    """

    value: T | None
    status: Status = OK
    error: SbpError | None = None
    in_doubt: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and self.status.code == 0

    @property
    def outcome(self) -> Outcome:
        """Whether the server carried the item out, did not, or may have (a lost answer, or
        a failure whose code does not say: ``ErrorCode.maybe_applied``)."""
        if self.ok:
            return Outcome.DONE
        if self.error is not None:
            return Outcome.UNKNOWN if self.in_doubt else Outcome.NOT_DONE
        known = _KNOWN_CODES.get(self.status.code)
        return Outcome.UNKNOWN if known is None or known.maybe_applied else Outcome.NOT_DONE

    def exception(self) -> SbpError | None:
        """The error this item failed with, or None on success."""
        if self.error is not None:
            return self.error
        if self.status.code:
            return status_error(self.status)
        return None

    def unwrap(self) -> T:
        """The value; raises the item's error (a ``ServerError`` for a failed status)."""
        error = self.exception()
        if error is not None:
            raise error
        # Without an error the value is the item's answer, so of type T (None only when T
        # admits it); ``value`` is Optional for the failed items alone.
        return cast(T, self.value)


def status_error(status: Status, throttle_time_ms: int = 0, context: str = "") -> ServerError:
    """The ``ServerError`` for a failed status; ``throttle_time_ms`` rides along for retries."""
    message = f"{context}: {status.message}" if context and status.message else (
        context or status.message)
    error = ServerError.for_status(int(status.code), message, bytes(status.detail))
    if throttle_time_ms > 0:
        error.throttle_time_ms = throttle_time_ms  # read by retry.throttle_ms
    return error


@dataclass(slots=True)
class FetchedBatch:
    """One record batch read from a range, exactly as stored (envelope included).

    ``data`` is a view of the received frame (no copy). The first batch of a fetch may begin
    before the requested start offset and the last may run past the requested end: batches are
    never split, so readers keep only the records in ``[start, end)`` they asked for
    (``header.base_offset`` is the offset of the batch's first record).
    """

    stream_id: int
    range_index: int
    header: BatchHeader
    data: memoryview
    # host:port of the replica that served it (where a reader saw what it saw)
    server: str = ""


@dataclass(frozen=True)
class ReplicaLocation:
    """Where one replica of a range lives, as callers remember it between requests: the range
    server's id and address, and whether it is the range's primary (a planned Spark partition
    carries these to its executor)."""

    server_id: int
    address: str
    is_primary: bool


@dataclass(slots=True)
class Appended:
    """Where one appended batch landed: offsets [base_offset, base_offset + record_count).

    ``range_index`` is the range the batch was sent to, as ``StreamWriter.append`` knew it:
    an APPEND names no range, and a range server stores a client's batch in the stream's open
    range it holds, so after someone else sealed the range (another writer, ``sbp ranges
    seal``) and the PD opened the next one on the same server, the batch is in that next
    range. ``SbpClient.locate`` gives the ranges that hold the batches (one PD request per
    stream), off the append path."""

    stream_id: int
    range_index: int
    base_offset: int
    record_count: int
    batch_length: int

    @property
    def end_offset(self) -> int:
        return self.base_offset + self.record_count
