"""Whether a writer should stop waiting for the primary of its stream's open range.

A writer whose primary does not answer (no answer to its APPEND, nor to a PING, nor a
connection) first asks the PD whether the server is still the range's primary: a stopped or
dead server is failed over by the PD within seconds, and the writer follows. But the PD may
hear a server the writer cannot reach (a broken link between the two only), and then nothing
is failed over: the writer would wait for the network to heal. ``PrimaryReach`` keeps, per
server, since when this writer has not reached it; once that lasts
``ClientConfig.unreachable_primary_s``, the writer asks the PD to seal the range (SEAL_RANGES
of that range) and goes on in the next one, which the PD places away from the sealed range's
primary. The seal is the PD's ordinary one, so it ends the range where its replicas agree and
keeps every acknowledged record (``docs/reliability.md``, "Partitions").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sbp_spark.protocol.errors import SbpError, SbpTimeoutError, TransportError


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

    def unreached(self, address: str) -> float:
        """Note that ``address`` was not reached now; seconds since it was first not reached
        (without an answer in between)."""
        now = self._clock()
        with self._lock:
            return now - self._since.setdefault(address, now)

    def reached(self, address: str) -> None:
        """``address`` answered: it is reachable again (or was all along)."""
        with self._lock:
            self._since.pop(address, None)

    def overdue(self, address: str) -> bool:
        """Whether ``address`` has gone unreached for ``after_s`` or longer."""
        now = self._clock()
        with self._lock:
            since = self._since.get(address)
        return since is not None and now - since >= self.after_s
