"""The address a server tells clients to use, and the listening addresses it cannot tell them.

A PD hands out its own address and every range server's: clients then connect to exactly what
they were told. A server listening on every interface (``0.0.0.0``, ``::``) has no address of
its own to hand out: ``0.0.0.0:2380`` happens to reach a server on the client's own machine and
nothing anywhere else, so a cluster that advertised it would work in a one-machine test and
fail for every remote executor. Such a server must be told what to advertise: a whole address
(``advertise_addr``, ``host:port``, for a port mapped elsewhere, as in containers) or only a
host (``advertise_host``, with the port the server bound, for servers on free ports).
"""

from __future__ import annotations

import ipaddress
import socket

from ..client.connection import parse_address

# Hosts that mean "every interface" when listening (an empty host does too, for bind()).
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def format_address(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    """Whether listening on ``host`` means listening on every interface."""
    return host.strip() in _WILDCARD_HOSTS


def check_advertised(host: str, advertise_addr: str | None, advertise_host: str | None,
                     what: str, whole_address: bool = True) -> None:
    """Refuse settings under which ``what`` (a server, for messages) would advertise an address
    clients cannot use; ``ValueError`` names the problem (and the advertise address among the
    remedies when ``whole_address``: ``what`` takes one)."""
    if advertise_addr and advertise_host:
        raise ValueError(f"{what}: give an advertise address ({advertise_addr!r}) or an "
                         f"advertise host ({advertise_host!r}), not both")
    if advertise_addr:
        advertised, _ = parse_address(advertise_addr)
        if is_wildcard(advertised):
            raise ValueError(f"{what}: advertise address {advertise_addr!r} is not one clients "
                             f"can connect to: name this machine (a host name or an IP)")
    elif advertise_host:
        if is_wildcard(advertise_host) or not _is_host(advertise_host):
            raise ValueError(f"{what}: advertise host {advertise_host!r} must be a host name "
                             f"or an IP address clients can connect to (no port)")
    elif is_wildcard(host):
        remedy = "the host they should use (advertise host, --advertise-host)"
        if whole_address:
            remedy += " or a whole address (advertise address, --advertise-addr)"
        raise ValueError(f"{what}: listening on {host!r} (every interface) gives clients no "
                         f"address to connect to: also give {remedy}")


def _bare(host: str) -> str:
    """``host`` without the brackets an IPv6 literal may come in."""
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_host(text: str) -> bool:
    """A host name or an IP address (IPv6 bare or in brackets), with no port."""
    bare = _bare(text)
    try:
        ipaddress.ip_address(bare)
        return True
    except ValueError:
        return bool(bare) and ":" not in bare and not any(c.isspace() for c in bare)


def advertised(bound: tuple[str, int], advertise_addr: str | None,
               advertise_host: str | None) -> str:
    """What clients are told: the advertise address, else the advertise host with the bound
    port, else the bound address."""
    if advertise_addr:
        return advertise_addr
    host, port = bound
    return format_address(_bare(advertise_host) if advertise_host else host, port)


def advertised_host(host: str, advertise_addr: str | None,
                    advertise_host: str | None) -> str | None:
    """The host part of what a server listening on ``host`` will advertise (see
    ``advertised``), known before it binds: without an advertise setting that is the bound
    IP, so a host name is resolved as binding would. None when it does not resolve (binding
    then fails, saying so)."""
    if advertise_addr:
        return _bare(parse_address(advertise_addr)[0])
    if advertise_host:
        return _bare(advertise_host)
    bare = _bare(host)
    try:
        ipaddress.ip_address(bare)
        return bare
    except ValueError:
        pass
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    try:
        return str(socket.getaddrinfo(bare, None, family, socket.SOCK_STREAM)[0][4][0])
    except OSError:
        return None
