"""The PD's metadata in etcd: the store a PD cluster shares (``sbp pd --etcd``).

Keys live under one prefix (default ``/sbp/``), one JSON value per record, zero-padded numbers
so that key order is numeric order::

    ids/stream                       the highest stream id ever used
    ids/server                       the highest server id ever issued
    streams/<stream_id>              replica_nums, retention, start (trim point), deleted, name
    names/<name>                     the id of the live stream of that name
    ranges/<stream_id>/<range_index> offsets and replicas of one range
    servers/<server_id>              host, address, last heartbeat, last metrics
    acl                              the permissions granted and their version

Every change is one etcd transaction, built like a software transaction: the change reads what
it needs at one revision, then commits its writes only if none of the keys it read changed
since (``Compare.unchanged`` on each), and tries again from the start if one did. A create that
names its stream reads the name's key, absent, so its commit carries the compare that the key
still does not exist: of two PDs creating one name at once, one commit fails, and its retry
finds the name taken. Every change
to a stream's ranges also rewrites the stream's key, so a reader of the ranges compares that
one key and still notices a range added or removed meanwhile. A ``Fence`` (the PD leader's
lease, see ``leader.py``) adds its own compare to every commit: a node that is no longer the
leader cannot change anything, and learns so as ``PdNotLeaderError``.

Refusals are the same as the SQLite store's (``meta``); etcd out of reach is the retriable
REQUEST_TIMEOUT naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from sbp_spark.protocol.errors import InvalidRequestError, RequestTimeoutError, ServerError

from ..auth.acl import AclEntry
from ..etcd_client import Compare, Delete, EtcdClient, EtcdError, Get, KeyValue, Op, Put
from .meta import (
    RangeHolder,
    RangeMeta,
    RetentionHold,
    ServerMeta,
    StreamMeta,
    check_asked_stream_id,
    check_new_stream,
    check_stream_name,
    check_trim,
    name_missing,
    name_taken,
    new_range,
    next_range,
    not_registered,
    range_missing,
    sealed_range,
    stream_missing,
    stream_taken,
    trimmed_ranges,
    unknown_server,
)
from .meta import now_ms as _now_ms

T = TypeVar("T")

DEFAULT_PREFIX = "/sbp/"
# Attempts of one change that keeps meeting concurrent changes of the keys it read.
_MAX_ATTEMPTS = 32


class Fence(Protocol):
    """What lets a node write: a compare every commit carries, and the error when it fails."""

    key: bytes

    def compare(self) -> Compare:
        """The compare that holds while this node may write (raises when it may not)."""

    def holds(self, current: list[KeyValue]) -> bool:
        """Whether ``current`` (the fence key as a failed commit read it) is still ours."""

    def lost(self) -> ServerError:
        """The error a write fenced off raises."""


class _Tx:
    """One attempt of a change: reads at one revision, remembers what it read, buffers
    writes."""

    def __init__(self, store: EtcdStore) -> None:
        self.store = store
        self.revision = 0
        self.seen: dict[bytes, int] = {}  # key -> mod_revision read (0: absent)
        self._values: dict[bytes, list[KeyValue]] = {}  # keys read, for a second look
        self.ops: dict[bytes, Op] = {}

    def read(self, key: bytes, prefix: bool = False) -> list[KeyValue]:
        if not prefix and key in self._values:
            return self._values[key]
        try:
            kvs, revision = self.store.etcd.range(key, prefix, self.revision)
        except EtcdError as exc:
            raise self.store.unreachable(exc) from exc
        self.revision = self.revision or revision
        if not prefix:
            self.seen[key] = kvs[0].mod_revision if kvs else 0
            self._values[key] = kvs
        return kvs

    def get(self, key: bytes) -> Any:
        """The JSON value of ``key`` (None when absent)."""
        kvs = self.read(key)
        return json.loads(kvs[0].value) if kvs else None

    def put(self, key: bytes, value: Any) -> None:
        self.ops[key] = Put(key, json.dumps(value, sort_keys=True).encode())

    def delete(self, key: bytes, end: bytes = b"") -> None:
        self.ops[key] = Delete(key, end=end)

    def commit(self, fence: Fence | None) -> bool:
        """Write, if nothing read changed; False when something did (try again)."""
        if not self.ops:
            return True
        compares = [Compare.unchanged(k, rev) for k, rev in self.seen.items()]
        failure: list[Op] = []
        if fence is not None:
            compares.append(fence.compare())
            failure.append(Get(fence.key))
        try:
            result = self.store.etcd.txn(compares, list(self.ops.values()), failure)
        except EtcdError as exc:
            raise self.store.unreachable(exc) from exc
        if result.succeeded:
            return True
        if fence is not None and not fence.holds(result.reads[0]):
            raise fence.lost()
        return False


class EtcdStore:
    """The PD's metadata in etcd at ``prefix``; writes carry ``fence`` when given."""

    def __init__(self, etcd: EtcdClient, prefix: str = DEFAULT_PREFIX,
                 fence: Fence | None = None) -> None:
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"etcd key prefix {prefix!r} must start and end with '/'")
        self.etcd = etcd
        self.prefix = prefix.encode()
        self.fence = fence

    def close(self) -> None:
        """Nothing to release: the etcd client belongs to the caller."""

    def unreachable(self, exc: EtcdError) -> RequestTimeoutError:
        return RequestTimeoutError(f"the PD's metadata store (etcd) did not answer: {exc}")

    # -- keys and values -------------------------------------------------------------------

    def _key(self, *parts: str) -> bytes:
        return self.prefix + "/".join(parts).encode()

    def _stream_key(self, stream_id: int) -> bytes:
        return self._key("streams", f"{stream_id:020d}")

    def _ranges_key(self, stream_id: int) -> bytes:
        return self._key("ranges", f"{stream_id:020d}") + b"/"

    def _range_key(self, stream_id: int, range_index: int) -> bytes:
        return self._ranges_key(stream_id) + f"{range_index:010d}".encode()

    def _server_key(self, server_id: int) -> bytes:
        return self._key("servers", f"{server_id:020d}")

    def _name_key(self, name: str) -> bytes:
        return self._key("names", name)  # names have no '/' (protocol/names.py)

    @staticmethod
    def _stream(stream_id: int, v: dict[str, Any]) -> StreamMeta:
        return StreamMeta(stream_id, v["replica_nums"], v["retention_period_ms"],
                          v["start_offset"], v["deleted"], v.get("name", ""),
                          v.get("retain_for_consumers", False), v.get("retain_cap_bytes", -1),
                          v.get("retain_cap_ms", -1))

    @staticmethod
    def _stream_value(s: StreamMeta, created_ms: int) -> dict[str, Any]:
        value: dict[str, Any] = {
            "replica_nums": s.replica_nums, "retention_period_ms": s.retention_period_ms,
            "start_offset": s.start_offset, "deleted": s.deleted, "created_ms": created_ms}
        if s.name:
            value["name"] = s.name
        if s.retain_for_consumers:
            value.update(retain_for_consumers=True, retain_cap_bytes=s.retain_cap_bytes,
                         retain_cap_ms=s.retain_cap_ms)
        return value

    @staticmethod
    def _range(kv: KeyValue) -> RangeMeta:
        v = json.loads(kv.value)
        stream_id, range_index = (int(p) for p in kv.key.rsplit(b"/", 2)[1:])
        return RangeMeta(stream_id, range_index, v["start_offset"], v["end_offset"],
                         v["next_offset"],
                         tuple(RangeHolder(sid, bool(p)) for sid, p in v["replicas"]),
                         v["base_start_offset"])

    def _put_range(self, tx: _Tx, rng: RangeMeta) -> None:
        tx.put(self._range_key(rng.stream_id, rng.range_index), {
            "base_start_offset": rng.base_start_offset, "start_offset": rng.start_offset,
            "end_offset": rng.end_offset, "next_offset": rng.next_offset,
            "replicas": [[r.server_id, int(r.is_primary)] for r in rng.holders]})

    @staticmethod
    def _server(server_id: int, v: dict[str, Any]) -> ServerMeta:
        return ServerMeta(server_id, v["host"], v["advertise_addr"], v["last_heartbeat_ms"],
                          dict(v["metrics"]), v["metrics_ms"])

    # -- changes ---------------------------------------------------------------------------

    def _change(self, fn: Callable[[_Tx], T]) -> T:
        """Run ``fn`` against a fresh transaction until its commit goes through."""
        for _ in range(_MAX_ATTEMPTS):
            tx = _Tx(self)
            result = fn(tx)
            if tx.commit(self.fence):
                return result
        raise RequestTimeoutError(
            f"a metadata change met {_MAX_ATTEMPTS} concurrent changes of the same keys in a "
            "row; try again")

    def _read(self, fn: Callable[[_Tx], T]) -> T:
        return fn(_Tx(self))

    def transact(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn`` on a transaction (``get``, ``read``, ``put``, ``delete`` of keys under
        ``key(...)``) until its commit, fenced, goes through: for records kept beside this
        store's (``etcd_consumers.py``)."""
        return self._change(fn)

    def snapshot(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn`` on a transaction that only reads, at one revision."""
        return self._read(fn)

    def key(self, *parts: str) -> bytes:
        """The etcd key of ``parts`` under this store's prefix."""
        return self._key(*parts)

    def _live_stream(self, tx: _Tx, stream_id: int) -> StreamMeta:
        value = tx.get(self._stream_key(stream_id))
        if value is None or value["deleted"]:
            raise stream_missing(stream_id, value is not None)
        return self._stream(stream_id, value)

    def _save_stream(self, tx: _Tx, stream: StreamMeta) -> None:
        """Write ``stream`` (read by this change before): a change of its ranges writes it
        too, unchanged or not, so that readers of the ranges notice."""
        old = tx.get(self._stream_key(stream.stream_id))
        assert old is not None
        tx.put(self._stream_key(stream.stream_id), self._stream_value(stream, old["created_ms"]))

    def _stream_ranges(self, tx: _Tx, stream_id: int) -> list[RangeMeta]:
        return [self._range(kv) for kv in tx.read(self._ranges_key(stream_id), prefix=True)]

    # -- streams ---------------------------------------------------------------------------

    def create_stream(self, replica_nums: int, retention_period_ms: int,
                      servers: Sequence[int], stream_id: int | None = None,
                      name: str = "") -> tuple[StreamMeta, RangeMeta]:
        """As ``PdStore.create_stream``: the stream and its open range 0 on ``servers``."""
        check_new_stream(replica_nums, servers, stream_id, name)

        def change(tx: _Tx) -> tuple[StreamMeta, RangeMeta]:
            counter = self._key("ids", "stream")
            highest = tx.get(counter) or 0
            sid = highest + 1 if stream_id is None else stream_id
            existing = tx.get(self._stream_key(sid))
            if existing is not None:
                raise stream_taken(sid, existing["deleted"])
            if name:
                holder = tx.get(self._name_key(name))
                if holder is not None:
                    raise name_taken(name, holder)
                tx.put(self._name_key(name), sid)
            stream = StreamMeta(sid, replica_nums, retention_period_ms, name=name)
            rng = new_range(sid, 0, 0, servers)
            tx.put(counter, max(highest, sid))
            tx.put(self._stream_key(sid), self._stream_value(stream, _now_ms()))
            self._put_range(tx, rng)
            return stream, rng

        return self._change(change)

    def check_stream_id_free(self, stream_id: int) -> None:
        """As ``PdStore.check_stream_id_free``."""
        check_asked_stream_id(stream_id)
        existing = self._read(lambda tx: tx.get(self._stream_key(stream_id)))
        if existing is not None:
            raise stream_taken(stream_id, existing["deleted"])

    def check_name_free(self, name: str) -> None:
        """As ``PdStore.check_name_free``."""
        check_stream_name(name)
        holder = self._read(lambda tx: tx.get(self._name_key(name)))
        if holder is not None:
            raise name_taken(name, holder)

    def get_stream(self, stream_id: int) -> StreamMeta:
        return self._read(lambda tx: self._live_stream(tx, stream_id))

    def stream_named(self, name: str) -> StreamMeta:
        """The live stream named ``name``, or StreamNotFoundError."""
        def read(tx: _Tx) -> StreamMeta:
            holder = tx.get(self._name_key(name))
            if holder is None:
                raise name_missing(name)
            stream = self._live_stream(tx, holder)
            if stream.name != name:  # not written by this store: a damaged key
                raise name_missing(name)
            return stream

        return self._read(read)

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]:
        """All streams in id order."""
        def read(tx: _Tx) -> list[StreamMeta]:
            found = [self._stream(int(kv.key.rsplit(b"/", 1)[1]), json.loads(kv.value))
                     for kv in tx.read(self._key("streams") + b"/", prefix=True)]
            return [s for s in found if include_deleted or not s.deleted]

        return self._read(read)

    def update_stream(self, stream_id: int, replica_nums: int,
                      retention_period_ms: int, hold: RetentionHold | None = None
                      ) -> StreamMeta:
        def change(tx: _Tx) -> StreamMeta:
            stream = replace(self._live_stream(tx, stream_id), replica_nums=replica_nums,
                             retention_period_ms=retention_period_ms)
            if hold is not None:
                stream = replace(stream, retain_for_consumers=hold.retain_for_consumers,
                                 retain_cap_bytes=hold.retain_cap_bytes,
                                 retain_cap_ms=hold.retain_cap_ms)
            self._save_stream(tx, stream)
            return stream

        return self._change(change)

    def delete_stream(self, stream_id: int) -> tuple[StreamMeta, list[RangeMeta]]:
        """Mark the stream deleted and drop its ranges; returns it and the ranges it had."""
        def change(tx: _Tx) -> tuple[StreamMeta, list[RangeMeta]]:
            stream = replace(self._live_stream(tx, stream_id), deleted=True)
            ranges = self._stream_ranges(tx, stream_id)
            self._save_stream(tx, stream)
            tx.ops[self._ranges_key(stream_id)] = Delete(self._ranges_key(stream_id), True)
            if stream.name:  # a deleted stream gives its name up
                tx.delete(self._name_key(stream.name))
            return stream, ranges

        return self._change(change)

    def trim_stream(self, stream_id: int, trim_offset: int,
                    end_offset: int | None = None) -> tuple[StreamMeta, RangeMeta]:
        """As ``PdStore.trim_stream``: the stream and its first range after the trim."""
        def change(tx: _Tx) -> tuple[StreamMeta, RangeMeta]:
            stream = self._live_stream(tx, stream_id)
            ranges = self._stream_ranges(tx, stream_id)
            check_trim(stream_id, trim_offset, ranges[-1], end_offset)
            if trim_offset <= stream.start_offset:
                return stream, ranges[0]
            dropped, changed = trimmed_ranges(ranges, trim_offset)
            if dropped:  # a run from the first range
                tx.delete(self._range_key(stream_id, dropped[0].range_index),
                          self._range_key(stream_id, dropped[-1].range_index + 1))
            for rng in changed:
                self._put_range(tx, rng)
            stream = replace(stream, start_offset=trim_offset)
            self._save_stream(tx, stream)
            kept = {r.range_index: r for r in ranges if r not in dropped}
            kept.update((r.range_index, r) for r in changed)
            return stream, kept[min(kept)]

        return self._change(change)

    # -- ranges ----------------------------------------------------------------------------

    def list_ranges(self, stream_id: int) -> list[RangeMeta]:
        """Every range of a live stream in index order (StreamNotFoundError otherwise)."""
        def read(tx: _Tx) -> list[RangeMeta]:
            self._live_stream(tx, stream_id)
            return self._stream_ranges(tx, stream_id)

        return self._read(read)

    def _all_ranges(self) -> list[RangeMeta]:
        # Ranges of deleted streams are deleted with them: every range here is live.
        return self._read(lambda tx: [self._range(kv) for kv in tx.read(
            self._key("ranges") + b"/", prefix=True)])

    def ranges_on_server(self, server_id: int) -> list[RangeMeta]:
        """Every range (open or sealed) of a live stream that has a replica on ``server_id``."""
        return [r for r in self._all_ranges() if server_id in r.server_ids]

    def get_range(self, stream_id: int, range_index: int) -> RangeMeta:
        def read(tx: _Tx) -> RangeMeta:
            self._live_stream(tx, stream_id)
            kvs = tx.read(self._range_key(stream_id, range_index))
            if not kvs:
                raise range_missing(stream_id, range_index)
            return self._range(kvs[0])

        return self._read(read)

    def last_range(self, stream_id: int) -> RangeMeta:
        return self.list_ranges(stream_id)[-1]

    def open_range_counts(self) -> dict[int, int]:
        """server_id -> number of open ranges of live streams it holds."""
        counts: dict[int, int] = {}
        for rng in self._all_ranges():
            if rng.is_open:
                for sid in rng.server_ids:
                    counts[sid] = counts.get(sid, 0) + 1
        return counts

    def seal_range(self, stream_id: int, range_index: int, end_offset: int,
                   next_servers: Sequence[int] | None = None
                   ) -> tuple[RangeMeta, RangeMeta | None]:
        """As ``PdStore.seal_range``: seal, and given servers open the next range, at once."""
        def change(tx: _Tx) -> tuple[RangeMeta, RangeMeta | None]:
            self._save_stream(tx, self._live_stream(tx, stream_id))
            ranges = {r.range_index: r for r in self._stream_ranges(tx, stream_id)}
            if range_index not in ranges:
                raise range_missing(stream_id, range_index)
            sealed = ranges[range_index] = sealed_range(ranges[range_index], end_offset)
            self._put_range(tx, sealed)
            new = None
            if next_servers is not None:
                new = next_range(ranges[max(ranges)], next_servers)
                self._put_range(tx, new)
            return sealed, new

        return self._change(change)

    def open_next_range(self, stream_id: int, servers: Sequence[int]) -> RangeMeta:
        """Open the range after the stream's last one, which must be sealed."""
        def change(tx: _Tx) -> RangeMeta:
            self._save_stream(tx, self._live_stream(tx, stream_id))
            new = next_range(self._stream_ranges(tx, stream_id)[-1], servers)
            self._put_range(tx, new)
            return new

        return self._change(change)

    def update_next_offset(self, stream_id: int, range_index: int, next_offset: int) -> None:
        """Refresh the PD's snapshot of an open range's next_offset (never moves it back)."""
        def change(tx: _Tx) -> None:
            value = tx.get(self._stream_key(stream_id))
            kvs = tx.read(self._range_key(stream_id, range_index))
            if value is None or value["deleted"] or not kvs:
                return
            rng = self._range(kvs[0])
            if rng.is_open and next_offset > rng.next_offset:
                self._save_stream(tx, self._stream(stream_id, value))
                self._put_range(tx, replace(rng, next_offset=next_offset))

        self._change(change)

    # -- range servers ---------------------------------------------------------------------

    def _issued(self, tx: _Tx) -> int:
        return tx.get(self._key("ids", "server")) or 0

    def allocate_server_id(self, host: str = "") -> int:
        """A new server id, never handed out before (ids start at 1)."""
        def change(tx: _Tx) -> int:
            sid = self._issued(tx) + 1
            tx.put(self._key("ids", "server"), sid)
            tx.put(self._server_key(sid), {
                "host": host, "advertise_addr": "", "allocated_ms": _now_ms(),
                "last_heartbeat_ms": -1, "metrics": {}, "metrics_ms": -1})
            return sid

        return self._change(change)

    def record_heartbeat(self, server_id: int, advertise_addr: str,
                         now_ms: int | None = None) -> ServerMeta:
        """As ``PdStore.record_heartbeat``: only ids issued here are accepted."""
        if server_id < 0:
            raise InvalidRequestError(f"server_id must be >= 0, got {server_id}")
        ts = _now_ms() if now_ms is None else now_ms

        def change(tx: _Tx) -> ServerMeta:
            value = tx.get(self._server_key(server_id))
            if value is None:
                raise unknown_server(server_id, advertise_addr, self._issued(tx))
            value.update(advertise_addr=advertise_addr, last_heartbeat_ms=ts)
            tx.put(self._server_key(server_id), value)
            return self._server(server_id, value)

        return self._change(change)

    def record_metrics(self, server_id: int, metrics: dict[str, int],
                       now_ms: int | None = None) -> None:
        """Keep the latest metrics a range server reported."""
        ts = _now_ms() if now_ms is None else now_ms

        def change(tx: _Tx) -> None:
            value = tx.get(self._server_key(server_id))
            if value is None:
                raise not_registered(server_id)
            value.update(metrics=dict(metrics), metrics_ms=ts)
            tx.put(self._server_key(server_id), value)

        self._change(change)

    def get_server(self, server_id: int) -> ServerMeta | None:
        value = self._read(lambda tx: tx.get(self._server_key(server_id)))
        return None if value is None else self._server(server_id, value)

    def list_servers(self) -> list[ServerMeta]:
        """Every server that has an id here, in id order."""
        return self._read(lambda tx: [
            self._server(int(kv.key.rsplit(b"/", 1)[1]), json.loads(kv.value))
            for kv in tx.read(self._key("servers") + b"/", prefix=True)])

    # -- permissions (docs/wire.md, "Who may do what") --------------------------------------

    def acl(self) -> tuple[int, list[AclEntry]]:
        """The permissions granted and their version (0 before any change)."""
        value = self._read(lambda tx: tx.get(self._key("acl")))
        if value is None:
            return 0, []
        return int(value["version"]), sorted(AclEntry(*e) for e in value["entries"])

    def change_acl(self, grant: bool, entries: Sequence[AclEntry]) -> int:
        """Grant (or revoke) ``entries`` in one transaction (fenced: the leader's); the new
        version."""
        def change(tx: _Tx) -> int:
            value = tx.get(self._key("acl")) or {"version": 0, "entries": []}
            have = {AclEntry(*e) for e in value["entries"]}
            have = have | set(entries) if grant else have - set(entries)
            version = int(value["version"]) + 1
            tx.put(self._key("acl"), {"version": version, "entries": [
                [e.principal, e.operation, e.stream] for e in sorted(have)]})
            return version

        return self._change(change)
