"""The project's one error tree, shared by the client, the server and the connector.

Every failure a caller can see is an ``SbpError``. Server answers carry an ``ErrorCode``; each
code knows whether a retry may succeed (``retriable``) and whether the caller must refresh
placement from the PD first (``invalid_metadata``). Retry logic reads these flags, never lists
of numbers.
"""

from __future__ import annotations

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

    @property
    def retriable(self) -> bool:
        return _CODE_INFO[self][0]

    @property
    def invalid_metadata(self) -> bool:
        return _CODE_INFO[self][1]

    @property
    def meaning(self) -> str:
        return _CODE_INFO[self][2]


# code -> (retriable, invalid_metadata, meaning)
_CODE_INFO: dict[ErrorCode, tuple[bool, bool, str]] = {
    ErrorCode.NONE: (False, False, "success"),
    ErrorCode.UNKNOWN: (False, False, "unexpected server error"),
    ErrorCode.INVALID_REQUEST: (
        False, False, "the request is malformed or a field is out of bounds"),
    ErrorCode.UNSUPPORTED_VERSION: (False, False, "the request's version is not supported"),
    ErrorCode.PD_NOT_LEADER: (
        True, True, "this PD node is not the leader; the detail names the cluster and its leader"),
    ErrorCode.STREAM_NOT_FOUND: (False, False, "the stream does not exist or was deleted"),
    ErrorCode.RANGE_NOT_FOUND: (True, True, "the range is unknown to this server"),
    ErrorCode.RANGE_SEALED: (
        True, True, "the range is sealed; the stream continues in a new range"),
    ErrorCode.NOT_PRIMARY: (True, True, "this server is not the primary of the range"),
    ErrorCode.OFFSET_OUT_OF_RANGE: (
        False, False, "the offset is below the stream's start (trimmed) or beyond its end"),
    ErrorCode.PAYLOAD_TOO_LARGE: (False, False, "a frame, batch or list exceeds a limit"),
    ErrorCode.THROTTLED: (True, False, "the server is busy; wait throttle_time_ms and retry"),
    ErrorCode.CHECKSUM_MISMATCH: (True, False, "the frame's payload checksum did not match"),
    ErrorCode.REQUEST_TIMEOUT: (True, False, "the server could not finish within the timeout"),
    ErrorCode.NOT_ENOUGH_SERVERS: (
        True, False, "fewer live range servers than the replicas asked for"),
    ErrorCode.STORAGE_FULL: (True, False, "the server's disk is full or not writable"),
    ErrorCode.SHUTTING_DOWN: (True, True, "the server is shutting down"),
    ErrorCode.REPLICATION_FAILED: (True, True, "a replica did not store the data"),
    ErrorCode.TOO_MANY_REQUESTS: (True, False, "too many requests in flight on this connection"),
    ErrorCode.STREAM_ALREADY_EXISTS: (False, False, "the stream already exists"),
    # Retriable in the sense "another replica may hold a sound copy": asking the same server
    # again returns the same bad bytes, so readers move to the next replica at once and give
    # up when every replica reported the same offset corrupt.
    ErrorCode.DATA_CORRUPT: (
        True, False, "this server's stored copy fails its checksum at the offset named in the "
                     "message; read it from another replica"),
}


class SbpError(Exception):
    """Root of every error this package raises on purpose."""


class ProtocolError(SbpError):
    """Bytes that do not follow the SBP wire format."""


class FrameError(ProtocolError):
    """Framing is lost (bad frame_length): the connection must be closed."""


class ChecksumError(ProtocolError):
    """A frame's payload does not match its CRC-32 trailer."""


class HeaderError(ProtocolError):
    """An extended header that does not parse as the opcode's table."""


class BatchFormatError(ProtocolError):
    """A record batch whose envelope or body is malformed."""


class TransportError(SbpError):
    """The connection failed (refused, reset, closed by the peer)."""


class SbpTimeoutError(SbpError):
    """A connect, request or idle timeout expired."""


class ReplicaBehindError(SbpError):
    """A replica answered nothing at an offset the range is known to hold: it has not yet
    learned that every replica stored those records (or lost them). Another replica, or this
    one a little later, can serve them."""


class HistoryRewrittenError(SbpError):
    """A range ended below an offset a reader had been told it holds (or had read up to): the
    records between its end and that offset are not part of the stream. Our cluster never
    does this (docs/reliability.md); a reader that meets it must not go on as if nothing
    happened."""

    def __init__(self, stream_id: int, range_index: int, end_offset: int, expected: int,
                 what: str = "") -> None:
        self.stream_id = stream_id
        self.range_index = range_index
        self.end_offset = end_offset
        self.expected = expected
        self.what = what
        super().__init__(
            f"stream {stream_id}: range {range_index} was sealed at offset {end_offset}, below "
            f"offset {expected} {what or 'that the reader was told it holds'}; its records "
            f"[{end_offset}, {expected}) are not part of the stream")

    def __reduce__(self):
        return (type(self), (self.stream_id, self.range_index, self.end_offset, self.expected,
                             self.what))


class ServerError(SbpError):
    """A response status with a non-zero code."""

    code: int = ErrorCode.UNKNOWN

    def __init__(self, message: str = "", code: int | None = None, detail: bytes = b"") -> None:
        if code is not None:
            self.code = code
        self.message = message
        self.detail = detail
        super().__init__(self._describe())

    def _describe(self) -> str:
        try:
            name = ErrorCode(self.code).name
        except ValueError:
            name = f"code {self.code}"
        return f"{name}: {self.message}" if self.message else name

    @property
    def error_code(self) -> ErrorCode | None:
        try:
            return ErrorCode(self.code)
        except ValueError:
            return None

    @property
    def retriable(self) -> bool:
        ec = self.error_code
        return ec.retriable if ec is not None else False

    @property
    def invalid_metadata(self) -> bool:
        ec = self.error_code
        return ec.invalid_metadata if ec is not None else False

    @staticmethod
    def for_status(code: int, message: str = "", detail: bytes = b"") -> ServerError:
        """The ServerError subclass for ``code`` (plain ServerError for unknown codes)."""
        cls = _BY_CODE.get(code, ServerError)
        return cls(message, code=code, detail=detail)


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


_BY_CODE: dict[int, type[ServerError]] = {}
for _code in ErrorCode:
    if _code is ErrorCode.NONE:
        continue
    _cls = type(_camel(_code.name) + "Error", (ServerError,), {"code": _code,
                                                               "__doc__": _code.meaning})
    _BY_CODE[_code] = _cls

# Names for the classes made above, so callers and type checkers can import them.
UnknownError = _BY_CODE[ErrorCode.UNKNOWN]
InvalidRequestError = _BY_CODE[ErrorCode.INVALID_REQUEST]
UnsupportedVersionError = _BY_CODE[ErrorCode.UNSUPPORTED_VERSION]
PdNotLeaderError = _BY_CODE[ErrorCode.PD_NOT_LEADER]
StreamNotFoundError = _BY_CODE[ErrorCode.STREAM_NOT_FOUND]
RangeNotFoundError = _BY_CODE[ErrorCode.RANGE_NOT_FOUND]
RangeSealedError = _BY_CODE[ErrorCode.RANGE_SEALED]
NotPrimaryError = _BY_CODE[ErrorCode.NOT_PRIMARY]
OffsetOutOfRangeError = _BY_CODE[ErrorCode.OFFSET_OUT_OF_RANGE]
PayloadTooLargeError = _BY_CODE[ErrorCode.PAYLOAD_TOO_LARGE]
ThrottledError = _BY_CODE[ErrorCode.THROTTLED]
ChecksumMismatchError = _BY_CODE[ErrorCode.CHECKSUM_MISMATCH]
RequestTimeoutError = _BY_CODE[ErrorCode.REQUEST_TIMEOUT]
NotEnoughServersError = _BY_CODE[ErrorCode.NOT_ENOUGH_SERVERS]
StorageFullError = _BY_CODE[ErrorCode.STORAGE_FULL]
ShuttingDownError = _BY_CODE[ErrorCode.SHUTTING_DOWN]
ReplicationFailedError = _BY_CODE[ErrorCode.REPLICATION_FAILED]
TooManyRequestsError = _BY_CODE[ErrorCode.TOO_MANY_REQUESTS]
StreamAlreadyExistsError = _BY_CODE[ErrorCode.STREAM_ALREADY_EXISTS]
DataCorruptError = _BY_CODE[ErrorCode.DATA_CORRUPT]
