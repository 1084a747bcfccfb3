"""Whose turn it is to read a connection's socket: the threads waiting for answers, in turn,
and a background reader only once they have been quiet for a while.

A dedicated reader thread would hand every answer to the thread waiting for it: one more
wake-up of a sleeping thread per answer, which on a two-vCPU machine was a fifth of a small
request's round trip (0.32 against 0.26 ms, APPEND of 1 KiB, nothing else running). Instead a
thread that waits for an answer and finds the socket free reads it itself, dispatching any
other request's frames it meets on the way; a thread that finds another one reading waits for
its frames (or for its turn) on its own queue. This is the leader/followers pattern.

The connection's background thread still reads when nobody waits: answers to requests no one
is waiting for yet (a writer keeping frames in flight while it sends more must not leave the
peer blocked on a full socket), a GOAWAY or a PING from the server, the end of the connection,
idleness. It takes the turn only after ``quiet_s`` without a waiting caller, and gives it back
as soon as one comes, so a busy caller's answers never go through it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from queue import SimpleQueue

# A queue item meaning "the socket may be free: try to take the turn" (never a frame).
YOUR_TURN = object()


class ReadTurn:
    """The read turn of one connection. Every method takes ``lock`` (the connection's)."""

    def __init__(self, lock: threading.RLock, quiet_s: float) -> None:
        self.quiet_s = quiet_s
        self._lock = lock
        self._changed = threading.Condition(lock)  # closing, and the turn put down after it
        self._reading = False  # somebody holds the turn
        self._callers = 0  # threads inside ``Connection._next_item`` (waiting or reading)
        self._quiet_since = time.monotonic()  # when the last of them left
        self._waiting: deque[SimpleQueue] = deque()  # queues of callers waiting, oldest first
        self._closing = False

    # -- callers -----------------------------------------------------------------------------

    def enter(self) -> None:
        """A caller starts waiting for an answer."""
        with self._lock:
            self._callers += 1

    def leave(self) -> None:
        """That caller has its answer (or gave up)."""
        with self._lock:
            self._callers -= 1
            if not self._callers:
                self._quiet_since = time.monotonic()

    def take_or_wait(self, queue: SimpleQueue) -> bool:
        """Take the turn (True: read now, then ``put_down``), or, when another thread holds it,
        register ``queue`` to be told when it is put down (False: wait on the queue, then call
        ``stop_waiting``)."""
        with self._lock:
            if not self._reading:
                self._reading = True
                return True
            self._waiting.append(queue)
            return False

    def stop_waiting(self, queue: SimpleQueue) -> None:
        """The caller of ``queue`` stopped waiting (an item came, or its time ran out). A turn
        it was offered and did not take goes to the next waiting caller."""
        with self._lock:
            try:
                self._waiting.remove(queue)
            except ValueError:
                pass  # it was offered the turn: pass the offer on if the turn is still free
            if not self._reading:
                self._offer()

    def put_down(self) -> None:
        """The holder stops reading; the longest waiting caller is offered the turn."""
        with self._lock:
            self._reading = False
            self._offer()
            if self._closing:
                # Only ``take_for_good`` waits for this. The background reader, parked while
                # callers read, looks again on its own every ``quiet_s``: waking it at every
                # answer would cost the very wake-up this class is here to save.
                self._changed.notify_all()

    def _offer(self) -> None:
        if self._waiting:
            self._waiting.popleft().put(YOUR_TURN)

    # -- the background reader ---------------------------------------------------------------

    def take_when_quiet(self) -> bool:
        """Block until no caller has waited for ``quiet_s`` and the turn is free, then take it;
        False (without the turn) once ``close`` was called."""
        with self._lock:
            while not self._closing:
                if self._reading or self._callers:
                    self._changed.wait(self.quiet_s)
                    continue
                left = self._quiet_since + self.quiet_s - time.monotonic()
                if left <= 0:
                    self._reading = True
                    return True
                self._changed.wait(left)
            return False

    @property
    def callers(self) -> int:
        """Callers waiting for answers now (the background reader yields to them)."""
        return self._callers

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background reader from taking the turn again."""
        with self._lock:
            self._closing = True
            self._changed.notify_all()

    def take_for_good(self) -> None:
        """Wait until nobody reads, and keep the turn: the sockets may be closed now."""
        with self._lock:
            while self._reading:
                self._changed.wait()
            self._reading = True
