"""The part a handler's dispatch asks, once per request, whether its principal may have it
served: the opcode's rule (``rules.RULES``) against the permissions (``acl.AclTable``).

A refusal is ``PermissionDeniedError`` naming the principal, the operation, the stream and the
permission missing. Superusers pass every rule; servers pass the server rules and read and
write every stream (they store and forward its data); an opcode without a rule is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from sbp_spark.protocol.constants import opcode_name
from sbp_spark.protocol.errors import PermissionDeniedError, StreamNotFoundError

from .acl import CREATE, READ, STREAM_OPERATIONS, WRITE, AclTable
from .principals import Principal
from .rules import ANYONE, RULES, SELF, SERVER, SUPERUSER, Need, Rule


class StreamNames(Protocol):
    """What the PD knows of streams' names (the metadata store); a range server has none."""

    def name_of(self, stream_id: int) -> str: ...

    def id_of(self, name: str) -> int: ...


class Authorizer:
    """Checks requests of ``role`` (``rules.PD`` or ``rules.RANGE_SERVER``) against the
    permissions ``acl()`` returns now (a cheap call: the owner keeps the table current)."""

    def __init__(self, role: str, acl: Callable[[], AclTable],
                 names: StreamNames | None = None,
                 rules: dict[int, Rule] | None = None) -> None:
        self.role = role
        self._acl = acl
        self._names = names
        self._rules = RULES if rules is None else rules

    @property
    def version(self) -> int:
        """The version of the permissions checked against now."""
        return self._acl().version

    def authorize(self, principal: Principal | None, opcode: int, request: Any
                  ) -> list[Need]:
        """Return, when ``principal`` may have ``request`` (of ``opcode``) served here, what
        the request needs (for ``recheck``); raise ``PermissionDeniedError`` saying what is
        missing."""
        if principal is None:  # a server that does not authenticate: no principals
            return []
        rule = self._rules.get(opcode)
        if rule is None:
            raise PermissionDeniedError(
                f"principal {principal.name!r} may not send {opcode_name(opcode)}: this "
                f"{self.role} has no permission rule for it, and refuses what it cannot check")
        needs = rule(request, self.role)
        self.recheck(principal, opcode, needs)
        return needs

    def recheck(self, principal: Principal | None, opcode: int, needs: list[Need]) -> None:
        """``PermissionDeniedError`` unless ``principal`` still meets ``needs`` (what a request
        of ``opcode`` needed when it was let through)."""
        if principal is None or principal.superuser:
            return
        table = self._acl()
        for need in needs:
            if not self._meets(principal, need, table):
                raise PermissionDeniedError(self._refusal(principal, opcode, need))

    def readable(self, principal: Principal | None, stream_id: int, name: str = "") -> bool:
        """Whether ``principal`` may see the stream in a listing (any permission on it)."""
        if principal is None or principal.superuser or principal.server:
            return True
        table = self._acl()
        return any(table.allows(principal.name, op, stream_id, name)
                   for op in STREAM_OPERATIONS)

    def _meets(self, principal: Principal, need: Need, table: AclTable) -> bool:
        for operation in need.operations:
            if operation == ANYONE:
                return True
            if operation == SERVER:
                if principal.server:
                    return True
            elif operation == SUPERUSER:
                if principal.superuser:
                    return True
            elif operation == SELF:
                if need.principal == principal.name:
                    return True
            elif operation == CREATE:
                if table.allows(principal.name, CREATE):
                    return True
            elif principal.server and operation in (READ, WRITE):
                return True  # servers store and forward every stream's data
            elif self._allows(principal, operation, need, table):
                return True
        return False

    def _allows(self, principal: Principal, operation: str, need: Need,
                table: AclTable) -> bool:
        stream_id, name = need.stream_id, need.name
        if table.names_streams and self._names is not None:
            # Entries may name the stream by its name: learn the name (or the id) it has.
            try:
                if stream_id is None and name:
                    stream_id = self._names.id_of(name)
                elif stream_id is not None and not name:
                    name = self._names.name_of(stream_id)
            except StreamNotFoundError:
                pass
        return table.allows(principal.name, operation, stream_id, name)

    def _refusal(self, principal: Principal, opcode: int, need: Need) -> str:
        what = opcode_name(opcode)
        who = f"principal {principal.name!r}"
        roles = [op for op in need.operations if op in (SERVER, SUPERUSER, SELF)]
        perms = [op for op in need.operations if op not in roles]
        if need.stream_id is not None or need.name:
            stream = (f"stream {need.stream_id}" if need.stream_id is not None
                      else f"stream {need.name!r}")
            missing = " or ".join(repr(p) for p in perms)
            return (f"{who} may not {what} on {stream}: it needs the {missing} permission on "
                    f"{stream} (or on '*'); a superuser grants it with `sbp acl grant`")
        if perms == [CREATE]:
            return (f"{who} may not {what}: it needs the 'create' permission (`sbp acl grant "
                    f"--principal {principal.name} --operations create`)")
        if SELF in roles:
            return (f"{who} may not {what} for principal {need.principal!r}: only its own, "
                    f"unless it is a superuser")
        if roles == [SUPERUSER]:
            return f"{who} may not {what}: only superusers may (--superusers)"
        return (f"{who} may not {what}: only a principal with the server role may (a range "
                f"server or a PD: a token with role server, or a superuser)")


__all__ = ["Authorizer", "StreamNames"]
