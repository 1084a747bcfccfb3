"""Named consumers as the PD records them: the records, the rules, and the store interface.

A consumer is a name under which a reader records how far it has read each stream. Its
generation fences it, as a Kafka group's generation does: ``join`` hands out the next one, and
a commit under any other generation is refused with CONSUMER_FENCED, so an older instance of a
query that comes back, or a second query under the same name, cannot move the record. A
recorded position only moves forward. The SQLite store (``sqlite_consumers.py``) and the etcd
store (``etcd_consumers.py``) both apply the rules here, so they refuse the same requests with
the same messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sbp_spark.protocol.errors import ConsumerFencedError, InvalidRequestError
from sbp_spark.protocol.names import consumer_name_problem


@dataclass(frozen=True, slots=True)
class ConsumerOffset:
    """Every record of the stream below ``committed_offset`` is read; recorded at
    ``commit_time_ms`` (the PD's clock)."""

    committed_offset: int
    commit_time_ms: int


@dataclass(frozen=True, slots=True)
class ConsumerMeta:
    """A consumer: its generation (0 before its first join) and its position per stream id."""

    name: str
    generation: int
    created_ms: int
    positions: Mapping[int, ConsumerOffset] = field(default_factory=dict)


def check_consumer_name(name: str) -> None:
    """Refuse (INVALID_REQUEST) a name that is not valid (``protocol.names``)."""
    problem = consumer_name_problem(name)
    if problem is not None:
        raise InvalidRequestError(problem)


def check_positions(positions: Mapping[int, int]) -> None:
    """Refuse a commit naming a negative stream id or offset."""
    for stream_id, offset in positions.items():
        if stream_id < 0:
            raise InvalidRequestError(f"a committed position needs a stream id >= 0, got "
                                      f"{stream_id}")
        if offset < 0:
            raise InvalidRequestError(f"committed offset of stream {stream_id} must be >= 0, "
                                      f"got {offset}")


def consumer_missing(name: str) -> InvalidRequestError:
    """The error for a consumer the PD has no record of."""
    return InvalidRequestError(f"no consumer is named {name!r}")


def check_generation(name: str, current: ConsumerMeta | None, generation: int) -> ConsumerMeta:
    """``current`` if ``generation`` is its generation; CONSUMER_FENCED otherwise."""
    if current is None:
        raise ConsumerFencedError(
            f"consumer {name!r} no longer exists (deleted while generation {generation} ran): "
            f"start the query again to record its positions under a new generation")
    if generation != current.generation:
        newer = "a newer" if current.generation > generation else "another"
        raise ConsumerFencedError(
            f"consumer {name!r} is at generation {current.generation}: {newer} reader took "
            f"it over from generation {generation}, which may no longer record positions")
    return current


def advanced(current: Mapping[int, ConsumerOffset], positions: Mapping[int, int],
             now_ms: int) -> dict[int, ConsumerOffset]:
    """``current`` with each of ``positions`` that lies ahead of the recorded one moved there
    (a position never moves back; the others keep their offset and time)."""
    out = dict(current)
    for stream_id, offset in positions.items():
        had = out.get(stream_id)
        if had is None or offset > had.committed_offset:
            out[stream_id] = ConsumerOffset(offset, now_ms)
    return out


class ConsumerStore(Protocol):
    """The consumers' durable record (``SqliteConsumers``, ``EtcdConsumers``). Every change is
    atomic; refusals raise ``ServerError`` subclasses."""

    def join(self, name: str) -> ConsumerMeta: ...

    def commit(self, name: str, generation: int, positions: Mapping[int, int]
               ) -> ConsumerMeta: ...

    def get(self, name: str) -> ConsumerMeta: ...

    def list_all(self) -> list[ConsumerMeta]: ...

    def delete(self, name: str) -> ConsumerMeta: ...


def lowest_positions(consumers: Sequence[ConsumerMeta], stream_id: int) -> int | None:
    """The lowest committed offset of ``stream_id`` among ``consumers``, or None if none
    recorded one."""
    offsets = [c.positions[stream_id].committed_offset for c in consumers
               if stream_id in c.positions]
    return min(offsets) if offsets else None
