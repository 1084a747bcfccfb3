"""The one retry loop of the client: capped exponential backoff with jitter, within a deadline.

What may be retried is read from the error itself (``SbpError.retriable``), never from a list
of classes or codes. Socket failures and timeouts carry the flag too: the next attempt opens a
new connection.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from sbp_spark.protocol.errors import SbpError

from .config import ClientConfig

T = TypeVar("T")


def is_retriable(error: BaseException) -> bool:
    """True when trying the same operation again may succeed (the error's own flag; errors
    that are not ours never are)."""
    return isinstance(error, SbpError) and error.retriable


def throttle_ms(error: BaseException) -> int:
    """The wait the server asked for along with ``error`` (0 if none)."""
    return int(getattr(error, "throttle_time_ms", 0) or 0)


def backoff_s(attempt: int, config: ClientConfig) -> float:
    """Wait before retry number ``attempt`` (0-based): exponential, capped, half jittered."""
    ceiling = min(config.retry_backoff_max_ms, config.retry_backoff_ms * (2 ** min(attempt, 30)))
    return (ceiling / 2 + random.uniform(0, ceiling / 2)) / 1000.0


class Retrier:
    """The retry state of one operation: how many attempts were made, until when retries may
    start, and the wait before the next one.

    ``on_error(error)`` runs before each retry (to refresh placement, follow a PD leader, move
    to another replica); returning True retries at once, without backoff (a redirect, not a
    failure). ``spare(error)``, asked first, says whether the failure belongs to a passing
    state of the service that the caller knows to wait for (a PD cluster electing a leader):
    such a failure is backed off as usual but not counted against ``config.retries``, so only
    the deadline ends the wait. A server's throttle time is always honoured.
    """

    # Redirects cost no wait, but only a few in a row: a ring of PDs that keep naming each
    # other must not spin.
    MAX_IMMEDIATE = 3

    def __init__(
        self,
        config: ClientConfig,
        on_error: Callable[[SbpError], bool] | None = None,
        deadline: float | None = None,
        spare: Callable[[SbpError], bool] | None = None,
    ) -> None:
        self.config = config
        self.on_error = on_error
        self.spare = spare
        self._own_deadline = deadline is None
        self.deadline = (time.monotonic() + config.retry_deadline_s if deadline is None
                         else deadline)
        self.attempt = 0
        self._immediate = 0
        self._spared = 0

    def progressed(self) -> None:
        """The operation moved on since its last failure (a long read got further): the
        failures before are over, so the next one gets the retries and the time a new
        operation would (a caller's own deadline stays)."""
        self.attempt = self._immediate = self._spared = 0
        if self._own_deadline:
            self.deadline = time.monotonic() + self.config.retry_deadline_s

    def retry_after(self, error: SbpError) -> None:
        """Called with the failure of an attempt: waits as long as needed and returns when
        another attempt may start; raises ``error`` when it may not be retried, retries are
        used up (``config.retries``) or the wait would pass the deadline."""
        if not is_retriable(error):
            raise error
        spared = self.spare is not None and self.spare(error)
        if not spared and self.attempt >= self.config.retries:
            raise error
        immediate = bool(self.on_error(error)) if self.on_error is not None else False
        if immediate and self._immediate < self.MAX_IMMEDIATE:
            self._immediate += 1
            delay = 0.0
        elif spared:
            self._immediate = 0
            delay = backoff_s(self._spared, self.config)
            self._spared += 1
        else:
            self._immediate = 0
            delay = backoff_s(self.attempt, self.config)
            self.attempt += 1
        delay = max(delay, throttle_ms(error) / 1000.0)
        if time.monotonic() + delay > self.deadline:
            raise error
        if delay > 0:
            time.sleep(delay)


def call_with_retries(
    op: Callable[[], T],
    config: ClientConfig,
    on_error: Callable[[SbpError], bool] | None = None,
    deadline: float | None = None,
    spare: Callable[[SbpError], bool] | None = None,
) -> T:
    """Run ``op()``; after a retriable failure wait and run it again, at most ``config.retries``
    more times and never past ``deadline`` (a ``time.monotonic()`` value; default: the
    config's ``retry_deadline_s`` from now). See ``Retrier`` for ``on_error`` and ``spare``.
    The last error is raised when retries run out.
    """
    retrier = Retrier(config, on_error, deadline, spare)
    while True:
        try:
            return op()
        except SbpError as error:
            retrier.retry_after(error)
