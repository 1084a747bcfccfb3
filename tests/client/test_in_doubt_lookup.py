"""Which replicas of a sealed range a writer asks about its batches in doubt, in what order,
and what it makes of their answers (``in_doubt.held_in_sealed_range``)."""

from __future__ import annotations

import pytest

from sbp_spark.client.in_doubt import held_in_sealed_range
from sbp_spark.protocol.errors import RequestTimeoutError, SequencePendingError
from sbp_spark.protocol.messages import Range, RangeReplica, RangeServer


def _sealed(*addresses: str) -> Range:
    """A sealed range whose first address is its primary."""
    return Range(stream_id=3, range_index=7, start_offset=0, next_offset=10, end_offset=10,
                 servers=[RangeReplica(RangeServer(i + 1, a), i == 0)
                          for i, a in enumerate(addresses)])


class Replicas:
    """Replicas that answer from ``answers`` (an exception raises), recording who was asked."""

    def __init__(self, answers: dict) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def __call__(self, address: str):
        replicas = self

        class One:
            def lookup_sequences(self, rid, producer_id, sequences):
                replicas.asked.append(address)
                answer = replicas.answers[address]
                if isinstance(answer, Exception):
                    raise answer
                return answer

        return One()


def test_the_secondaries_are_asked_before_the_primary():
    # The primary is the replica a writer most likely could not reach (why it sealed the
    # range): asked first, it would hold the writer up for a call's timeout.
    replicas = Replicas({"p:1": RequestTimeoutError("no answer"), "s:2": [4, -1],
                         "s:3": [4, -1]})
    assert held_in_sealed_range(_sealed("p:1", "s:2", "s:3"), 9, [0, 1], replicas) == {
        0: 4, 1: -1}
    assert replicas.asked == ["s:2"]


def test_the_primary_is_asked_when_no_secondary_can_tell():
    replicas = Replicas({"p:1": [2], "s:2": RequestTimeoutError("no answer")})
    assert held_in_sealed_range(_sealed("p:1", "s:2"), 9, [5], replicas) == {5: 2}
    assert replicas.asked == ["s:2", "p:1"]


def test_an_end_not_settled_anywhere_is_retriable_and_no_answer_at_all_is_none():
    pending = Replicas({"p:1": SequencePendingError("not final"),
                        "s:2": SequencePendingError("not final")})
    with pytest.raises(SequencePendingError):
        held_in_sealed_range(_sealed("p:1", "s:2"), 9, [5], pending)
    silent = Replicas({"p:1": RequestTimeoutError("x"), "s:2": RequestTimeoutError("y")})
    assert held_in_sealed_range(_sealed("p:1", "s:2"), 9, [5], silent) is None
