"""A small etcd v3 client over etcd's HTTP/JSON gateway, using only the standard library.

The PD cluster needs little of etcd: ranges, puts, deletes, transactions with compares, and
leases (grant, keep-alive, revoke). etcd serves all of them as JSON over HTTP (``POST
/v3/kv/range`` and so on; keys and values base64-encoded; 64-bit numbers as strings), so
this module speaks that directly instead of depending on a gRPC stack.

``EtcdClient`` takes every client endpoint of the etcd cluster and sticks to one until it fails
(a refused connection, a timeout, or a member that answers it has no raft leader), then moves
on to the next, so a dead etcd member costs one failed attempt. When every member failed that
way it goes round them again, after a short pause, for up to ``retry_s``: killing the etcd
leader makes the survivors elect another, and until they have, every member refuses. It is
safe to use from many threads: each thread keeps its own keep-alive HTTP connection per
endpoint. A request that reached no member raises ``EtcdUnavailable``.

A request retried on another member after its answer was lost may have been applied once
already; callers make their writes transactions whose compares fail on a replay.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# etcd's client port when an endpoint names none.
DEFAULT_ETCD_PORT = 2379
DEFAULT_TIMEOUT_S = 2.0
# How long a request keeps going round the members while each fails in a way that passes (an
# election after the etcd leader died takes one to two election timeouts, 1 s each by default).
DEFAULT_RETRY_S = 4.0
# Pause between two rounds, doubling up to the second value.
_ROUND_PAUSE_S = (0.05, 0.5)
# gRPC status codes (the gateway's "code" field) that say this member cannot serve now, so
# another member may: UNAVAILABLE (no leader, stopping), DEADLINE_EXCEEDED (request timed out
# inside raft).
_TRY_ANOTHER_MEMBER = {4, 14}


class EtcdError(Exception):
    """etcd refused a request, or no member could be reached."""


class EtcdUnavailable(EtcdError):
    """No etcd member answered the request."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcd's convention)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def parse_endpoints(endpoints: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` (or a list; ``http://`` prefixes and a missing port allowed) ->
    ``["h1:p1", "h2:p2"]``; ValueError naming a bad entry."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out: list[str] = []
    for raw in items:
        item = str(raw).strip().removeprefix("http://").rstrip("/")
        if not item:
            continue
        if item.startswith("https://"):
            raise ValueError(f"etcd endpoint {raw!r}: TLS to etcd is not supported; give the "
                             "plain-HTTP client URL (host:port)")
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, str(DEFAULT_ETCD_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {raw!r} is not host:port")
        if f"{host}:{port}" not in out:
            out.append(f"{host}:{port}")
    if not out:
        raise ValueError(f"etcd endpoints {endpoints!r}: give at least one host:port")
    return out


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returns it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(_unb64(kv.get("key", "")), _unb64(kv.get("value", "")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("version", 0)), int(kv.get("lease", 0)))


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared with ``value``.

    ``target`` is CREATE, MOD or VERSION (a revision or count; 0 for a key that does not
    exist) or VALUE (bytes); ``result`` is EQUAL, NOT_EQUAL, GREATER or LESS.
    """

    key: bytes
    target: str
    result: str
    value: int | bytes

    _FIELDS = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version",
               "VALUE": "value"}

    def to_json(self) -> dict[str, Any]:
        name = self._FIELDS[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.result,
                name: value}

    @classmethod
    def absent(cls, key: bytes) -> Compare:
        """The key does not exist."""
        return cls(key, "CREATE", "EQUAL", 0)

    @classmethod
    def unchanged(cls, key: bytes, mod_revision: int) -> Compare:
        """The key was last written at ``mod_revision`` (0: it still does not exist)."""
        return cls(key, "MOD", "EQUAL", mod_revision)

    @classmethod
    def created_at(cls, key: bytes, create_revision: int) -> Compare:
        """The key exists and was created at ``create_revision`` (not deleted since)."""
        return cls(key, "CREATE", "EQUAL", create_revision)


@dataclass(frozen=True, slots=True)
class Put:
    """Write ``value`` at ``key`` (attached to ``lease`` when not 0)."""

    key: bytes
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete ``key``; with ``prefix`` every key under it, with ``end`` every key from ``key``
    up to (not including) ``end``."""

    key: bytes
    prefix: bool = False
    end: bytes = b""

    def to_json(self) -> dict[str, Any]:
        body = {"key": _b64(self.key)}
        if self.prefix or self.end:
            body["range_end"] = _b64(self.end or prefix_end(self.key))
        return {"request_delete_range": body}


@dataclass(frozen=True, slots=True)
class Get:
    """Read ``key``, or every key under it with ``prefix`` (inside a transaction)."""

    key: bytes
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_range": _range_body(self.key, self.prefix)}


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    """What a transaction did: whether its compares held, at which revision, and the keys
    its ``Get`` operations read (one list per operation, in order; writes give empty ones)."""

    succeeded: bool
    revision: int
    reads: list[list[KeyValue]] = field(default_factory=list)


def _range_body(key: bytes, prefix: bool, revision: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64(prefix_end(key))
    if revision:
        body["revision"] = str(revision)
    return body


class EtcdClient:
    """Requests to an etcd cluster through any of its client ``endpoints`` (``host:port``)."""

    def __init__(self, endpoints: str | Sequence[str],
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry_s: float = DEFAULT_RETRY_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"etcd timeout_s={timeout_s!r} must be > 0")
        if retry_s < 0:
            raise ValueError(f"etcd retry_s={retry_s!r} must be >= 0")
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._current = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = False
        self._all: list[http.client.HTTPConnection] = []

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)!r})"

    # -- transport -------------------------------------------------------------------------

    def _connection(self, endpoint: str, timeout_s: float) -> http.client.HTTPConnection:
        conns: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault(
            "conns", {})
        conn = conns.get(endpoint)
        if conn is None:
            host, port = endpoint.rsplit(":", 1)
            conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
            conns[endpoint] = conn
            with self._lock:
                self._all.append(conn)
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop(self, endpoint: str) -> None:
        conns = self._local.__dict__.get("conns", {})
        conn = conns.pop(endpoint, None)
        if conn is not None:
            conn.close()

    def _post_one(self, endpoint: str, path: str, payload: bytes,
                  timeout_s: float) -> tuple[int, dict[str, Any]]:
        conn = self._connection(endpoint, timeout_s)
        try:
            conn.request("POST", path, payload, {"Content-Type": "application/json"})
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException):
            self._drop(endpoint)
            raise
        try:
            return response.status, json.loads(body or b"{}")
        except ValueError:
            return response.status, {"message": body[:200].decode("utf-8", "replace")}

    def post(self, path: str, body: dict[str, Any], timeout_s: float | None = None
             ) -> dict[str, Any]:
        """POST ``body`` to ``path`` (``/v3/...``) on the current member, moving to the next
        member on a failure that another member may not have; the decoded answer.

        ``timeout_s`` bounds each attempt and, when given, the whole request too (what a lease
        keep-alive needs); without it the request goes round the members again for up to
        ``retry_s`` while each failed in a way that passes."""
        if self._closed:
            raise EtcdError("the etcd client is closed")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        budget = self.retry_s if timeout_s is None else timeout_s
        payload = json.dumps(body).encode()
        deadline = time.monotonic() + budget
        pause = _ROUND_PAUSE_S[0]
        problems: list[str] = []
        while True:
            answer = self._round(path, payload, timeout, problems)
            if answer is not None:
                return answer
            if self._closed or time.monotonic() + pause >= deadline:
                raise EtcdUnavailable(f"no etcd member answered {path}: {'; '.join(problems)}")
            time.sleep(pause)
            pause = min(pause * 2, _ROUND_PAUSE_S[1])
            problems.append("again")

    def _round(self, path: str, payload: bytes, timeout: float, problems: list[str]
               ) -> dict[str, Any] | None:
        """One try on each member, from the current one; the answer, or None when every
        member failed in a way another try may not (each failure added to ``problems``)."""
        with self._lock:
            start = self._current
        for i in range(len(self.endpoints)):
            index = (start + i) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                status, answer = self._post_one(endpoint, path, payload, timeout)
            except (OSError, http.client.HTTPException) as exc:
                problems.append(f"{endpoint}: {type(exc).__name__}: {exc}")
                continue
            if status == 200:
                if index != start:
                    with self._lock:
                        self._current = index
                    log.info("etcd: now using member %s (%s)", endpoint, "; ".join(problems))
                return answer
            message = answer.get("message") or answer.get("error") or f"HTTP {status}"
            if int(answer.get("code", 0)) in _TRY_ANOTHER_MEMBER or status >= 502:
                problems.append(f"{endpoint}: {message}")
                continue
            raise EtcdError(f"etcd at {endpoint} refused {path}: {message}")
        return None

    def close(self) -> None:
        """Close every connection (idempotent)."""
        self._closed = True
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    # -- keys ------------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        """The key, or None."""
        found, _ = self.range(key)
        return found[0] if found else None

    def range(self, key: bytes, prefix: bool = False, revision: int = 0
              ) -> tuple[list[KeyValue], int]:
        """The key (or every key under a prefix, in key order) and the revision read at."""
        answer = self.post("/v3/kv/range", _range_body(key, prefix, revision))
        kvs = [KeyValue.from_json(kv) for kv in answer.get("kvs", ())]
        return kvs, int(answer.get("header", {}).get("revision", 0))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Write a key unconditionally; the new revision."""
        answer = self.post("/v3/kv/put", Put(key, value, lease).to_json()["request_put"])
        return int(answer.get("header", {}).get("revision", 0))

    def delete(self, key: bytes, prefix: bool = False) -> int:
        """Delete a key (or a prefix); how many keys were deleted."""
        answer = self.post("/v3/kv/deleterange",
                           Delete(key, prefix).to_json()["request_delete_range"])
        return int(answer.get("deleted", 0))

    def txn(self, compare: Sequence[Compare], success: Sequence[Op],
            failure: Sequence[Op] = ()) -> TxnResult:
        """Run ``success`` if every compare holds, else ``failure``, atomically."""
        answer = self.post("/v3/kv/txn", {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure]})
        reads = [[KeyValue.from_json(kv) for kv in r.get("response_range", {}).get("kvs", ())]
                 for r in answer.get("responses", ())]
        return TxnResult(bool(answer.get("succeeded", False)),
                         int(answer.get("header", {}).get("revision", 0)), reads)

    # -- leases ----------------------------------------------------------------------------

    def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds; etcd may raise a short TTL)."""
        answer = self.post("/v3/lease/grant", {"TTL": str(int(ttl_s)), "ID": "0"})
        if answer.get("error"):
            raise EtcdError(f"etcd refused a lease of {ttl_s} s: {answer['error']}")
        return int(answer["ID"]), int(answer.get("TTL", ttl_s))

    def lease_keepalive(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Renew a lease: its TTL in seconds from now, 0 when it has expired."""
        answer = self.post("/v3/lease/keepalive", {"ID": str(lease_id)}, timeout_s)
        return int(answer.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease_id: int) -> None:
        """End a lease now, deleting the keys attached to it."""
        try:
            self.post("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise
