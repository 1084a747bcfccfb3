"""Connections kept open and shared, one per server address, for the life of the process.

Spark reuses its Python workers between tasks, so a module-level pool (``get_pool()``) lets one
task's connections serve the next. Connections that failed, went idle, received GOAWAY or left
a request unanswered (a timeout with nothing received since) are replaced on the next ``get``;
the pool closes what is left when the interpreter exits.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import threading
import time

from sbp_spark.protocol.errors import TlsHandshakeTimeoutError, TransportError

from .config import ClientConfig
from .connection import Connection, parse_address


def _key(address: str, config: ClientConfig) -> str:
    """Pool key: the address, and the identity the connection was made with (its TLS files,
    its token), so a connection authenticated as one principal never serves a caller with
    another, or without one. The token enters as a digest: a key may be printed."""
    key = address
    if config.tls:
        key = (f"{key} tls {config.tls_ca_file} {config.tls_cert_file} "
               f"{config.tls_key_file}")
    if config.token is not None:
        key = f"{key} token {_digest(config.token)}"
    return key


@functools.lru_cache(maxsize=64)
def _digest(token: str) -> str:
    """A token's digest (pool keys are made on every request: computed once per token)."""
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class ConnectionPool:
    """Thread-safe map from ``host:port`` (and TLS identity) to one open ``Connection``."""

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config if config is not None else ClientConfig()
        self._lock = threading.Lock()
        self._connections: dict[str, Connection] = {}
        self._connecting: dict[str, threading.Lock] = {}
        # Addresses whose TLS handshake timed out: until when they are not dialled again, and
        # that error (see ``_connect``).
        self._silent: dict[str, tuple[float, TlsHandshakeTimeoutError]] = {}
        self._closed = False

    def get(self, address: str, config: ClientConfig | None = None) -> Connection:
        """An open connection to ``address``, made now if none is usable.

        ``config`` applies only when a new connection is made (connect timeout and so on),
        except its TLS settings and token: connections made with others are not shared.
        """
        config = config if config is not None else self.config
        key = _key(address, config)
        conn = self._connections.get(key)
        if conn is not None and conn.usable and not conn.unanswered:
            return conn
        parse_address(address)  # a bad address fails here, with a message naming it
        with self._lock:
            if self._closed:
                raise _pool_closed(address)
            gate = self._connecting.setdefault(key, threading.Lock())
        # One connect per address at a time; other addresses are not held up meanwhile.
        with gate:
            conn = self._connections.get(key)
            if conn is not None and conn.usable:
                if not conn.unanswered:
                    return conn
                # Its last request timed out and nothing came since: it may be dead without
                # knowing it. Retries go out on a new connection; it finishes what is in
                # flight on it and closes.
                conn.retire()
            fresh = self._connect(key, address, config)
            with self._lock:
                if self._closed:
                    fresh.close()
                    raise _pool_closed(address)
                # The old connection (if any) is closed or draining after GOAWAY: requests
                # still in flight on it finish, and it closes itself afterwards.
                self._connections[key] = fresh
            return fresh

    def _connect(self, key: str, address: str, config: ClientConfig) -> Connection:
        """A new connection (call holding the key's gate). A server that accepted a connection
        but did not answer its TLS handshake within the connect timeout (stopped, hung, or not
        an SBP server with TLS) is not dialled again for that long: each retry would wait the
        whole timeout again, and retries multiplied it (5 s became 31 s). Its error is raised
        again at once, still retriable: the caller's retries move on (another PD node, a new
        placement) or run out, within about one connect timeout plus their backoff."""
        silent = self._silent.get(key)
        if silent is not None:
            until, error = silent
            if time.monotonic() < until:
                raise TlsHandshakeTimeoutError(
                    f"{error}; retries within {config.connect_timeout_s:g}s of that fail at "
                    f"once, without dialling again")
            del self._silent[key]
        try:
            return Connection(address, config)
        except TlsHandshakeTimeoutError as exc:
            self._silent[key] = (time.monotonic() + config.connect_timeout_s, exc)
            raise

    def discard(self, conn: Connection) -> None:
        """Close ``conn`` and forget it, so the next ``get`` reconnects."""
        key = _key(conn.address, conn.config)
        with self._lock:
            if self._connections.get(key) is conn:
                del self._connections[key]
        conn.close()

    def connections(self) -> dict[str, Connection]:
        """A snapshot of the pooled connections by address."""
        with self._lock:
            return {conn.address: conn for conn in self._connections.values()}

    def close(self) -> None:
        """Close every pooled connection; the pool refuses new ones afterwards."""
        with self._lock:
            self._closed = True
            conns = list(self._connections.values())
            self._connections.clear()
        for conn in conns:
            conn.close()

    def __enter__(self) -> ConnectionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _forget_after_fork(self) -> None:
        # A forked child shares the parent's sockets but has no reader threads: drop them
        # without shutting the sockets down (that would cut the parent's connections too).
        for conn in self._connections.values():
            conn._close_fds_after_fork()
        self._connections.clear()
        self._connecting.clear()
        self._silent.clear()
        self._lock = threading.Lock()


def _pool_closed(address: str) -> TransportError:
    """The error for a connection asked of a closed pool: final, since no retry can get one
    (the pool stays closed)."""
    error = TransportError(
        f"connection pool is closed (ConnectionPool.close(), the end of its with-block, or "
        f"close_pool() for the process-wide one): cannot connect to {address} through it; "
        f"use a client with an open pool")
    error.retriable = False
    return error


_POOL: ConnectionPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool() -> ConnectionPool:
    """The process-wide connection pool (made on first use, closed at interpreter exit)."""
    global _POOL
    pool = _POOL
    if pool is not None:
        return pool
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ConnectionPool()
        return _POOL


def close_pool() -> None:
    """Close the process-wide pool; the next ``get_pool()`` makes a new one."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        pool.close()


def _after_fork_in_child() -> None:
    global _POOL, _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    pool, _POOL = _POOL, None
    if pool is not None:
        pool._forget_after_fork()


atexit.register(close_pool)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
