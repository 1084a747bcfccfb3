"""Named consumers in a PD cluster's etcd (the rules: ``consumers.py``).

One key per consumer, ``consumers/<name>`` under the store's prefix, its JSON value the
generation, when it was created and the positions by stream id. Every change goes through the
metadata store's transactions (``EtcdStore.transact``): it compares what it read, so two joins
at once hand out two generations, and it carries the leader's fence, so a PD node that stopped
leading changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .consumers import (
    ConsumerMeta,
    ConsumerOffset,
    advanced,
    check_consumer_name,
    check_generation,
    check_positions,
    consumer_missing,
)
from .etcd_store import EtcdStore
from .meta import now_ms


def _meta(name: str, value: dict[str, Any]) -> ConsumerMeta:
    positions = {int(sid): ConsumerOffset(offset, at)
                 for sid, (offset, at) in value["positions"].items()}
    return ConsumerMeta(name, value["generation"], value["created_ms"],
                        dict(sorted(positions.items())))


def _value(consumer: ConsumerMeta) -> dict[str, Any]:
    return {"generation": consumer.generation, "created_ms": consumer.created_ms,
            "positions": {str(sid): [p.committed_offset, p.commit_time_ms]
                          for sid, p in consumer.positions.items()}}


class EtcdConsumers:
    """The consumers kept beside ``store``'s metadata in etcd."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store

    def close(self) -> None:
        """Nothing to release: the store and its client belong to the PD."""

    def _key(self, name: str) -> bytes:
        return self._store.key("consumers", name)  # names have no '/' (consumers.py)

    def _get(self, tx: Any, name: str) -> ConsumerMeta | None:
        value = tx.get(self._key(name))
        return None if value is None else _meta(name, value)

    def join(self, name: str) -> ConsumerMeta:
        """As ``SqliteConsumers.join``."""
        check_consumer_name(name)

        def change(tx: Any) -> ConsumerMeta:
            current = self._get(tx, name)
            joined = (ConsumerMeta(name, 1, now_ms()) if current is None else
                      ConsumerMeta(name, current.generation + 1, current.created_ms,
                                   current.positions))
            tx.put(self._key(name), _value(joined))
            return joined

        return self._store.transact(change)

    def commit(self, name: str, generation: int, positions: Mapping[int, int]) -> ConsumerMeta:
        """As ``SqliteConsumers.commit``."""
        check_consumer_name(name)
        check_positions(positions)

        def change(tx: Any) -> ConsumerMeta:
            current = check_generation(name, self._get(tx, name), generation)
            moved = ConsumerMeta(name, current.generation, current.created_ms,
                                 dict(sorted(advanced(current.positions, positions,
                                                      now_ms()).items())))
            if moved != current:
                tx.put(self._key(name), _value(moved))
            return moved

        return self._store.transact(change)

    def get(self, name: str) -> ConsumerMeta:
        """As ``SqliteConsumers.get``."""
        found = self._store.snapshot(lambda tx: self._get(tx, name))
        if found is None:
            raise consumer_missing(name)
        return found

    def list_all(self) -> list[ConsumerMeta]:
        """Every consumer, by name."""
        prefix = self._store.key("consumers") + b"/"

        def read(tx: Any) -> list[ConsumerMeta]:
            return [_meta(kv.key[len(prefix):].decode(), json.loads(kv.value))
                    for kv in tx.read(prefix, prefix=True)]

        return sorted(self._store.snapshot(read), key=lambda c: c.name)

    def delete(self, name: str) -> ConsumerMeta:
        """As ``SqliteConsumers.delete``."""
        def change(tx: Any) -> ConsumerMeta:
            found = self._get(tx, name)
            if found is None:
                raise consumer_missing(name)
            tx.delete(self._key(name))
            return found

        return self._store.transact(change)
