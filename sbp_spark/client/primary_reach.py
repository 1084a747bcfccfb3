"""Whether a writer should stop waiting for the primary of its stream's open range.

A writer whose primary does not answer (no answer to its APPEND, nor to a PING, nor a
connection) first asks the PD whether the server is still the range's primary: a stopped or
dead server is failed over by the PD within seconds, and the writer follows. But the PD may
hear a server the writer cannot reach (a broken link between the two only), and then nothing
is failed over: the writer would wait for the network to heal. ``PrimaryReach`` keeps, per
server, since when this writer has not reached it: since it sent the request that got no
answer, not since that request failed, which comes a probe or two later. Once that lasts
``ClientConfig.unreachable_primary_s`` and the PD has heard the server since (the link is
broken, not the server stopped), the writer asks the PD to seal the range (SEAL_RANGES of that
range) and goes on in the next one, which the PD places away from the sealed range's primary.
The seal is the PD's ordinary one, so it ends the range where its replicas agree and keeps
every acknowledged record (``docs/reliability.md``, "Partitions").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sbp_spark.protocol.errors import SbpError, SbpTimeoutError, TransportError

# How much later than the unanswered request's send the PD's last heartbeat from the server
# must be for the PD to have heard it "since": the server may have been stopped between
# taking that request and answering it (milliseconds, more on a loaded host), and a heartbeat
# in between must not pass for evidence that it is up.
HEARD_MARGIN_S = 0.25


def heard_since(live: bool, silent_ms: int, unreached_s: float | None) -> bool:
    """Whether the PD has heard a server since a writer last did, from the PD's view of it
    (``RangeServerState.live`` and ``silent_ms``) and how long the writer has not reached it
    (``unreached_s``, measured after the PD answered). A server the PD counts live but has
    not heard since (stopped or killed, within the PD's liveness timeout) is not. A PD that
    reports liveness only (``silent_ms`` -1) is taken at its word."""
    if not live:
        return False
    if silent_ms < 0 or unreached_s is None:
        return True
    return silent_ms / 1000.0 + HEARD_MARGIN_S < unreached_s


def is_unreached(error: SbpError) -> bool:
    """Whether ``error`` says the server could not be reached or did not answer (as opposed
    to a server's answer, which shows it reachable)."""
    return isinstance(error, (TransportError, SbpTimeoutError))


class PrimaryReach:
    """Since when each primary (by address) has gone unreached by one writer.

    ``unreached`` is told of every sign that the server cannot be reached, ``reached`` of every
    answer from it; ``overdue`` says when the writer should seal the range and move on."""

    def __init__(self, after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = after_s
        self._clock = clock
        self._since: dict[str, float] = {}
        self._lock = threading.Lock()

    def unreached(self, address: str, since: float | None = None) -> float:
        """Note that ``address`` has not been reached since ``since`` (a clock value: when
        the request that got no answer was sent; now when not given); seconds since it was
        first not reached (without an answer in between)."""
        now = self._clock()
        with self._lock:
            return now - self._since.setdefault(address, now if since is None else since)

    def unreached_for(self, address: str) -> float | None:
        """Seconds since ``address`` was first not reached; None while it is reached."""
        now = self._clock()
        with self._lock:
            since = self._since.get(address)
        return None if since is None else now - since

    def reached(self, address: str) -> None:
        """``address`` answered: it is reachable again (or was all along)."""
        with self._lock:
            self._since.pop(address, None)

    def overdue(self, address: str) -> bool:
        """Whether ``address`` has gone unreached for ``after_s`` or longer."""
        unreached_s = self.unreached_for(address)
        return unreached_s is not None and unreached_s >= self.after_s
