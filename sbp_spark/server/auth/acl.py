"""Permissions granted: who may do which operation on which stream, as the PD keeps them.

An entry grants one principal one operation: ``read`` (FETCH; LIST_RANGES, DESCRIBE_RANGES and
DESCRIBE_STREAMS of the stream), ``write`` (APPEND, and the seal or new range a writer needs),
``admin`` (UPDATE, TRIM, DELETE and SEAL of the stream) on one stream (its id, its name, or
``*`` for every stream), or ``create`` (CREATE_STREAMS) for the whole cluster. Superusers and
servers are roles of principals (``principals.py``), not entries.

``AclTable`` is one version of the whole table, immutable, answering ``allows`` without I/O;
a stream named by name in an entry is matched through the name the caller knows for the
stream, or, on a range server, the id the PD resolved the name to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sbp_spark.protocol.names import name_problem

READ, WRITE, ADMIN, CREATE = "read", "write", "admin", "create"
STREAM_OPERATIONS = (READ, WRITE, ADMIN)
OPERATIONS = (*STREAM_OPERATIONS, CREATE)
EVERY_STREAM = "*"


@dataclass(frozen=True, slots=True, order=True)
class AclEntry:
    """``principal`` may do ``operation`` on ``stream`` (an id in digits, a name, ``*``; ""
    for ``create``, which is cluster-wide)."""

    principal: str
    operation: str
    stream: str = ""

    def problem(self) -> str | None:
        """Why the entry cannot be granted, or None."""
        if not self.principal or self.principal != self.principal.strip():
            return f"principal {self.principal!r} is not a name"
        if self.operation not in OPERATIONS:
            return (f"operation {self.operation!r} is not known: use "
                    f"{', '.join(OPERATIONS)}")
        if self.operation == CREATE:
            return None if not self.stream else "create is cluster-wide: it names no stream"
        if not self.stream:
            return f"{self.operation} needs streams: ids, names or '*'"
        if self.stream == EVERY_STREAM or self.stream.isdigit():
            return None
        problem = name_problem(self.stream)
        return None if problem is None else f"stream {self.stream!r}: {problem}"

    def __str__(self) -> str:
        where = "" if self.operation == CREATE else f" on stream {self.stream}"
        return f"{self.principal}: {self.operation}{where}"


class AclTable:
    """One version of the permissions, immutable. ``resolved``: for entries naming a stream
    by name, the id that name had when the table was made (what a range server, which knows
    streams by id only, matches)."""

    __slots__ = ("version", "entries", "resolved", "_names_of", "names_streams", "_keys")

    def __init__(self, version: int = 0, entries: Iterable[AclEntry] = (),
                 resolved: Mapping[str, int] | None = None) -> None:
        self.version = version
        self.entries = frozenset(entries)
        # Looked up on every request: plain tuples hash and compare faster than the entries.
        self._keys = frozenset((e.principal, e.operation, e.stream) for e in self.entries)
        self.resolved = dict(resolved or {})
        names_of: dict[int, set[str]] = {}
        for name, stream_id in self.resolved.items():
            names_of.setdefault(stream_id, set()).add(name)
        self._names_of = names_of
        #: Whether an entry names a stream by name (then a check needs the stream's name).
        self.names_streams = any(e.stream and e.stream != EVERY_STREAM
                                 and not e.stream.isdigit() for e in self.entries)

    @classmethod
    def of(cls, version: int, entries: Iterable[AclEntry],
           resolved: Mapping[str, int] | None = None) -> AclTable:
        return cls(version, entries, resolved)

    def __repr__(self) -> str:
        return f"AclTable(version={self.version}, {len(self.entries)} entries)"

    def allows(self, principal: str, operation: str, stream_id: int | None = None,
               name: str = "") -> bool:
        """Whether an entry lets ``principal`` do ``operation`` on the stream ``stream_id``
        (of name ``name``, when known; None for ``create``)."""
        keys = self._keys
        if operation == CREATE:
            return (principal, CREATE, "") in keys
        if stream_id is not None and stream_id >= 0 and \
                (principal, operation, str(stream_id)) in keys:
            return True
        if (principal, operation, EVERY_STREAM) in keys:
            return True
        if not self.names_streams:
            return False
        names = set(self._names_of.get(stream_id, ())) if stream_id is not None else set()
        if name:
            names.add(name)
        return any((principal, operation, n) in keys for n in names)


__all__ = ["ADMIN", "CREATE", "EVERY_STREAM", "OPERATIONS", "READ", "STREAM_OPERATIONS",
           "WRITE", "AclEntry", "AclTable"]
