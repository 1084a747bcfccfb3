"""Who a connection speaks for: a principal's name and the roles that come with it."""

from __future__ import annotations

from dataclasses import dataclass

# The role a token claims for a range server or a PD (``sbp token create --role server``).
SERVER_ROLE = "server"
ROLES = (SERVER_ROLE,)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated peer. ``server``: it may act as a range server or a PD (register,
    heartbeat, report metrics, forward APPENDs, call range servers for the PD); a server
    reads and writes every stream, which it stores. ``superuser``: it may do everything,
    change permissions included."""

    name: str
    server: bool = False
    superuser: bool = False

    def __str__(self) -> str:
        return self.name


__all__ = ["ROLES", "SERVER_ROLE", "Principal"]
