"""The one retry loop of the client: capped exponential backoff with jitter, until a deadline.

Every client call that retries (PD calls, appends, fetches, a range's live end) makes one
``Retrier`` and keeps its own state (where it is, what it learned) in a small object of its
own, whose methods the Retrier calls: ``run(attempt)`` for a call made of attempts, or
``retry_after(error)`` inside a loop of the caller's that yields as it goes (a fetch).

Retries are bounded by time, not by count: a retriable failure is tried again, backing off,
until ``ClientConfig.retry_deadline_s`` after the call began (or the caller's own deadline),
which outlasts the failovers a cluster goes through (a range server's death, a PD leader
change, a pause past the liveness timeout). The last attempt starts at the deadline at the
latest, and a call that still fails then raises its last error, saying how long it tried.
``ClientConfig.retries``, when set, caps the number of retries as well.

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


def backoff_s(attempt: int, config: ClientConfig, max_ms: int | None = None) -> float:
    """Wait before retry number ``attempt`` (0-based): exponential, capped (at ``max_ms`` if
    lower than the config's cap), half jittered."""
    top = config.retry_backoff_max_ms if max_ms is None else min(max_ms,
                                                                  config.retry_backoff_max_ms)
    ceiling = min(top, config.retry_backoff_ms * (2 ** min(attempt, 30)))
    return (ceiling / 2 + random.uniform(0, ceiling / 2)) / 1000.0


class Retrier:
    """The retry state of one call: its attempts, its deadline and the wait before the next.

    ``on_error(error)`` runs before each retry (to refresh placement, follow a PD leader, move
    to another replica); returning True retries at once, without backoff (a redirect, not a
    failure). ``spare(error)``, asked first, says whether the failure belongs to a passing
    state of the service that the caller knows to wait for (a PD cluster electing a leader):
    such a failure is not counted against ``config.retries``, and backed off up to
    ``spare_backoff_max_ms`` (when given) instead of the config's cap: a passing state is
    asked about often, so the call goes on soon after it passed. A server's throttle time is
    always honoured, up to the deadline.
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
        spare_backoff_max_ms: int | None = None,
    ) -> None:
        self.config = config
        self.on_error = on_error
        self.spare = spare
        self.spare_backoff_max_ms = spare_backoff_max_ms
        self._own_deadline = deadline is None
        self.started = time.monotonic()
        self.deadline = (self.started + config.retry_deadline_s if deadline is None
                         else deadline)
        self.attempts = 1  # attempts made so far, the one under way included
        # Set when the retries stopped (``gave_up``): the last failure, and why they stopped.
        self.stopped: tuple[SbpError, str] | None = None
        self._counted = 0  # retries counted against config.retries (and backed off by)
        self._immediate = 0
        self._spared = 0

    def run(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` until it returns; after each retriable failure wait as
        ``retry_after`` says. Raises as ``retry_after`` does."""
        while True:
            try:
                return attempt()
            except SbpError as error:
                self.retry_after(error)

    def progressed(self) -> None:
        """The operation moved on since its last failure (a long read got further): the
        failures before are over, so the next one gets the retries and the time a new
        operation would (a caller's own deadline stays)."""
        self._counted = self._immediate = self._spared = 0
        if self._own_deadline:
            self.deadline = time.monotonic() + self.config.retry_deadline_s

    @property
    def elapsed_s(self) -> float:
        """Seconds since the call began."""
        return time.monotonic() - self.started

    def retry_after(self, error: SbpError) -> None:
        """Called with the failure of an attempt: waits as long as needed and returns when
        another attempt may start. Raises ``error`` itself when it may not be retried, and
        (``gave_up``) when the deadline has passed or ``config.retries`` are used up."""
        if not is_retriable(error):
            raise error
        spared = self.spare is not None and self.spare(error)
        cap = self.config.retries
        if not spared and cap is not None and self._counted >= cap:
            raise self.gave_up(error, f"retries={cap} used up")
        now = time.monotonic()
        if now >= self.deadline:
            raise self.gave_up(error, "its deadline passed")
        immediate = bool(self.on_error(error)) if self.on_error is not None else False
        if immediate and self._immediate < self.MAX_IMMEDIATE:
            self._immediate += 1
            delay = 0.0
        elif spared:
            self._immediate = 0
            delay = backoff_s(self._spared, self.config, self.spare_backoff_max_ms)
            self._spared += 1
        else:
            self._immediate = 0
            delay = backoff_s(self._counted, self.config)
            self._counted += 1
        # The last attempt starts at the deadline, not a backoff before it.
        delay = min(max(delay, throttle_ms(error) / 1000.0), self.deadline - time.monotonic())
        if delay > 0:
            time.sleep(delay)
        self.attempts += 1

    def gave_up(self, error: SbpError, why: str) -> SbpError:
        """``error``, the last cause, saying that the call stopped trying and when (also kept
        in ``stopped``, for a caller that says more)."""
        self.stopped = (error, why)
        return error.with_context(f"{self.effort(why)}; the last failure")

    def effort(self, why: str) -> str:
        """"gave up after 12 attempts in 60.1 s (why)"."""
        return (f"gave up after {self.attempts} attempt{'s' if self.attempts != 1 else ''} in "
                f"{self.elapsed_s:.1f} s ({why})")


__all__ = ["Retrier", "backoff_s", "is_retriable", "throttle_ms"]
