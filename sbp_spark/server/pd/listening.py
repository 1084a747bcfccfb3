"""Whether a process listens at a range server's address: the PD's own evidence that a silent
server is dead, which heartbeats alone give only after the liveness timeout.

A killed process's port refuses connections at once (the kernel answers the handshake with a
reset), while a stopped process's kernel still takes them, and a partition drops them with no
answer: only a refusal says "no process is there". The failover needs no more (its safety never
depended on timing: a replica that is in fact alive is fenced by the seal like any other), and
it saves the writers the rest of the liveness timeout, or a new leader's grace period, when a
range server and the PD leader die together.

The probe connects and closes at once, sending nothing: a server that was only quiet and takes
it sees a peer that left without a frame (behind TLS, a handshake that did not happen, which it
counts and logs at INFO). The PD probes only servers that missed a heartbeat, so that is rare.
"""

from __future__ import annotations

import socket

from sbp_spark.client.connection import parse_address

# How long one probe waits for the handshake: a refusal comes back in a round trip; a
# partition or a stopped host answers nothing, and the probe gives up (no evidence).
PROBE_TIMEOUT_S = 0.2


def refuses_connections(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when a TCP connection to ``address`` is refused: nothing listens there. Any other
    outcome (accepted, timed out, unreachable, a name that does not resolve) is no evidence,
    and False."""
    try:
        host, port = parse_address(address)
    except ValueError:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
