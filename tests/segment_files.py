"""Finding and damaging the batches in a range server's segment file (the corruption cases of
tests/client and integration/faults)."""

from __future__ import annotations

import os
from pathlib import Path

from sbp_spark.protocol.records import ENVELOPE_SIZE
from sbp_spark.server.storage.segment import STORAGE_HEADER_SIZE, unpack_storage_header


def only_segment(ranges_dir: Path, stream_id: int) -> Path:
    """The one segment file of range 0 of ``stream_id`` under a server's ``data/ranges``."""
    [segment] = sorted(Path(ranges_dir).glob(f"{stream_id}-0/*.seg"))
    return segment


def stored_batches(segment: Path) -> list[tuple[int, int, int]]:
    """(file position of the batch bytes, batch_length, base_offset) of each stored batch."""
    data = segment.read_bytes()
    out, pos = [], 0
    while pos + STORAGE_HEADER_SIZE <= len(data):
        fields = unpack_storage_header(data, pos)
        assert fields is not None, f"unreadable storage header at {pos} of {segment}"
        length, _crc, base, _count, _ts, _span = fields
        out.append((pos + fields[5], length, base))
        pos += fields[5] + length
    return out


def flip_body_byte(segment: Path, position: int, length: int) -> None:
    """Flip one byte in the middle of the body of the batch stored at ``position``."""
    at = position + ENVELOPE_SIZE + length // 2
    with open(segment, "r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())
