"""The check that servers with TLS can call each other before they start.

The servers call each other (range server to PD, PD to range servers, primaries to
secondaries) presenting their own certificate and checking the other's like any client does.
A certificate that fails there does not stop a server from starting: its calls fail, retried
forever, and a cluster never forms (``sbp server`` gave up after a minute, saying only that a
range server did not register). So the settings are refused at once, naming the problem.
"""

from __future__ import annotations

from ..transport.tls import TlsConfig, peer_call_problem


def check_peer_tls(tls: TlsConfig | None, host: str | None, what: str) -> None:
    """Raise ``ValueError`` when servers with ``tls``'s files could not call ``what`` at
    ``host`` (the host its peers dial; None: not checked)."""
    if tls is None:
        return
    problem = peer_call_problem(tls, host)
    if problem:
        raise ValueError(f"{what}: the servers could not call each other with the TLS "
                         f"certificate {tls.cert_file!r}: {problem}")
