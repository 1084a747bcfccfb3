"""The one retry loop of the client: capped exponential backoff with jitter, within a deadline.

What may be retried is read from the error itself (``ServerError.retriable``), never from a list
of codes. Socket failures and timeouts are retried too: the next attempt opens a new connection.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from sbp_spark.protocol.errors import (
    ChecksumError,
    SbpError,
    SbpTimeoutError,
    ServerError,
    TransportError,
)

from .config import ClientConfig

T = TypeVar("T")


def is_retriable(error: BaseException) -> bool:
    """True when trying the same operation again may succeed."""
    if isinstance(error, ServerError):
        return error.retriable
    # A corrupted answer (bad checksum) is worth asking for again; other malformed answers
    # would come back the same.
    return isinstance(error, (TransportError, SbpTimeoutError, ChecksumError))


def throttle_ms(error: BaseException) -> int:
    """The wait the server asked for along with ``error`` (0 if none)."""
    return int(getattr(error, "throttle_time_ms", 0) or 0)


def backoff_s(attempt: int, config: ClientConfig) -> float:
    """Wait before retry number ``attempt`` (0-based): exponential, capped, half jittered."""
    ceiling = min(config.retry_backoff_max_ms, config.retry_backoff_ms * (2 ** min(attempt, 30)))
    return (ceiling / 2 + random.uniform(0, ceiling / 2)) / 1000.0


def call_with_retries(
    op: Callable[[], T],
    config: ClientConfig,
    on_error: Callable[[SbpError], bool] | None = None,
    deadline: float | None = None,
) -> T:
    """Run ``op()``; after a retriable failure wait and run it again, at most ``config.retries``
    more times and never past ``deadline`` (a ``time.monotonic()`` value; default: the
    config's ``retry_deadline_s`` from now).

    ``on_error(error)`` runs before each retry (to refresh placement, follow a PD leader...);
    returning True retries at once, without backoff (a redirect, not a failure). A server's
    throttle time is always honoured. The last error is raised when retries run out.
    """
    if deadline is None:
        deadline = time.monotonic() + config.retry_deadline_s
    attempt = 0
    immediate_redirects = 0
    while True:
        try:
            return op()
        except SbpError as error:
            if not is_retriable(error) or attempt >= config.retries:
                raise
            immediate = bool(on_error(error)) if on_error is not None else False
            # Redirects cost no wait, but only a few in a row: a ring of PDs that keep naming
            # each other must not spin.
            if immediate and immediate_redirects < 3:
                immediate_redirects += 1
                delay = 0.0
            else:
                immediate_redirects = 0
                delay = backoff_s(attempt, config)
                attempt += 1
            delay = max(delay, throttle_ms(error) / 1000.0)
            if time.monotonic() + delay > deadline:
                raise
            if delay > 0:
                time.sleep(delay)
