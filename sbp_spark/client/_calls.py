"""Helpers shared by the client's parts: typed calls, per-item results, errors in context."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sbp_spark.protocol.errors import ProtocolError, SbpError
from sbp_spark.protocol.messages import Status

from .connection import Connection
from .types import ItemResult, status_error

T = TypeVar("T")


def checked_call(conn: Connection, msg: Any, timeout: float | None = None,
                 on_lost: Callable[[SbpError], SbpError] | None = None,
                 probe_s: float | None = None) -> Any:
    """``conn.call(msg)``; honours the answer's throttle time and raises its top-level status.
    ``on_lost``, ``probe_s``: as in ``Connection.call``."""
    response, _ = conn.call(msg, timeout=timeout, on_lost=on_lost, probe_s=probe_s)
    throttle = getattr(response, "throttle_time_ms", 0) or 0
    if throttle > 0:
        conn.throttle(throttle)
    status = getattr(response, "status", None)
    if status is not None and status.code:
        raise status_error(status, throttle, f"{type(msg).__name__} to {conn.address}")
    return response


def item_results(
    answers: Sequence[Any],
    expected: int,
    value_of: Callable[[Any], T],
    what: str,
) -> list[ItemResult[T]]:
    """One ``ItemResult`` per request item, in request order; items the server left
    unanswered get an error instead of vanishing."""
    results: list[ItemResult[T]] = []
    for answer in answers[:expected]:
        status: Status = answer.status
        results.append(ItemResult(value_of(answer) if status.code == 0 else None, status))
    for index in range(len(results), expected):
        results.append(ItemResult(None, error=ProtocolError(
            f"{what}: the server answered {len(answers)} of {expected} items; "
            f"item {index} got no answer")))
    return results


def unwrap(result: ItemResult[T], what: str) -> T:
    """The item's value; its error, said to concern ``what`` ("stream 7"), if it failed."""
    error = result.exception()
    if error is not None:
        raise error.with_context(what)
    return result.unwrap()
