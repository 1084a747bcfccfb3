"""Client settings: one small typed dataclass, validated when built."""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass, field

from sbp_spark.protocol.constants import MAX_FRAME_LENGTH, MIN_FRAME_LENGTH

from ..transport.tls import TlsConfig, client_context, unusable_file

# Default byte budget of one FETCH request (it bounds the whole streamed answer, not one batch).
# The client queues an answer's frames as fast as the socket delivers them, so this is also what
# a reader that pauses can have buffered; readers ask again from where an answer stopped. 64 MiB
# keeps that bounded. Each new answer starts with the link drained, which costs a fast reader
# some throughput: alternating runs of whole-stream reads here gave 128 MiB answers 0-10% more
# MB/s and 256 MiB ones 0-16% (some runs showed no difference at all), for two and four
# times the memory a paused reader can hold.
DEFAULT_FETCH_MAX_BYTES = 64 * 1024 * 1024
# The most batch_max_bytes (an int32 on the wire) can carry.
MAX_FETCH_MAX_BYTES = (1 << 31) - 1


DEFAULT_APPEND_FRAME_BYTES = 1024 * 1024
# APPEND frames kept in flight. A range server acknowledges after its fsync policy is met (by
# default a group commit every 10 ms), so the window, not the link, bounds a writer: 4 x 1 MiB
# frames gave ~185 MB/s here, 16 gave ~470 MB/s. Once range servers reused page-cache pages
# (pagecache.py), 16 gave 540-590 MB/s, 32 gave 660-680 and 64 660-730: 32 takes most of it
# for half the memory a writer pins.
DEFAULT_MAX_INFLIGHT_FRAMES = 32
# A range server whose process is stopped (SIGSTOP) or hung still takes connections and
# requests (its kernel does), but answers nothing. Its PD fails its ranges over after a few
# seconds of missed heartbeats; a writer or reader waiting on it would wait its whole request
# timeout. A server's network core answers PING on the connection's reader even while an
# APPEND waits for its fsync or its secondaries, so one that lets a PING go unanswered for
# this long is taken as stopped.
DEFAULT_PROBE_INTERVAL_S = 1.0
# Two probe intervals, counted from the append that got no answer: a writer cut off from a
# healthy primary asks for the seal when its first PING goes unanswered, about 2 s after the
# append (the bound is 8 s). It must exceed the range servers' heartbeat interval (1 s): the
# writer seals only once the PD has heard the server since the append (a server stopped or
# killed instead is the PD's failover's, after 3 s of silence).
DEFAULT_UNREACHABLE_PRIMARY_S = 2.0
# How long a call retries by default (see ClientConfig.retry_deadline_s).
DEFAULT_RETRY_DEADLINE_S = 60.0


@dataclass
class ClientConfig:
    """Timeouts, retry policy and pipelining limits shared by every client class.

    Times are in seconds (``*_s``) or milliseconds (``*_ms``) as the names say.
    """

    connect_timeout_s: float = 5.0
    # How long a caller waits for each frame of an answer (not for the whole answer: a streamed
    # FETCH may legitimately run longer than this). Also the socket write timeout.
    request_timeout_s: float = 30.0
    # A pooled connection with nothing outstanding for this long is closed.
    idle_timeout_s: float = 300.0
    # A call retries a retriable failure, backing off, until retry_deadline_s after it began:
    # time, not a count, bounds it, so that it rides out what a cluster goes through. The PD
    # fails a silent range server over after its liveness timeout (3 s by default, then the
    # seal and the new range), a new PD leader serves 3-4 s after the old one died and gives
    # range servers another liveness timeout to find it before failing any over: well within
    # a minute. The last attempt starts at the deadline at the latest.
    retry_deadline_s: float = DEFAULT_RETRY_DEADLINE_S
    # A cap on the number of retries as well (None: none; the deadline alone bounds a call).
    retries: int | None = None
    retry_backoff_ms: int = 50
    retry_backoff_max_ms: int = 2000
    max_inflight_frames: int = DEFAULT_MAX_INFLIGHT_FRAMES
    max_frame_bytes: int = MAX_FRAME_LENGTH
    # APPEND frames are closed at about this size (a larger batch still gets a frame of its
    # own, up to max_frame_bytes). Several mid-sized frames in flight keep the client and the
    # server busy at once; one 16 MiB frame at a time leaves each waiting for the other.
    append_frame_bytes: int = DEFAULT_APPEND_FRAME_BYTES
    # timeout_ms sent in request headers that carry one (server-side processing bound).
    server_timeout_ms: int = 30_000
    # An APPEND or FETCH whose answer from a range server is this late (a FETCH: beyond its
    # max_wait_ms) PINGs the server; when the PING gets no answer within this long either,
    # the server is taken as stopped or hung and the request fails at once with a retriable
    # ReadTimeoutError (a writer then asks the PD where the stream went) instead of after
    # request_timeout_s. A server that answers PINGs is waited for up to request_timeout_s.
    probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S
    # A writer that has had no answer from the primary of its stream's open range (nor to a
    # PING, nor a connection) for this long since it sent the request, while the PD still
    # lists that server as the primary and has heard it since (only the link between the
    # two is broken), asks the PD to seal the range and goes on in the next one, placed away
    # from that server (docs/reliability.md, "Partitions"), instead of waiting for the
    # network to heal.
    unreachable_primary_s: float = DEFAULT_UNREACHABLE_PRIMARY_S
    # Appends are idempotent (docs/reliability.md, "Duplicates"): each SbpClient appends under
    # a producer id and per-range sequence numbers, and a range server stores a batch sent
    # again once only. False: at least once (what a range server without idempotent appends
    # gives whatever the client sends).
    idempotent: bool = True
    # TLS (see transport/tls.py): verify servers against tls_ca_file (else the system's trust
    # store) and, for servers that require client certificates, present tls_cert_file and
    # tls_key_file (PEM).
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # A signed token (JWT) each connection presents with AUTHENTICATE before anything else,
    # for clusters that authenticate (docs/wire.md, "Who may do what"); None: none is sent.
    # A secret: kept out of repr, so it never reaches a log or an error message.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "request_timeout_s", "idle_timeout_s",
                     "retry_deadline_s", "probe_interval_s", "unreachable_primary_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"ClientConfig.{name}={value!r}: must be a number > 0")
        if self.retries is not None and (not isinstance(self.retries, int)
                                         or isinstance(self.retries, bool) or self.retries < 0):
            raise ValueError(f"ClientConfig.retries={self.retries!r}: must be an integer >= 0, "
                             f"or None (retry until retry_deadline_s)")
        for name, low in (("retry_backoff_ms", 0), ("retry_backoff_max_ms", 0),
                          ("max_inflight_frames", 1), ("server_timeout_ms", 1),
                          ("append_frame_bytes", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ClientConfig.{name}={value!r}: must be an integer >= {low}")
        if self.retry_backoff_max_ms < self.retry_backoff_ms:
            raise ValueError(
                f"ClientConfig.retry_backoff_max_ms={self.retry_backoff_max_ms} is below "
                f"retry_backoff_ms={self.retry_backoff_ms}")
        files = {name: getattr(self, name)
                 for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")}
        if self.token is not None and (not isinstance(self.token, str)
                                       or not self.token.strip()):
            raise ValueError("ClientConfig.token: must be a non-empty string (a signed token), "
                             "or None")
        if not self.tls and any(files.values()):
            given = ", ".join(n for n, v in files.items() if v)
            raise ValueError(f"ClientConfig: {given} given but tls=False; set tls=True to use "
                             "TLS")
        if self.tls:
            self._check_tls_files()
        if not isinstance(self.max_frame_bytes, int) or not (
                MIN_FRAME_LENGTH <= self.max_frame_bytes <= MAX_FRAME_LENGTH):
            raise ValueError(
                f"ClientConfig.max_frame_bytes={self.max_frame_bytes!r}: must be an integer in "
                f"[{MIN_FRAME_LENGTH}, {MAX_FRAME_LENGTH}] (the protocol's frame limit)")

    def _check_tls_files(self) -> None:
        # The files must exist, cert and key go together, and OpenSSL must accept them: a file
        # it cannot load would otherwise fail every connection as a "TLS handshake failed",
        # retried as if the server were at fault, without naming the file.
        settings = self.tls_settings()
        assert settings is not None  # called with tls=True
        try:
            client_context(settings)
        except ssl.SSLError as exc:
            given = ", ".join(f"{name} {value!r}" for name, value in (
                ("tls_ca_file", self.tls_ca_file), ("tls_cert_file", self.tls_cert_file),
                ("tls_key_file", self.tls_key_file)) if value)
            reason = unusable_file(settings)
            if not reason:
                reason = exc.reason.replace("_", " ").lower() if exc.reason else str(exc)
            raise ValueError(f"ClientConfig: TLS files cannot be used ({given}): {reason}") \
                from exc

    def tls_settings(self) -> TlsConfig | None:
        """The TLS files as a ``TlsConfig`` (None without TLS); ValueError if unusable."""
        if not self.tls:
            return None
        return TlsConfig(cert_file=self.tls_cert_file, key_file=self.tls_key_file,
                         ca_file=self.tls_ca_file)

    def with_token(self, token: str | None) -> ClientConfig:
        """This configuration presenting ``token`` (unchanged when None): what a server uses
        to call other servers as its own principal."""
        if token is None:
            return self
        return dataclasses.replace(self, token=token)

    def with_tls(self, tls: TlsConfig | None) -> ClientConfig:
        """This configuration speaking TLS with ``tls``'s files (unchanged when None): what a
        server uses to call other servers, presenting its own certificate."""
        if tls is None:
            return self
        return dataclasses.replace(self, tls=True, tls_ca_file=tls.ca_file,
                                   tls_cert_file=tls.cert_file, tls_key_file=tls.key_file)


def read_token_file(path: str) -> str:
    """The token kept in the file ``path`` (``--token-file``, the connector's ``tokenFile``),
    without the space around it; ``ValueError`` naming the file (never its content) when it
    cannot be read or is empty."""
    try:
        with open(path, encoding="ascii") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the token file {path!r} does not hold a token (not ASCII)") from None
    if not token:
        raise ValueError(f"the token file {path!r} is empty")
    return token
