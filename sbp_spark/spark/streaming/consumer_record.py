"""The cluster's record of a streaming query's position under option ``consumer``.

The checkpoint stays the query's own source of truth; this record is what everyone else sees
(``sbp consumers``, the lag metrics, retention that waits for consumers). ``ConsumerRecord``
keeps it: at its first write it joins the consumer (the PD hands out the next generation, which
fences any other query still running under the name), and then it records offsets that Spark
has committed, each stream's only ever moving forward.

What counts as committed, with Spark's streaming source calls (pyspark 4.x): ``commit(end)``
comes one micro-batch late and is not called for the last micro-batch before a stop, so the
reader also records the start Spark gives ``latestOffset`` and ``partitions``: Spark only plans
micro-batch N+1, from where N ended, once N is in the commit log, and a restarted query begins
from its committed offsets. So the record may trail the checkpoint by the micro-batch in
flight, never run ahead of it.

A write that fails (the PD out of reach past the client's retry deadline) is logged and tried
again at the next one, which carries the newer offsets anyway; only CONSUMER_FENCED fails the
query: another query took the name over.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from sbp_spark.protocol.errors import ConsumerFencedError, SbpError

if TYPE_CHECKING:
    from sbp_spark.protocol.messages import Consumer

log = logging.getLogger("sbp_spark.spark.streaming.reader")


class ConsumerCommits(Protocol):
    """What the record needs of the cluster (``SbpClient.consumers``)."""

    def join(self, name: str) -> Consumer: ...

    def commit(self, name: str, generation: int, positions: Mapping[int, int]) -> Consumer: ...


class ConsumerRecord:
    """Records the committed offsets of one query under ``name`` through ``commits``."""

    def __init__(self, name: str, commits: ConsumerCommits) -> None:
        self.name = name
        self._commits = commits
        self.generation: int | None = None
        self._recorded: dict[int, int] = {}

    def record(self, committed: Mapping[int, int]) -> None:
        """Record ``committed`` (stream id -> offset after the last record read) unless it
        moves nothing forward; joins the consumer first, at the first call."""
        ahead = {sid: off for sid, off in committed.items()
                 if off > self._recorded.get(sid, -1)}
        if not ahead:
            return
        try:
            if self.generation is None:
                joined = self._commits.join(self.name)
                self.generation = joined.generation
                self._recorded = {p.stream_id: p.committed_offset for p in joined.positions}
                log.info("sbp: recording positions as consumer %r, generation %d", self.name,
                         self.generation)
                ahead = {sid: off for sid, off in committed.items()
                         if off > self._recorded.get(sid, -1)}
                if not ahead:
                    return
            recorded = self._commits.commit(self.name, self.generation, dict(committed))
        except ConsumerFencedError as exc:
            # The query stops: two queries must never record positions under one name.
            raise exc.with_context(
                f"sbp streaming read recording as consumer {self.name!r} (give each query a "
                f"name of its own)") from None
        except SbpError as exc:
            log.warning("sbp: could not record consumer %r at %s (tried again at the next "
                        "micro-batch): %s", self.name, dict(committed), exc)
            return
        self._recorded = {p.stream_id: p.committed_offset for p in recorded.positions}
