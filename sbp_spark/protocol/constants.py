"""Fixed numbers of the SBP wire format (docs/wire.md: Framing, Limits, Opcodes and roles)."""

from __future__ import annotations

from enum import IntEnum, IntFlag

MAGIC = 23
HEADER_FORMAT_FLATBUFFERS = 1

# Bytes before the extended header: length(4) magic(1) opcode(2) flags(1) stream_id(4)
# header_format(1) header_length(3).
FIXED_HEADER_SIZE = 16
CHECKSUM_SIZE = 4

# frame_length counts magic..header_length (12 bytes) plus the 4-byte checksum trailer, so an
# empty frame is 16.
MIN_FRAME_LENGTH = 16
# The protocol's ceiling: peers may lower it, never raise it. It bounds what one frame can make a
# receiver buffer.
MAX_FRAME_LENGTH = 16 * 1024 * 1024
# header_length is a u24.
MAX_HEADER_LENGTH = (1 << 24) - 1
# Stream ids are non-negative as signed 32-bit numbers.
MAX_STREAM_ID = (1 << 31) - 1
# Stream.replica_nums is a signed byte on the wire.
MAX_REPLICAS = 127
# Largest record batch: a batch is never split across frames, so it must fit in one frame with
# the fixed header and an extended header; 4 KiB is far more than an APPEND or FETCH header
# describing one batch needs.
MAX_BATCH_BYTES = MAX_FRAME_LENGTH - FIXED_HEADER_SIZE - 4096
# Requests one connection may have in flight at a server before the server stops reading it
# until one is answered (backpressure): a PING sent behind that many waits for an answer too.
MAX_INFLIGHT_PER_CONNECTION = 64


class Opcode(IntEnum):
    PING = 0x0001
    GOAWAY = 0x0002
    HEARTBEAT = 0x0003
    ALLOCATE_ID = 0x0004
    AUTHENTICATE = 0x0005  # ours: docs/wire.md, "Who may do what"
    APPEND = 0x1001
    FETCH = 0x1002
    LOOKUP_SEQUENCES = 0x1003  # ours: idempotent appends
    LIST_RANGES = 0x2001
    SEAL_RANGES = 0x2002
    SYNC_RANGES = 0x2003
    CREATE_RANGE = 0x2004
    DESCRIBE_RANGES = 0x2005
    CREATE_STREAMS = 0x3001
    DELETE_STREAMS = 0x3002
    UPDATE_STREAMS = 0x3003
    DESCRIBE_STREAMS = 0x3004
    TRIM_STREAMS = 0x3005
    REPORT_METRICS = 0x4001
    DESCRIBE_PD_CLUSTER = 0x4002
    # Ours: named consumers (schemas/consumers.fbs), served by the PD.
    JOIN_CONSUMER = 0x6001
    COMMIT_CONSUMER = 0x6002
    DESCRIBE_CONSUMERS = 0x6003
    DELETE_CONSUMERS = 0x6004
    # Ours: permissions (docs/wire.md, "Who may do what").
    GRANT_PERMISSIONS = 0x5001
    REVOKE_PERMISSIONS = 0x5002
    DESCRIBE_PERMISSIONS = 0x5003


KNOWN_OPCODES = frozenset(int(op) for op in Opcode)


def opcode_name(opcode: int) -> str:
    """``APPEND`` for a known opcode, ``opcode 0x7777`` for any other (for messages)."""
    try:
        return Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode:#06x}"


class Flags(IntFlag):
    NONE = 0
    RESPONSE = 0x01
    END = 0x02
    SYSTEM_ERROR = 0x04


RESPONSE_END = Flags.RESPONSE | Flags.END
