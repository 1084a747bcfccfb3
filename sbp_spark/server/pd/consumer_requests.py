"""The PD's answers to the consumer requests (ours: JOIN_CONSUMER, COMMIT_CONSUMER,
DESCRIBE_CONSUMERS, DELETE_CONSUMERS; schemas/consumers.fbs).

``ConsumerRequests`` turns each request into calls of the consumers' store (``ConsumerStore``)
and the records into their wire form. The handler routes the opcodes here after its own checks
(a follower refuses them with PD_NOT_LEADER as it refuses the rest).
"""

from __future__ import annotations

from collections.abc import Callable

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import PdNotLeaderError, ServerError

from .consumers import ConsumerMeta, ConsumerStore, lowest_positions


def consumer_msg(consumer: ConsumerMeta) -> m.Consumer:
    """A consumer record in its wire form, positions by stream id."""
    return m.Consumer(
        name=consumer.name, generation=consumer.generation, created_ms=consumer.created_ms,
        positions=[m.ConsumerPosition(sid, p.committed_offset, p.commit_time_ms)
                   for sid, p in sorted(consumer.positions.items())])


class ConsumerRequests:
    """Serves the consumer opcodes over ``store``."""

    def __init__(self, store: ConsumerStore) -> None:
        self._store = store

    def join(self, req: m.JoinConsumerRequest) -> m.JoinConsumerResponse:
        try:
            return m.JoinConsumerResponse(consumer=consumer_msg(self._store.join(req.name)))
        except PdNotLeaderError:
            raise
        except ServerError as exc:
            return m.JoinConsumerResponse(status=m.Status.from_error(exc),
                                          consumer=m.Consumer(name=req.name))

    def commit(self, req: m.CommitConsumerRequest) -> m.CommitConsumerResponse:
        positions: dict[int, int] = {}
        for p in req.positions:
            positions[p.stream_id] = max(p.committed_offset, positions.get(p.stream_id, -1))
        try:
            consumer = self._store.commit(req.name, req.generation, positions)
        except PdNotLeaderError:
            raise
        except ServerError as exc:
            return m.CommitConsumerResponse(status=m.Status.from_error(exc),
                                            consumer=m.Consumer(name=req.name,
                                                                generation=req.generation))
        return m.CommitConsumerResponse(consumer=consumer_msg(consumer))

    def describe(self, req: m.DescribeConsumersRequest) -> m.DescribeConsumersResponse:
        if not req.consumers:
            return m.DescribeConsumersResponse(results=[
                m.ConsumerResult(consumer_msg(c)) for c in self._store.list_all()])
        return m.DescribeConsumersResponse(results=[
            self._item(self._store.get, c.name) for c in req.consumers])

    def delete(self, req: m.DeleteConsumersRequest) -> m.DeleteConsumersResponse:
        return m.DeleteConsumersResponse(results=[
            self._item(self._store.delete, c.name) for c in req.consumers])

    def low_offset(self, stream_id: int) -> int:
        """The lowest position the stream's consumers committed, -1 when none did."""
        low = lowest_positions(self._store.list_all(), stream_id)
        return -1 if low is None else low

    @staticmethod
    def _item(op: Callable[[str], ConsumerMeta], name: str) -> m.ConsumerResult:
        try:
            found = op(name)
        except PdNotLeaderError:
            raise
        except ServerError as exc:
            return m.ConsumerResult(m.Consumer(name=name), m.Status.from_error(exc))
        return m.ConsumerResult(consumer_msg(found))
