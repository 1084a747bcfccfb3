"""Recycled receive buffers for ``FrameDecoder(allocate=...)`` (sans-IO: no sockets, no threads).

Large frames' bodies are received into buffers of their own. A fresh ``bytearray`` costs a memset
and, once the allocator has handed freed memory back to the kernel, a page fault per 4 KiB:
measured at a quarter to a third of a receiver's CPU per byte. ``ReceiveBuffers`` hands a body
buffer out again once nothing references its bytes any more. Client connections and the
server's connection readers both use it.
"""

from __future__ import annotations

from .frame import RECEIVE_CHUNK

# Receive buffers one decoder keeps for reuse (sum of their capacities).
RECYCLE_BYTES = 32 * 1024 * 1024
# A buffer can grow this much in place (it is allocated with 1/8 headroom) from a shared zero
# source; larger growth takes a new buffer.
_ZEROS = bytes(RECEIVE_CHUNK)


class ReceiveBuffers:
    """Allocator for ``FrameDecoder(allocate=...)`` that reuses a body buffer once no view of
    it is alive any more.

    A bytearray refuses to change size while a memoryview of it exists (``BufferError``), and
    every frame handed to a caller is a view: so a buffer that can be resized is one nobody
    reads any more. Not thread-safe: only the decoder's owner (one reader thread) calls it.
    """

    def __init__(self, budget: int = RECYCLE_BYTES) -> None:
        if budget < 0:
            raise ValueError(f"ReceiveBuffers budget={budget} must be >= 0")
        self.budget = budget
        self._buffers: list[tuple[bytearray, int]] = []  # (buffer, capacity), oldest first
        self._held = 0
        self.reused = 0

    def __call__(self, n: int) -> bytearray:
        for buf, cap in self._buffers:
            if cap // 2 <= n <= cap and _claim(buf, n):
                self.reused += 1
                return buf
        cap = n + (n >> 3)
        buf = bytearray(cap)
        del buf[n:]  # within the allocation: keeps the headroom
        self._buffers.append((buf, cap))
        self._held += cap
        while self._held > self.budget and len(self._buffers) > 1:
            # Forgetting a buffer only drops this reference: views still alive keep it.
            _, old_cap = self._buffers.pop(0)
            self._held -= old_cap
        return buf


def _claim(buf: bytearray, n: int) -> bool:
    """Resize ``buf`` to ``n`` bytes if no view of it is alive (else leave it alone)."""
    size = len(buf)
    try:
        if n < size:
            del buf[n:]
        elif n - size <= len(_ZEROS):
            # Also the probe when n == size: growing fails while a view exists.
            buf += memoryview(_ZEROS)[:n - size + 1]
            del buf[n:]
        else:
            return False
    except BufferError:
        return False
    return True
