"""Streams the connector's options name by name, pattern or ``*``, turned into stream ids.

Options are parsed without I/O (``options.py``); what they name by name is looked up here,
on the driver, when a read is planned or a write starts: through a ``StreamDirectory`` (the
few calls of ``SbpClient`` this needs). The rest of the connector works with ids only, as the
wire does: a name is looked up once per read, write or discovery, never per record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from sbp_spark.protocol.errors import SbpError, StreamAlreadyExistsError, StreamNotFoundError

from .cluster_access import StreamMissingError
from .options import ReadOptions, StreamSelection, WriteOptions, check_positions

log = logging.getLogger(__name__)
# Stream ids a log line lists before it only counts the rest.
_LOGGED_IDS = 20


def _ids_text(ids: Sequence[int]) -> str:
    shown = ",".join(map(str, ids[:_LOGGED_IDS])) or "(none)"
    return shown if len(ids) <= _LOGGED_IDS else f"{shown},... ({len(ids)} streams)"


class Stream(Protocol):
    """What this module reads of a stream's metadata (the client's ``Stream``)."""

    @property
    def stream_id(self) -> int: ...

    @property
    def name(self) -> str: ...


class StreamDirectory(Protocol):
    """What resolving names asks of the cluster (``SbpClient``)."""

    def describe_streams(self, ids: Sequence[int | str]) -> Sequence[Stream]: ...

    def list_streams(self) -> Sequence[Stream]: ...


class StreamCreator(StreamDirectory, Protocol):
    """And, for ``createIfMissing`` by name, creating one (``SbpClient``)."""

    def create_stream(self, name: str = "", replicas: int = 1, retention_ms: int = -1
                      ) -> Stream: ...


def _missing(refs: Sequence[int | str], pd: Sequence[str], option: str) -> StreamMissingError:
    listed = ", ".join(repr(r) if isinstance(r, str) else str(r) for r in refs)
    plural = len(refs) > 1
    return StreamMissingError(
        f"stream{'s' if plural else ''} {listed} do{'' if plural else 'es'} not exist at pd "
        f"{','.join(pd)} (named in option '{option}'; list the streams with "
        "`sbp streams list`)")


def stream_ids(directory: StreamDirectory, refs: Sequence[int | str], pd: Sequence[str],
               option: str = "streams") -> list[int]:
    """The ids of ``refs`` (ids taken as they are, names looked up in one request), in order;
    ``StreamMissingError`` naming every name no live stream has."""
    names = [r for r in dict.fromkeys(refs) if isinstance(r, str)]
    found: dict[str, int] = {}
    if names:
        try:
            found = {s.name: s.stream_id for s in directory.describe_streams(names)}
        except StreamNotFoundError:
            missing = []
            for name in names:
                try:
                    (stream,) = directory.describe_streams([name])
                    found[name] = stream.stream_id
                except StreamNotFoundError:
                    missing.append(name)
            if missing:
                raise _missing(missing, pd, option) from None
    return list(dict.fromkeys(r if isinstance(r, int) else found[r] for r in refs))


def matching(directory: StreamDirectory, selection: StreamSelection, pd: Sequence[str]
             ) -> list[int]:
    """The ids a selection names now: for a pattern or ``*`` the live streams matching, in id
    order; otherwise its ids and names, in the order given."""
    if selection.dynamic:
        return [s.stream_id for s in directory.list_streams() if selection.matches(s.name)]
    return stream_ids(directory, selection.refs, pd)


def resolve_read(directory: StreamDirectory, options: ReadOptions) -> ReadOptions:
    """``options`` with the ids of the streams its selection names now (as given when it
    named ids only); positions per stream are checked against them (a pattern's streams come
    and go, so positions of streams it does not match now are kept unused)."""
    selection = options.selection
    if selection is None:
        return options
    resolved = replace(options, streams=tuple(matching(directory, selection,
                                                       options.client.pd)))
    if not selection.dynamic:
        check_positions(resolved)
    log.info("sbp: %s are streams %s", selection.describe(), _ids_text(resolved.streams))
    return resolved


class Discovery:
    """The streams of a dynamic selection while a streaming query runs: listed again when
    asked at least ``interval_ms`` after the last listing (``clock``: seconds), else the last
    answer. A listing that fails after one succeeded keeps the last answer (new streams are
    found at the next listing that works): the streams already read go on meanwhile."""

    def __init__(self, selection: StreamSelection, interval_ms: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.selection = selection
        self.interval_s = interval_ms / 1000
        self._clock = clock
        self._found: list[int] | None = None
        self._at = 0.0

    def streams(self, directory: StreamDirectory, pd: Sequence[str]) -> list[int]:
        """The matching streams' ids, in id order."""
        now = self._clock()
        if self._found is None or now - self._at >= self.interval_s:
            try:
                found = matching(directory, self.selection, pd)
            except SbpError as exc:
                if self._found is None:
                    raise
                log.warning("sbp: could not look for new streams matching %s (%s); going on "
                            "with the %d found before", self.selection.describe(), exc,
                            len(self._found))
                self._at = now
                return list(self._found)
            if self._found is not None:
                new = sorted(set(found) - set(self._found))
                if new:
                    log.info("sbp: %s now also matches streams %s", self.selection.describe(),
                             _ids_text(new))
            self._found, self._at = found, now
        return list(self._found)


def write_target(directory: StreamCreator, options: WriteOptions) -> tuple[int, bool]:
    """(the id of the write's ``stream`` option, whether this call created it). A name no
    stream has is created with it under ``createIfMissing`` (a create that loses a race to
    another writer of that name finds the winner's stream); otherwise it, or an id that does
    not exist, raises ``StreamMissingError``."""
    ref = options.stream
    assert ref is not None
    pd = options.client.pd
    if isinstance(ref, int):
        try:
            directory.describe_streams([ref])
        except StreamNotFoundError:
            raise _missing([ref], pd, "stream") from None
        return ref, False
    return named_stream(directory, ref, options, lambda: _missing([ref], pd, "stream"))


def named_stream(directory: StreamCreator, name: str, options: WriteOptions,
                 missing: Callable[[], Exception]) -> tuple[int, bool]:
    """(the id of the stream named ``name``, whether this call created it): created under
    ``createIfMissing`` when no stream has the name (losing a race to another writer of the
    name finds the winner's stream), else ``missing()`` is raised."""
    try:
        return directory.describe_streams([name])[0].stream_id, False
    except StreamNotFoundError:
        if not options.create_if_missing:
            raise missing() from None
    try:
        created = directory.create_stream(name, replicas=options.replicas,
                                          retention_ms=options.retention_ms)
    except StreamAlreadyExistsError:
        return directory.describe_streams([name])[0].stream_id, False
    log.warning("sbp write: created stream %d named %r (replicas=%d, retentionMs=%d)",
                created.stream_id, name, options.replicas, options.retention_ms)
    return created.stream_id, True


def route_ids(directory: StreamDirectory, options: WriteOptions) -> tuple[int, ...] | None:
    """The ids of the streams rows may route to (option ``streams`` of a write), or None."""
    if options.routes is None:
        return None
    return tuple(stream_ids(directory, options.routes, options.client.pd))


__all__ = ["Discovery", "StreamCreator", "StreamDirectory", "matching", "named_stream",
           "resolve_read", "route_ids", "stream_ids", "write_target"]
