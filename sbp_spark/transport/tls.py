"""TLS for SBP connections, shared by the client and the servers.

``TlsConfig`` names the certificate files and builds the ``ssl.SSLContext`` of either side.
``TlsSocket`` runs TLS over an already connected blocking socket and offers the calls the
client and the server core make on a plain one (``recv_into``, ``sendmsg``, ``send``,
``shutdown``, ``close``...), so they need no second code path.

Why not ``ssl.SSLSocket``: OpenSSL does not allow one connection object to be used by two
threads at once, and SBP connections are full duplex (one thread reads while others send).
``TlsSocket`` keeps the TLS state in an ``ssl.SSLObject`` over memory buffers, changes it only
under a lock, and does the socket I/O outside that lock, so a reader blocked in ``recv`` never
holds up a sender. A second lock keeps the encrypted records in order on the wire.

Mutual TLS: a server given a CA file requires every peer to present a certificate signed by it;
clients verify the server's certificate (against the CA file, else the system's trust store)
and its name (the host of the address they connect to).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview

# Plaintext encrypted per round of sendmsg: bounds the ciphertext held in memory for one send
# (a 16 MiB frame is not encrypted in one piece) while keeping the round count small.
ENCRYPT_PIECE = 256 * 1024
# Ciphertext read from the socket at once.
RECV_PIECE = 256 * 1024
# How long a failed send waits for the reader to decrypt the alert that explains it.
_ALERT_WAIT_S = 0.5
# Longest a TLS handshake may take before the connection is given up.
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0


class TlsError(ConnectionError):
    """The TLS handshake failed (bad or missing certificate, wrong name, not TLS...)."""


@dataclass(frozen=True)
class TlsConfig:
    """Certificate files of one side of a TLS connection (PEM).

    A server needs ``cert_file`` and ``key_file``; with ``ca_file`` it requires client
    certificates signed by that CA (mutual TLS). A client verifies servers against
    ``ca_file`` (else the system's trust store) and presents ``cert_file``/``key_file`` when
    given (needed by servers with mutual TLS).
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if value is None:
                continue
            what = f"TLS {name.replace('_', ' ')} {value!r}"
            if not Path(value).is_file():
                raise ValueError(f"{what} is not a readable file")
            try:  # OpenSSL's own error for a file it may not read names no file
                with open(value, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"{what} is not a readable file ({exc.strerror})") from exc
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("TLS needs both a certificate file and its key file, or neither")

    def server_context(self) -> ssl.SSLContext:
        """The context of a server: its certificate, and client verification under mTLS."""
        if self.cert_file is None or self.key_file is None:
            raise ValueError("a TLS server needs a certificate file and a key file")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        load_cert_chain(ctx, self.cert_file, self.key_file)
        if self.ca_file is not None:
            ctx.load_verify_locations(cafile=self.ca_file)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The context of a client: server verification, and its own certificate if any."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificate and host name
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca_file is not None:
            ctx.load_verify_locations(cafile=self.ca_file)
        else:
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
        if self.cert_file is not None and self.key_file is not None:
            load_cert_chain(ctx, self.cert_file, self.key_file)
        return ctx


def load_cert_chain(ctx: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """``ctx.load_cert_chain``, refusing a key file protected by a passphrase (no setting takes
    one): left to itself, OpenSSL asks for it on the terminal, so a server or a Spark driver
    would wait for typing, and without a terminal it fails with "Invalid argument"."""

    def no_passphrase() -> bytes:
        raise ValueError(f"the TLS key file {key_file!r} is protected by a passphrase, which "
                         f"cannot be given: use an unencrypted key (openssl pkey -in "
                         f"{key_file} -out plain.key) kept readable only by its user")

    ctx.load_cert_chain(cert_file, key_file, password=no_passphrase)


class TlsSocket:
    """A TLS connection over a connected blocking socket; one reading thread, many senders.

    ``reader`` is the socket object the reading thread receives on (a ``dup`` of ``sock`` with
    its own timeout, say); it defaults to ``sock``. Call ``handshake()`` before anything else.
    """

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool,
                 server_hostname: str | None = None, reader: socket.socket | None = None
                 ) -> None:
        self.raw = sock
        self.raw_reader = reader if reader is not None else sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._state = threading.Lock()  # guards _tls and both memory buffers
        self._wire = threading.Lock()  # held while encrypted bytes leave: keeps their order
        # Why the peer ended the session (an alert the reader decrypted), for the senders'
        # errors: with TLS 1.3 a server refuses a client certificate only after the handshake.
        self._ended_by: str | None = None
        self._ended = threading.Event()  # the reader saw the session end (alert or EOF)
        self._eof = False

    # -- handshake -------------------------------------------------------------------------

    def handshake(self, timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> None:
        """Run the TLS handshake; raises ``TlsError`` (or ``TimeoutError``) on failure. The
        whole handshake must end within ``timeout_s``: a peer sending a byte now and then
        does not keep it going (each wait is for what is left of it)."""
        before = self.raw_reader.gettimeout()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                with self._state:
                    try:
                        self._tls.do_handshake()
                        done = True
                    except ssl.SSLWantReadError:
                        done = False
                    except ssl.SSLError as exc:
                        out = self._outgoing.read()
                        self._send_quietly(out)  # the alert tells the peer why
                        raise TlsError(_describe(exc)) from exc
                    out = self._outgoing.read()
                if out:
                    self.raw.sendall(out)
                if done:
                    return
                left = deadline - time.monotonic()
                try:
                    if left <= 0:
                        raise TimeoutError
                    self.raw_reader.settimeout(left)
                    data = self.raw_reader.recv(RECV_PIECE)
                except TimeoutError:
                    raise TimeoutError(f"the TLS handshake did not complete within "
                                       f"{timeout_s:g}s") from None
                if not data:
                    raise TlsError("the peer closed the connection during the handshake (it "
                                   "refused this side's certificate, or does not speak TLS)")
                with self._state:
                    self._incoming.write(data)
        finally:
            self.raw_reader.settimeout(before)

    def _send_quietly(self, data: bytes) -> None:
        if data:
            try:
                self.raw.send(data, socket.MSG_DONTWAIT)
            except OSError:
                pass  # the connection fails anyway: the alert was a courtesy

    @property
    def version(self) -> str | None:
        return self._tls.version()

    def getpeercert(self) -> dict | None:
        """The peer's verified certificate (a dict), if it presented one."""
        return self._tls.getpeercert()

    # -- receiving (one thread) ------------------------------------------------------------

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0) -> int:
        """Decrypt into ``buffer`` (up to ``nbytes``); 0 at the end of the connection."""
        view = memoryview(buffer).cast("B")
        want = nbytes or view.nbytes
        while True:
            got = 0
            with self._state:
                try:
                    while got < want:
                        # With a buffer, read() returns the count (typeshed says bytes).
                        n = cast(int, self._tls.read(want - got, view[got:want]))
                        if n == 0:
                            break
                        got += n
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    self._eof = True
                    self._ended.set()
                except ssl.SSLError as exc:
                    self._ended_by = _describe(exc)
                    self._ended.set()
                    raise
                pending = self._outgoing.pending
            if pending:
                self._flush_if_free()  # e.g. an answer to a key update
            if got or self._eof:
                return got
            data = self.raw_reader.recv(RECV_PIECE)
            if not data:
                self._ended.set()
                return 0
            with self._state:
                self._incoming.write(data)

    def _flush_if_free(self) -> None:
        # The reader must never wait behind a sender that is blocked on a full socket: if a
        # sender holds the wire, it (or the next one) sends these bytes after its own.
        if self._wire.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._wire.release()

    # -- sending (any thread) --------------------------------------------------------------

    def _drain(self) -> None:
        """Send what is encrypted but not yet sent; call holding ``_wire``."""
        with self._state:
            data = self._outgoing.read()
        if not data:
            return
        try:
            self.raw.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            # The peer closed, most likely right after an alert saying why (a refused client
            # certificate): give the reader a moment to decrypt it, and report that instead.
            if self._ended.wait(_ALERT_WAIT_S) and self._ended_by is not None:
                raise TlsError(f"the peer ended the TLS session: {self._ended_by}") from exc
            raise

    def _encrypt(self, data: Buffer) -> None:
        try:
            with self._state:
                self._tls.write(data)
        except ssl.SSLError as exc:
            if self._ended_by is not None:
                raise TlsError(f"the peer ended the TLS session: {self._ended_by}") from exc
            raise

    def sendmsg(self, buffers: Sequence[Buffer], *_ancillary: object) -> int:
        """Encrypt and send every buffer (all of it, blocking); returns the bytes taken."""
        total = 0
        with self._wire:
            piece = 0
            for buf in buffers:
                view = memoryview(buf).cast("B")
                for start in range(0, view.nbytes, ENCRYPT_PIECE):
                    chunk = view[start:start + ENCRYPT_PIECE]
                    self._encrypt(chunk)
                    piece += chunk.nbytes
                    total += chunk.nbytes
                    if piece >= ENCRYPT_PIECE:
                        self._drain()
                        piece = 0
            self._drain()
        return total

    def sendall(self, data: Buffer) -> None:
        self.sendmsg([data])

    def send(self, data: Buffer, flags: int = 0) -> int:
        """Send ``data`` whole. With MSG_DONTWAIT, raise ``BlockingIOError`` instead of waiting
        when another thread is sending or the socket has no room: once encrypted, bytes must
        go out (the next record depends on them), so the check comes first."""
        if not flags & socket.MSG_DONTWAIT:
            return self.sendmsg([data])
        if not self._wire.acquire(blocking=False):
            raise BlockingIOError("another thread is sending on this TLS connection")
        try:
            poller = select.poll()
            poller.register(self.raw.fileno(), select.POLLOUT)
            if not poller.poll(0):
                raise BlockingIOError("the socket's send buffer is full")
            self._encrypt(data)
            self._drain()
        finally:
            self._wire.release()
        return memoryview(data).nbytes

    def sendfile_region(self, fd: int, offset: int, length: int) -> None:
        """Send ``length`` bytes of the open file ``fd`` from ``offset`` (read, encrypted:
        the kernel's sendfile cannot encrypt)."""
        while length > 0:
            chunk = os.pread(fd, min(length, ENCRYPT_PIECE), offset)
            if not chunk:
                raise OSError(f"file ended {length} bytes before the region's end")
            self.sendmsg([chunk])
            offset += len(chunk)
            length -= len(chunk)

    # -- the socket calls the rest of the code makes ---------------------------------------

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()
        if self.raw_reader is not self.raw:
            self.raw_reader.close()

    def fileno(self) -> int:
        return self.raw.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self.raw.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self.raw.gettimeout()

    def setsockopt(self, *args) -> None:
        self.raw.setsockopt(*args)

    def getpeername(self):
        return self.raw.getpeername()

    def getsockname(self):
        return self.raw.getsockname()


def _describe(exc: ssl.SSLError) -> str:
    """Why a handshake failed, in words (the certificate check says what did not match)."""
    reason = (exc.reason or str(exc)).replace("_", " ").lower()
    detail = getattr(exc, "verify_message", None)
    return f"{reason}: {detail.rstrip('.')}" if detail else reason


def certificate_not_after(path: str) -> datetime.datetime | None:
    """When the first certificate in the PEM file ``path`` stops being valid (UTC), or None
    when the file cannot be read as one. For error messages: ``ssl`` decodes only the
    certificates of a connection, so this reads the DER fields itself."""
    try:
        der = ssl.PEM_cert_to_DER_cert(Path(path).read_text())
        _, start, _ = _der_item(der, 0)  # Certificate
        _, pos, _ = _der_item(der, start)  # tbsCertificate
        if der[pos] == 0xA0:  # [0] version
            pos = _der_item(der, pos)[2]
        for _ in range(3):  # serialNumber, signature, issuer
            pos = _der_item(der, pos)[2]
        _, validity, _ = _der_item(der, pos)
        not_before_end = _der_item(der, validity)[2]
        tag, start, end = _der_item(der, not_before_end)
        text = der[start:end].decode("ascii")
        fmt = "%y%m%d%H%M%SZ" if tag == 0x17 else "%Y%m%d%H%M%SZ"  # UTCTime, GeneralizedTime
        return datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.timezone.utc)
    except (OSError, ValueError, IndexError):
        return None


def _der_item(der: bytes, pos: int) -> tuple[int, int, int]:
    """The tag of the DER item at ``pos``, and where its contents start and end."""
    tag, size = der[pos], der[pos + 1]
    start = pos + 2
    if size & 0x80:
        count = size & 0x7F
        size = int.from_bytes(der[start:start + count], "big")
        start += count
    if start + size > len(der):
        raise ValueError("truncated DER")
    return tag, start, start + size


def unusable_file(config: TlsConfig) -> str:
    """Which of ``config``'s files OpenSSL cannot use, and why, in words ('' when it cannot
    tell): its own errors ("PEM lib") name no file."""

    def holds_certificate(path: str) -> bool:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
        except ssl.SSLError:
            return False
        return True

    # Files are checked when the settings are made; a renewal may have removed one since.
    for what, path in (("CA file", config.ca_file), ("certificate file", config.cert_file),
                       ("key file", config.key_file)):
        if path is not None and not os.path.isfile(path):
            return f"the {what} {path!r} is missing"
        if path is not None and not os.access(path, os.R_OK):
            return f"the {what} {path!r} is not readable"
    if config.ca_file is not None and not holds_certificate(config.ca_file):
        return f"the CA file {config.ca_file!r} holds no PEM certificate"
    cert, key = config.cert_file, config.key_file
    if cert is None or key is None:
        return ""
    if not holds_certificate(cert):
        return f"the certificate file {cert!r} holds no PEM certificate"
    try:
        load_cert_chain(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert, key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            return f"the key file {key!r} is not the private key of the certificate {cert!r}"
        return f"the key file {key!r} holds no PEM private key"
    return ""


def peer_call_problem(config: TlsConfig, host: str | None) -> str:
    """Why two servers with ``config``'s files could not call each other, in words ('' when
    they can): the servers present their own certificate and verify the other's against the
    CA file (the system's trust store without one), so a certificate that fails there (no
    clientAuth or serverAuth key usage, signed by another CA, expired, not naming ``host``, the
    host peers dial; None: names are not checked) leaves a cluster that cannot form, its
    servers retrying forever. The handshake runs in memory, between this process's contexts.
    """
    try:
        server = config.server_context()
        client = config.client_context()
    except ssl.SSLError as exc:
        return f"TLS files cannot be used: {unusable_file(config) or _describe(exc)}"
    if host is None:
        client.check_hostname = False
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    calling = client.wrap_bio(to_client, to_server, server_side=False, server_hostname=host)
    called = server.wrap_bio(to_server, to_client, server_side=True)
    done = {"calling": False, "called": False}
    for _ in range(8):  # a TLS 1.2 or 1.3 handshake takes at most 3 flights each way
        for side, tls in (("calling", calling), ("called", called)):
            if done[side]:
                continue
            try:
                tls.do_handshake()
                done[side] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError as exc:
                return _peer_call_hint(config, side, host, exc)
        if all(done.values()):
            return ""
    return "the TLS handshake between two servers did not complete"


def _peer_call_hint(config: TlsConfig, side: str, host: str | None,
                    exc: ssl.SSLError) -> str:
    why = _describe(exc)
    code = getattr(exc, "verify_code", None)
    if code == _X509_EXPIRED and config.cert_file is not None:
        end = certificate_not_after(config.cert_file)
        until = f" (not valid after {end:%Y-%m-%d %H:%M:%S} UTC)" if end is not None else ""
        return f"{why}{until}: renew it, replacing the file"
    if side == "called":  # the server refused the certificate its peer presented
        if code == _X509_INVALID_PURPOSE:
            return (f"{why}: with a CA file the servers present their own certificate when "
                    f"they call each other, so it needs the clientAuth extended key usage "
                    f"(besides serverAuth)")
        return f"a server refuses this certificate when a peer presents it: {why}"
    if code == _X509_INVALID_PURPOSE:
        return f"{why}: a server's certificate needs the serverAuth extended key usage"
    if code == _X509_HOSTNAME_MISMATCH or code == _X509_IP_MISMATCH:
        return (f"{why}: the other servers call this one at {host}, which its certificate "
                f"must name (subjectAltName), or advertise a name the certificate holds")
    if config.ca_file is None and code in _X509_UNTRUSTED:
        return (f"{why}: without a CA file the servers check each other's certificates "
                f"against the system's trust store, which does not trust this one; give the "
                f"CA file that signed it")
    if config.ca_file is not None and code in _X509_UNTRUSTED:
        return f"{why}: the certificate is not signed by a CA in {config.ca_file!r}"
    return f"a server refuses this certificate when a peer presents it: {why}"


# OpenSSL's X509_V_ERR_* codes that peer_call_problem explains.
_X509_EXPIRED = 10
_X509_INVALID_PURPOSE = 26
_X509_HOSTNAME_MISMATCH = 62
_X509_IP_MISMATCH = 64
_X509_UNTRUSTED = frozenset({2, 18, 19, 20, 21})  # no issuer, self-signed, untrusted chain


def _file_versions(config: TlsConfig) -> tuple[tuple[int, int, int] | None, ...]:
    """What identifies the current contents of ``config``'s files (None for a file missing
    now: building the context then says so)."""
    versions: list[tuple[int, int, int] | None] = []
    for path in (config.cert_file, config.key_file, config.ca_file):
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        versions.append((st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else None)
    return tuple(versions)


@functools.lru_cache(maxsize=32)
def _context(config: TlsConfig, server_side: bool, versions: tuple) -> ssl.SSLContext:
    """The context of one side, built once per ``versions`` of ``config``'s files."""
    return config.server_context() if server_side else config.client_context()


def client_context(config: TlsConfig) -> ssl.SSLContext:
    """The client context of ``config``, built once per version of its files: certificates
    are renewed by replacing their files, and a process that keeps running (a Spark driver,
    a server calling its peers) must present and trust the new ones on its next connection.
    Costs a stat of each file per new connection."""
    return _context(config, False, _file_versions(config))


class ServingContext:
    """The context a TLS server gives each new connection, following renewals of its files
    (replaced under the same names) as ``client_context`` does for clients: a stat of each
    file per new connection, a context built once per version of them. Connections already
    open keep the session they made.

    A version that cannot be loaded (a key that is not the certificate's, a file half
    written or missing) does not stop the server: new connections keep the last context that
    loaded, and the problem is logged once for that version, naming the file; the next
    version that loads is used. ``name`` names the server in that log line. Files unusable
    from the start raise ``ValueError`` here, naming the file."""

    def __init__(self, config: TlsConfig, name: str) -> None:
        self.config = config
        self.name = name
        self._lock = threading.Lock()
        versions = _file_versions(config)
        try:
            self._context = _context(config, True, versions)
        except ssl.SSLError as exc:
            raise ValueError(f"{name}: TLS files cannot be used: "
                             f"{_why_unusable(config, exc)}") from exc
        self._versions = versions  # those of the files self._context was built from
        self._refused: tuple | None = None  # a version that did not load (logged once)

    def current(self) -> ssl.SSLContext:
        """The context for a connection accepted now."""
        versions = _file_versions(self.config)
        with self._lock:
            if versions == self._versions or versions == self._refused:
                return self._context
            try:
                context = _context(self.config, True, versions)
            except (ssl.SSLError, OSError, ValueError) as exc:
                self._refused = versions
                why = _why_unusable(self.config, exc)
                log.error("%s: the renewed TLS files cannot be used: %s; new connections "
                          "still get the certificate loaded before, until the files are "
                          "replaced again", self.name, why)
                return self._context
            self._context, self._versions, self._refused = context, versions, None
        log.info("%s: serving the renewed TLS certificate %s to new connections", self.name,
                 self.config.cert_file)
        return context


def _why_unusable(config: TlsConfig, exc: Exception) -> str:
    """Why ``config``'s files failed to load with ``exc``, naming the file when it can."""
    try:
        why = unusable_file(config)
    except (OSError, ValueError) as again:  # a passphrase, a file gone meanwhile
        return str(again)
    return why or (_describe(exc) if isinstance(exc, ssl.SSLError) else str(exc))


def wrap_client(sock: socket.socket, config: TlsConfig, host: str, timeout_s: float,
                reader: socket.socket | None = None) -> TlsSocket:
    """TLS over a socket connected to ``host`` (whose name the server's certificate must
    carry); returns once the handshake is done. Raises ``TlsError`` or ``OSError``."""
    tls = TlsSocket(sock, client_context(config), server_side=False, server_hostname=host,
                    reader=reader)
    tls.handshake(timeout_s)
    return tls
