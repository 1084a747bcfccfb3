"""The project's one error tree, shared by the client, the server and the connector.

Every failure a caller can see is an ``SbpError``. Each error says whether a retry may succeed
(``retriable``) and whether the caller must refresh placement from the PD first
(``invalid_metadata``): transport failures and timeouts set both, server answers take them from
their ``ErrorCode`` (one class per code, written out below). Retry logic reads these flags,
never lists of classes or numbers. Timeouts come in three kinds, like httpcore's: connect, read
and write, all ``SbpTimeoutError``.
"""

from __future__ import annotations

import copy
from enum import IntEnum


class ErrorCode(IntEnum):
    """Status codes of SBP responses. 0-5 come from the specification; the rest are ours."""

    NONE = 0
    UNKNOWN = 1
    INVALID_REQUEST = 2
    UNSUPPORTED_VERSION = 3
    PD_NOT_LEADER = 5
    STREAM_NOT_FOUND = 10
    RANGE_NOT_FOUND = 11
    RANGE_SEALED = 12
    NOT_PRIMARY = 13
    OFFSET_OUT_OF_RANGE = 14
    PAYLOAD_TOO_LARGE = 15
    THROTTLED = 16
    CHECKSUM_MISMATCH = 17
    REQUEST_TIMEOUT = 18
    NOT_ENOUGH_SERVERS = 19
    STORAGE_FULL = 20
    SHUTTING_DOWN = 21
    REPLICATION_FAILED = 22
    TOO_MANY_REQUESTS = 23
    STREAM_ALREADY_EXISTS = 24
    DATA_CORRUPT = 25
    UNAUTHENTICATED = 26
    PERMISSION_DENIED = 27
    CONSUMER_FENCED = 28
    UNKNOWN_PRODUCER = 29
    SEQUENCE_PENDING = 30

    @property
    def retriable(self) -> bool:
        """Whether a retry may succeed (the flag of this code's error class)."""
        return self is not ErrorCode.NONE and _BY_CODE[self].retriable

    @property
    def invalid_metadata(self) -> bool:
        """Whether the caller must refresh placement from the PD before retrying."""
        return self is not ErrorCode.NONE and _BY_CODE[self].invalid_metadata

    @property
    def maybe_applied(self) -> bool:
        """Whether a request (or item) that failed with this code may still have been carried
        out (a write stored): the server said it failed, not that it did nothing."""
        return self is not ErrorCode.NONE and _BY_CODE[self].maybe_applied

    @property
    def meaning(self) -> str:
        """What the code says, in one line (the docstring of its error class)."""
        if self is ErrorCode.NONE:
            return "success"
        return " ".join((_BY_CODE[self].__doc__ or self.name).split())


class SbpError(Exception):
    """Root of every error this package raises on purpose.

    ``retriable``: trying the same operation again may succeed (retry loops read this flag).
    ``invalid_metadata``: the caller's idea of where things live may be stale; refresh it (ask
    the PD again) before retrying.
    ``maybe_applied`` (server answers): the request may have been carried out all the same.
    """

    retriable: bool = False
    invalid_metadata: bool = False
    maybe_applied: bool = False

    def with_context(self, context: str) -> SbpError:
        """A new error of the same class, flags and fields whose message starts with
        ``context`` ("append to stream 7: ..."); the original stays as it was."""
        fresh = copy.copy(self)  # the error's own pickling rules: its message, its fields
        fresh.args = (f"{context}: {self}" if str(self) else context,)
        return fresh


class ProtocolError(SbpError):
    """Bytes that do not follow the SBP wire format."""


class FrameError(ProtocolError):
    """Framing is lost (bad frame_length): the connection must be closed."""


class ChecksumError(ProtocolError):
    """A frame's payload does not match its CRC-32 trailer."""

    # A corrupted answer is worth asking for again; other malformed answers would come back
    # the same.
    retriable = True


class HeaderError(ProtocolError):
    """An extended header that does not parse as the opcode's table."""


class BatchFormatError(ProtocolError):
    """A record batch whose envelope or body is malformed."""


class TransportError(SbpError):
    """The connection failed (refused, reset, closed by the peer)."""

    # The next attempt opens a new connection; the server may have moved meanwhile.
    retriable = True
    invalid_metadata = True


class ConnectError(TransportError):
    """No connection could be opened (refused, no route, a name that does not resolve)."""


class PdUnreachableError(ConnectError):
    """No PD node could be connected to, and none ever answered this client: most often a wrong
    address. The connection error is its ``__cause__``."""


class SbpTimeoutError(SbpError):
    """A connect, read or write timeout expired (catch this for any of them)."""

    retriable = True
    invalid_metadata = True


class ConnectTimeoutError(SbpTimeoutError):
    """Connecting (TCP, then the TLS handshake) took longer than the connect timeout."""


class TlsHandshakeTimeoutError(ConnectTimeoutError):
    """The server accepted the TCP connection but did not complete the TLS handshake within
    the connect timeout (its process is stopped or hung, or no SBP server with TLS listens
    there). A client's connection pool does not dial that address again for a connect
    timeout: its retries fail at once instead of each waiting the timeout out again."""


class ReadTimeoutError(SbpTimeoutError):
    """No answer (or no further frame of one) arrived within the request timeout."""


class WriteTimeoutError(SbpTimeoutError):
    """Sending made no progress within the request timeout (the peer stopped reading)."""


class ReplicaBehindError(SbpError):
    """A replica answered nothing at an offset the range is known to hold: it has not yet
    learned that every replica stored those records (or lost them). Another replica, or this
    one a little later, can serve them."""

    retriable = True


class HistoryRewrittenError(SbpError):
    """A range ended below an offset a reader had been told it holds (or had read up to): the
    records between its end and that offset are not part of the stream. Our cluster never
    does this (docs/reliability.md); a reader that meets it must not go on as if nothing
    happened. ``for_range`` builds one with its fields."""

    stream_id = -1
    range_index = -1
    end_offset = -1
    expected = -1

    @classmethod
    def for_range(cls, stream_id: int, range_index: int, end_offset: int, expected: int
                  ) -> HistoryRewrittenError:
        exc = cls(f"stream {stream_id}: range {range_index} was sealed at offset {end_offset}, "
                  f"below offset {expected} that the reader was told it holds; its records "
                  f"[{end_offset}, {expected}) are not part of the stream")
        exc.stream_id, exc.range_index = stream_id, range_index
        exc.end_offset, exc.expected = end_offset, expected
        return exc


class AppendOutcomeUnknownError(SbpError):
    """An append call ended (at its deadline, or on a failure it cannot retry) with batches
    in doubt: sent, and no answer says whether they were stored (the connection failed, no
    answer came in time, the server failed in a way that does not say). They may be in the
    stream, and sending them again may store them twice; the batches the call knows were not
    stored are not among them. Fields: ``stream_id``; ``in_doubt``, the indexes (in the
    call's batches) of the batches in doubt; ``ranges``, the ranges they were sent to when
    their answers were lost; ``stored``, the indexes known stored; ``batches``, how many the
    call had. The failure that ended the call is the ``__cause__``. Kafka likewise tells an
    unknown outcome from a failure that stored nothing."""

    stream_id = -1
    in_doubt: tuple[int, ...] = ()
    ranges: tuple[int, ...] = ()
    stored: tuple[int, ...] = ()
    batches = 0

    @classmethod
    def for_call(cls, message: str, stream_id: int, in_doubt: tuple[int, ...],
                 ranges: tuple[int, ...], stored: tuple[int, ...], batches: int
                 ) -> AppendOutcomeUnknownError:
        exc = cls(message)
        exc.stream_id, exc.in_doubt, exc.ranges = stream_id, in_doubt, ranges
        exc.stored, exc.batches = stored, batches
        return exc


class ServerError(SbpError):
    """A response status with a non-zero code.

    ``code`` is the status code (an ``ErrorCode``, or a plain int for a code this version does
    not know); ``retriable`` and ``invalid_metadata`` follow it. ``str()`` is ``"NAME:
    message"``; ``message`` and ``detail`` are the server's own.
    """

    code: int = ErrorCode.UNKNOWN
    # The wait the server asked for with this answer (set by the client; retries honour it).
    throttle_time_ms: int = 0

    def __init__(self, message: str = "", code: int | None = None, detail: bytes = b"") -> None:
        self.code = self.code if code is None else code
        self.message = message
        self.detail = detail
        known = _BY_CODE.get(self.code)  # the flags follow the code, whatever the class
        self.retriable = known.retriable if known is not None else False
        self.invalid_metadata = known.invalid_metadata if known is not None else False
        # A code this version does not know says nothing about what the server did.
        self.maybe_applied = known.maybe_applied if known is not None else True
        super().__init__(self._describe())

    def __reduce__(self) -> tuple:
        # Rebuild from the server's own words: the default (the formatted args) would put the
        # code's name in front of the message a second time. Spark pickles executor errors.
        return (type(self), (self.message, self.code, self.detail), self.__dict__)

    def with_context(self, context: str) -> ServerError:
        fresh = copy.copy(self)
        fresh.message = f"{context}: {self.message}" if self.message else context
        fresh.args = (fresh._describe(),)
        return fresh

    def _describe(self) -> str:
        try:
            name = ErrorCode(self.code).name
        except ValueError:
            name = f"code {self.code}"
        return f"{name}: {self.message}" if self.message else name

    @property
    def error_code(self) -> ErrorCode | None:
        """The code as an ``ErrorCode``, or None for a code this version does not know."""
        try:
            return ErrorCode(self.code)
        except ValueError:
            return None

    @staticmethod
    def for_status(code: int, message: str = "", detail: bytes = b"") -> ServerError:
        """The ServerError subclass for ``code`` (plain ServerError for unknown codes)."""
        cls = _BY_CODE.get(code, ServerError)
        return cls(message, code=code, detail=detail)


# One class per code, so callers can catch exactly the failures they handle. The docstring is
# the code's meaning; the flags say what a caller may do about it.


class UnknownError(ServerError):
    """Unexpected server error."""

    code = ErrorCode.UNKNOWN
    maybe_applied = True  # it may have failed after doing its work


class InvalidRequestError(ServerError):
    """The request is malformed or a field is out of bounds."""

    code = ErrorCode.INVALID_REQUEST


class UnsupportedVersionError(ServerError):
    """The request's version is not supported."""

    code = ErrorCode.UNSUPPORTED_VERSION


class PdNotLeaderError(ServerError):
    """This PD node is not the leader; the detail names the cluster and its leader."""

    code = ErrorCode.PD_NOT_LEADER
    retriable = True
    invalid_metadata = True


class StreamNotFoundError(ServerError):
    """The stream does not exist or was deleted."""

    code = ErrorCode.STREAM_NOT_FOUND


class RangeNotFoundError(ServerError):
    """The range is unknown to this server."""

    code = ErrorCode.RANGE_NOT_FOUND
    retriable = True
    invalid_metadata = True


class RangeSealedError(ServerError):
    """The range is sealed; the stream continues in a new range."""

    code = ErrorCode.RANGE_SEALED
    retriable = True
    invalid_metadata = True


class NotPrimaryError(ServerError):
    """This server is not the primary of the range."""

    code = ErrorCode.NOT_PRIMARY
    retriable = True
    invalid_metadata = True


class OffsetOutOfRangeError(ServerError):
    """The offset is below the stream's start (trimmed) or beyond its end."""

    code = ErrorCode.OFFSET_OUT_OF_RANGE


class PayloadTooLargeError(ServerError):
    """A frame, batch or list exceeds a limit."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class ThrottledError(ServerError):
    """The server is busy; wait throttle_time_ms and retry."""

    code = ErrorCode.THROTTLED
    retriable = True


class ChecksumMismatchError(ServerError):
    """The frame's payload checksum did not match."""

    code = ErrorCode.CHECKSUM_MISMATCH
    retriable = True


class RequestTimeoutError(ServerError):
    """The server could not finish within the timeout."""

    code = ErrorCode.REQUEST_TIMEOUT
    retriable = True
    maybe_applied = True  # it may finish after the answer


class NotEnoughServersError(ServerError):
    """Fewer live range servers than the replicas asked for."""

    code = ErrorCode.NOT_ENOUGH_SERVERS
    retriable = True


class StorageFullError(ServerError):
    """The server's disk is full or not writable."""

    code = ErrorCode.STORAGE_FULL
    retriable = True
    maybe_applied = True  # an fsync that failed leaves written bytes behind


class ShuttingDownError(ServerError):
    """The server is shutting down."""

    code = ErrorCode.SHUTTING_DOWN
    retriable = True
    invalid_metadata = True


class ReplicationFailedError(ServerError):
    """A replica did not store the data."""

    code = ErrorCode.REPLICATION_FAILED
    retriable = True
    invalid_metadata = True


class TooManyRequestsError(ServerError):
    """Too many requests in flight on this connection."""

    code = ErrorCode.TOO_MANY_REQUESTS
    retriable = True


class StreamAlreadyExistsError(ServerError):
    """The stream already exists."""

    code = ErrorCode.STREAM_ALREADY_EXISTS


class DataCorruptError(ServerError):
    """This server's stored copy fails its checksum at the offset named in the message; read
    it from another replica."""

    code = ErrorCode.DATA_CORRUPT
    # Retriable in the sense "another replica may hold a sound copy": asking the same server
    # again returns the same bad bytes, so readers move to the next replica at once and give
    # up when every replica reported the same offset corrupt.
    retriable = True


class UnauthenticatedError(ServerError):
    """The connection has no valid credential: authenticate first, with a token that is
    signed by the cluster, not expired and well formed (the message says which failed)."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDeniedError(ServerError):
    """The principal may not do this: the message names the principal, the operation, the
    stream and the permission missing."""

    code = ErrorCode.PERMISSION_DENIED


class ConsumerFencedError(ServerError):
    """A newer generation of the consumer took over (or the consumer was deleted): this one
    may no longer record positions under its name."""

    code = ErrorCode.CONSUMER_FENCED


class UnknownProducerError(ServerError):
    """The range server no longer knows whether it holds this producer's batch (the
    producer's state there expired, or the sequence is older than what it keeps): it was not
    stored again, and it may or may not be in the range."""

    code = ErrorCode.UNKNOWN_PRODUCER
    maybe_applied = True


class SequencePendingError(ServerError):
    """A batch of this producer and sequence is stored but not yet durable on every replica;
    ask again for its outcome."""

    code = ErrorCode.SEQUENCE_PENDING
    retriable = True
    maybe_applied = True


_BY_CODE: dict[int, type[ServerError]] = {
    cls.code: cls for cls in ServerError.__subclasses__()
}
