"""Hand-written codecs for the per-frame headers of the data path (APPEND and FETCH).

A message class picks one with ``CODEC_TYPE`` (see ``messages``); ``build_codecs`` builds it
from the generated schema tables like any codec, and ``link`` derives its fixed layout from
the generic codec's own layout rules, so a schema change moves both together. They write the
same FlatBuffers format as ``_flatbuf`` (tests check both against flatc's generated readers
and builders), with layouts fixed in advance so a whole header is one ``struct`` call:

- ``PackedEntriesCodec`` (``AppendRequest``): the entries are a vector of 16-byte structs,
  packed in one go. Only a request without ``committed_offset``, ``range_index`` and
  ``cap_notice`` (every client append) has this layout; a primary's forward or cap notice is
  written and read by the generic code. Entries sent as tables instead of structs are
  recognised and refused, naming the problem.
- ``RowsCodec`` (``AppendResponse``, ``FetchResponse``, ``FetchRequest``): the root table,
  then a vector of offsets, then the item tables at a fixed stride, every scalar written
  (defaults too) so all items share one vtable. Every status is written (the schemas mark it
  required): items and root whose status is OK all point at one shared empty Status table
  after the rows; other statuses follow it, one table each.

Decoding goes through the generic verifying decoder, except the root of the layout written
here and the item vectors: items sharing a vtable (the normal case) are read with one
precomputed ``struct``, and an item with any other vtable falls back to the generic table
reader. Every bound is checked as in ``_flatbuf``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from itertools import chain, repeat, starmap
from operator import attrgetter, itemgetter
from typing import Any, NamedTuple

from ._flatbuf import (
    SCALAR,
    TABLE,
    VEC_SCALAR,
    VEC_STRUCT,
    VEC_TABLE,
    Codec,
    Field,
    HeaderError,
    _charge,
    _read_vec_struct,
    _scalar_groups,
    _State,
    _vector_span,
    encode_error,
)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_VT_HEAD = struct.Struct("<HH")
_ENCODE_ERRORS = (struct.error, TypeError, AttributeError, OverflowError)
# Structs for up to this many items are compiled once and kept; larger (rare) headers build a
# throw-away one, so a peer cannot fill the cache with huge compiled formats.
_CACHED_COUNTS = 256
# The shared empty Status: its vtable (4 bytes: no fields, a 4-byte table), then the table
# (its soffset, 4, back to that vtable). Items point at the table, 4 bytes in.
_EMPTY_STATUS = struct.pack("<HHi", 4, 4, 4)


def _align(n: int, to: int) -> int:
    return n + (-n % to)


class _Repeated:
    """Structs of a fixed head followed by ``n`` rows, compiled once per ``n`` (up to
    ``_CACHED_COUNTS``; larger, rare, counts get a throw-away one)."""

    __slots__ = ("head", "row", "_by_count")

    def __init__(self, head: str, row: str) -> None:
        self.head = head
        self.row = row
        self._by_count: dict[int, struct.Struct] = {}

    def __call__(self, n: int) -> struct.Struct:
        compiled = self._by_count.get(n)
        if compiled is None:
            compiled = struct.Struct("<" + self.head + self.row * n)
            if n <= _CACHED_COUNTS:
                self._by_count[n] = compiled
        return compiled


_PROGRESSIONS: dict[tuple[int, int, int], tuple[int, ...]] = {}


def _progression(start: int, step: int, n: int) -> tuple[int, ...]:
    """``tuple(range(start, start + step * n, step))``, remembered: the readers compare a
    column of a header with the one it has when written here, and headers repeat."""
    key = (start, step, n)
    found = _PROGRESSIONS.get(key)
    if found is None:
        found = tuple(range(start, start + step * n, step))
        if len(_PROGRESSIONS) >= 256:
            _PROGRESSIONS.clear()
        _PROGRESSIONS[key] = found
    return found


# -- APPEND request ---------------------------------------------------------------------------

# Root offset, vtable (8 bytes: 2 slots), table {soffset, timeout_ms, vector offset}, 4 bytes so
# the structs start 8-aligned, vector length, then the 16-byte entries.
_APPEND_REQUEST_HEAD = (12, 8, 12, 4, 8, 8)
_APPEND_REQUEST_FMT = "I4HiiI4xI"
_APPEND_REQUEST_READ = struct.Struct("<" + _APPEND_REQUEST_FMT)
_append_request_struct = _Repeated(_APPEND_REQUEST_FMT, "qii")
_ENTRIES_POS = 28  # where the vector (its length) sits in that layout

# An idempotent client append (``producers`` set, nothing else of a forward): root offset,
# vtable (16 bytes: 6 slots, slots 2-4 absent), table {soffset, timeout_ms, entries offset,
# producers offset}, then the entries vector (length, 16-byte structs, 8-aligned), 4 bytes of
# padding, the producers vector (length, 16-byte structs, 8-aligned).
_PRODUCED_VTABLE = (16, 16, 4, 8, 0, 0, 0, 12)
_PRODUCED_FMT = "I8HiiIII"
_PRODUCED_READ = struct.Struct("<" + _PRODUCED_FMT)
_PRODUCED_BASE = 48  # header bytes besides 32 per entry
_PRODUCERS_PAD = struct.Struct("<4xI")
_PRODUCED_ROOT = (20, *_PRODUCED_VTABLE, 16)  # the root offset, vtable and soffset
_ONE_ENTRY = struct.Struct("<qii")  # an AppendEntry, or a ProducerSequence: the same layout
_produced_structs: dict[int, struct.Struct] = {}


def _produced_struct(n: int) -> struct.Struct:
    """The whole idempotent append header of ``n`` entries as one struct."""
    compiled = _produced_structs.get(n)
    if compiled is None:
        compiled = struct.Struct("<" + _PRODUCED_FMT + "qii" * n + "4xI" + "qii" * n)
        if n <= _CACHED_COUNTS:
            _produced_structs[n] = compiled
    return compiled


_ONE_PRODUCED = _produced_struct(1)


def entries_sent_as_tables(buf: Any, size: int, pos: int, n: int,
                           own: Sequence[tuple[int, int]] = ()) -> str | None:
    """Why the ``n``-element vector at ``pos`` holds offsets to tables rather than AppendEntry
    structs, or None when it does not look like that. ``own``: the spans (start, end) of the
    message's other parts (its root, the tables and vectors its other fields refer to), where
    no entry table can be.

    A table vector holds one 4-byte offset per element, each pointing past the offsets to a
    table whose vtable is valid and describes at least one and at most AppendEntry's three
    fields (an entry table that sets no field would hold no batch). Real struct entries do not
    pass this: an entry's first word is its stream id's low half, so a second element (the
    high half) points back into the offsets; and with one entry, the only vtables such an
    offset can reach in the packed layout describe no field (stream 8, request_index 32
    reached the root's own vtable-shaped bytes before that was required), and in the generic
    layout the only tables after the entries are the message's own (stream 24 reached the cap
    notice's table, which has AppendEntry's shape, before those were left out; stream 56
    reached bytes inside the producers vector that read as a table, before every other
    part's whole span was left out)."""
    base = pos + 4
    if n == 0 or base + 4 * n > size:
        return None
    for i in range(n):
        at = base + 4 * i
        target = at + _U32.unpack_from(buf, at)[0]
        if target < base + 4 * n or target & 3 or target + 4 > size \
                or any(start <= target < end for start, end in own):
            return None
        vt = target - _I32.unpack_from(buf, target)[0]
        if vt < 0 or vt + 4 > size:
            return None
        vt_len, tbl_len = _VT_HEAD.unpack_from(buf, vt)
        if not 6 <= vt_len <= 10 or vt_len & 1 or vt + vt_len > size or tbl_len < 4 \
                or target + tbl_len > size:
            return None
        slots = struct.unpack_from(f"<{(vt_len - 4) // 2}H", buf, vt + 4)
        if not any(slots) or any(off and (off < 4 or off >= tbl_len) for off in slots):
            return None
    return (f"append_requests holds {n} offset(s) to tables, but AppendEntry is a struct: "
            "each entry is 16 bytes inside the vector (stream_id: long at 0, request_index: "
            "int at 8, batch_length: int at 12; schemas/data.fbs, docs/wire.md)")


class PackedEntriesCodec(Codec):
    """``AppendRequest`` (timeout_ms, [AppendEntry] structs, committed_offset, range_index,
    cap_notice):
    client appends as one packed struct; the table-instead-of-struct mistake refused by
    name."""

    def link(self, codecs: dict[str, Codec]) -> None:
        entries = self.fields[1]
        if entries.kind != VEC_STRUCT or entries.sub.struct.format != "<qii":
            raise AssertionError(f"{self.name}.{entries.name} is not the 16-byte struct vector "
                                 "this codec packs")
        if [f.name for f in self.fields] != ["timeout_ms", "append_requests",
                                               "committed_offset", "range_index",
                                               "cap_notice", "producers"]:
            raise AssertionError(f"{self.name} is not the table this codec packs")
        self._entry_cls = entries.sub.cls
        self._entry_unpack = entries.sub.struct.iter_unpack
        self._entry_fields = attrgetter(*entries.sub.names)
        entries.reader = self._read_entries
        producers = self.fields[5]
        if producers.kind != VEC_STRUCT or producers.sub.struct.format != "<qii":
            raise AssertionError(f"{self.name}.{producers.name} is not the 16-byte struct "
                                 "vector this codec packs")
        self._producer_cls = producers.sub.cls
        self._producer_unpack = producers.sub.struct.iter_unpack
        self._producer_fields = attrgetter(*producers.sub.names)

    def encode(self, msg: Any) -> bytes:
        if msg.committed_offset != -1 or msg.range_index != -1 or msg.cap_notice is not None:
            # A primary's forward or cap notice (one per secondary): the generic layout, which
            # also writes the later slots. The fast reader sees its longer vtable and leaves
            # it to the generic reader.
            return super().encode(msg)
        if msg.producers:
            return self._encode_produced(msg)
        try:
            entries = msg.append_requests
            values = list(chain.from_iterable(map(self._entry_fields, entries)))
            return _append_request_struct(len(entries)).pack(
                *_APPEND_REQUEST_HEAD, msg.timeout_ms, 8, len(entries), *values)
        except _ENCODE_ERRORS as exc:
            raise encode_error(self, msg, exc) from None

    def _encode_produced(self, msg: Any) -> bytes:
        """An idempotent client append, in the one layout written for it."""
        try:
            entries, producers = msg.append_requests, msg.producers
            n = len(entries)
            if len(producers) != n:  # not a client's append: the generic layout writes it
                return super().encode(msg)
            if n == 1:  # a lone writer's append: no iterators
                e, p = entries[0], producers[0]
                return _ONE_PRODUCED.pack(
                    20, *_PRODUCED_VTABLE, 16, msg.timeout_ms, 8, 28, 1, e.stream_id,
                    e.request_index, e.batch_length, 1, p.producer_id, p.sequence,
                    p.range_index)
            return _produced_struct(n).pack(
                20, *_PRODUCED_VTABLE, 16, msg.timeout_ms, 8, 12 + 16 * n, n,
                *chain.from_iterable(map(self._entry_fields, entries)), n,
                *chain.from_iterable(map(self._producer_fields, producers)))
        except _ENCODE_ERRORS as exc:
            raise encode_error(self, msg, exc) from None

    def _read_produced(self, buf: Any, size: int) -> Any:
        """The layout ``_encode_produced`` writes, or None for any other."""
        head = _PRODUCED_READ.unpack_from(buf, 0)
        n = head[13]
        mid = 40 + 16 * n  # where the producers vector's padding starts
        if head[:10] != _PRODUCED_ROOT or head[11] != 8 or head[12] != 12 + 16 * n or \
                _PRODUCED_BASE + 32 * n > size or _PRODUCERS_PAD.unpack_from(buf, mid)[0] != n:
            return None
        if n == 1:  # a lone writer's append: no iterators
            entries = [self._entry_cls(*_ONE_ENTRY.unpack_from(buf, 40))]
            producers = [self._producer_cls(*_ONE_ENTRY.unpack_from(buf, 64))]
        else:
            entries = list(starmap(self._entry_cls, self._entry_unpack(buf[40:mid])))
            producers = list(starmap(self._producer_cls, self._producer_unpack(
                buf[mid + 8:mid + 8 + 16 * n])))
        return self.cls(head[10], entries, producers=producers)

    def read_root(self, buf: Any, size: int, state: _State) -> Any:
        if size >= _PRODUCED_BASE and _U32.unpack_from(buf, 0)[0] == 20:
            produced = self._read_produced(buf, size)
            if produced is not None:
                return produced
        if size >= 32:
            head = _APPEND_REQUEST_READ.unpack_from(buf, 0)
            n = head[8]
            if head[:6] == _APPEND_REQUEST_HEAD and head[7] == 8 and 32 + 16 * n <= size:
                entries = list(starmap(self._entry_cls, self._entry_unpack(
                    buf[32:32 + 16 * n])))
                # A table vector's first offset (read as a struct: the low half of the first
                # stream id) points past the n offsets to a table inside the buffer.
                if n and 4 * n <= (entries[0].stream_id & 0xFFFFFFFF) <= size - 36:
                    self._refuse_tables(buf, size, _ENTRIES_POS, n)
                return self.cls(head[6], entries)
        return super().read_root(buf, size, state)

    def _read_entries(self, buf: Any, size: int, pos: int, f: Field, state: _State) -> list:
        if pos + 4 <= size:
            self._refuse_tables(buf, size, pos, _U32.unpack_from(buf, pos)[0],
                                self._own_spans(buf, size, f))
        return _read_vec_struct(buf, size, pos, f, state)

    def _own_spans(self, buf: Any, size: int, entries: Field) -> list[tuple[int, int]]:
        """The spans (start, end) of the root table and of the tables and vectors its fields
        other than ``entries`` refer to, as far as the buffer holds them (the generic reader
        checks the rest)."""
        root = _U32.unpack_from(buf, 0)[0]
        if root + 4 > size:
            return []
        spans = [(root, root + _table_len(buf, size, root))]
        vt = root - _I32.unpack_from(buf, root)[0]
        if not (0 <= vt and vt + 4 <= size):
            return spans
        vt_len = _VT_HEAD.unpack_from(buf, vt)[0]
        for i, field in enumerate(self.fields):
            slot = vt + 4 + 2 * i
            if field is entries or field.kind not in (TABLE, VEC_STRUCT, VEC_SCALAR) \
                    or 4 + 2 * i + 2 > vt_len or slot + 2 > size:
                continue
            off = _U16.unpack_from(buf, slot)[0]
            if not off or root + off + 4 > size:
                continue
            at = root + off + _U32.unpack_from(buf, root + off)[0]
            if at + 4 > size:
                continue
            if field.kind == TABLE:
                spans.append((at, at + _table_len(buf, size, at)))
            else:
                item = field.sub.struct.size if field.kind == VEC_STRUCT else field.size
                spans.append((at, at + 4 + item * _U32.unpack_from(buf, at)[0]))
        return spans

    @staticmethod
    def _refuse_tables(buf: Any, size: int, pos: int, n: int,
                       own: Sequence[tuple[int, int]] = ()) -> None:
        problem = entries_sent_as_tables(buf, size, pos, n, own)
        if problem is not None:
            raise HeaderError(problem)


def _table_len(buf: Any, size: int, at: int) -> int:
    """The inline size of the table at ``at`` as its vtable gives it (at least 4)."""
    vt = at - _I32.unpack_from(buf, at)[0]
    if vt < 0 or vt + 4 > size:
        return 4
    return max(4, _VT_HEAD.unpack_from(buf, vt)[1])


# -- vectors of flat item tables ---------------------------------------------------------------


class _Items:
    """Fixed layout of one item table type (scalars, then optionally a trailing status)."""

    def __init__(self, codec: Codec, status_codec: Codec) -> None:
        fields = codec.fields
        self.codec = codec
        self.cls = codec.cls
        self.status_codec = status_codec
        self.has_status = fields[-1].kind == TABLE
        # An item without a written status reads as the class's default (the shared OK).
        self.ok = fields[-1].default if self.has_status else None
        scalars = fields[:-1] if self.has_status else fields
        if not all(f.kind == SCALAR and f.convert is None for f in scalars):
            raise AssertionError(f"{codec.name} is not a flat table")
        self.nscalars = len(scalars)
        layout = codec._layout((1 << len(fields)) - 1)  # every field present
        self.tbl_len = layout.tbl_len
        self.stride = _align(layout.tbl_len, layout.align)
        self.vtable = struct.unpack(f"<{len(layout.vtable) // 2}H", layout.vtable)
        # Row = soffset + scalars in offset order (+ the status offset, last), to the stride.
        row = layout.struct.format.lstrip("<")
        end = layout.struct.size
        self.status_off = self.vtable[-1] if self.has_status else 0
        if self.has_status:
            if self.status_off < end:
                raise AssertionError(f"{codec.name}: status is not the last field of a row")
            row += f"{self.status_off - end}xI" if self.status_off > end else "I"
            end = self.status_off + 4
        self.row_fmt = row + f"{self.stride - end}x"
        self.rows_struct = _Repeated("", self.row_fmt)  # n -> the struct of n rows
        self.width = 1 + self.nscalars + self.has_status  # values per row
        self.getter = attrgetter(*[scalars[i].name for i in layout.scalar_order])
        # Where each slot's value sits among a row's scalars (which are in offset order).
        self.slot_columns = [layout.scalar_order.index(i) for i in range(self.nscalars)]
        # The scalar run of a row as the generic plan describes it, to recognise our layout.
        offsets = self.vtable[2:2 + self.nscalars]
        (start, run, _), = _scalar_groups(sorted(
            (off, i, f) for i, (off, f) in enumerate(zip(offsets, scalars, strict=True))))
        self.canonical = (start, run.format)
        self.status_getter = attrgetter("status")  # read only when has_status
        self._read_plans: dict[bytes, tuple | None] = {}

    def fill(self, out: bytearray, pos: int, items: list, vt_pos: int, shared_status: int
             ) -> list[tuple[int, Any]]:
        """Pack ``items`` as rows from ``pos``, their tables using the vtable at ``vt_pos``
        and OK statuses pointing at ``shared_status``; return (status field position, status)
        of the items whose own status must be written after the rows."""
        getter = self.getter
        values: list[int] = []
        append = values.append
        extend = values.extend
        stride = self.stride
        soff = pos - vt_pos
        if not self.has_status:
            for fields in map(getter, items):
                append(soff)
                extend(fields)
                soff += stride
            self.rows_struct(len(items)).pack_into(out, pos, *values)
            return []
        errors = []
        ok = self.ok
        status_of = self.status_getter
        # An OK status's offset: from the row's status field to the shared table, one
        # stride shorter for each row.
        uoff = shared_status - (pos + self.status_off)
        for item in items:
            append(soff)
            extend(getter(item))
            status = status_of(item)
            if status is ok or status is None or not (
                    status.code or status.message or status.detail):
                append(uoff)
            else:
                append(0)
                errors.append((shared_status - uoff, status))
            soff += stride
            uoff -= stride
        self.rows_struct(len(items)).pack_into(out, pos, *values)
        return errors

    # -- reading -------------------------------------------------------------------------

    def status_at(self, buf: Any, size: int, pos: int, state: _State) -> Any:
        """The Status table at ``pos``: the shared OK for an empty one laid out as written
        here (its vtable just before it), else whatever the generic reader finds."""
        if 4 <= pos and pos + 4 <= size and buf[pos - 4:pos + 4] == _EMPTY_STATUS:
            _charge(state, 8)
            return self.ok
        return self.status_codec.read(buf, size, pos, state)

    def _read_plan(self, buf: Any, size: int, vt: int) -> tuple | None:
        """(tbl_len, start, struct, reorder, status_off) when every scalar of the item is in
        one non-overlapping run described by this vtable; None to use the generic reader."""
        plan = self.codec._plan(buf, size, vt)  # validates the vtable
        key = bytes(buf[vt:vt + _U16.unpack_from(buf, vt)[0]])
        if key in self._read_plans:
            return self._read_plans[key]
        fast = None
        if (len(plan.groups) == 1 and not plan.factories and not plan.converts
                and len(plan.groups[0][2]) == self.nscalars
                and all(i == self.nscalars for i, _, _ in plan.refs)):
            start, st, idxs = plan.groups[0]
            reorder = itemgetter(*[idxs.index(i) for i in range(self.nscalars)])
            status_off = plan.refs[0][1] if plan.refs else 0
            fast = (plan.tbl_len, start, st, reorder, status_off)
        if len(self._read_plans) >= 64:
            self._read_plans.clear()
        self._read_plans[key] = fast
        return fast

    def read_vector(self, buf: Any, size: int, pos: int, f: Field, state: _State,
                    ok_at: int = -1) -> list:
        """Reader of a vector of these items (the root codec's field reader). ``ok_at``: where
        the caller already found an empty Status table, if it did."""
        n = _vector_span(buf, size, pos, f, 4)
        _charge(state, 4 + 4 * n)
        base = pos + 4
        offsets = struct.unpack_from(f"<{n}I", buf, base)
        if n:
            items = self._read_rows(buf, size, base, offsets, state, ok_at)
            if items is not None:
                return items
        return self._read_each(buf, size, base, offsets, f, state)

    def _read_rows(self, buf: Any, size: int, base: int, offsets: tuple, state: _State,
                   ok_at: int) -> list | None:
        """All items in one struct call when they are laid out as this module writes them
        (consecutive rows, one shared vtable, one shared status); None otherwise."""
        n = len(offsets)
        stride = self.stride
        first = offsets[0]
        if offsets != _progression(first, stride - 4, n):
            return None
        start = base + first
        if start + stride * n > size:
            return None
        values = self.rows_struct(n).unpack_from(buf, start)
        width = self.width
        soff = values[0]
        if values[0::width] != _progression(soff, stride, n):
            return None
        vt = start - soff
        if not 0 <= vt <= size - 4:
            return None
        plan = self._read_plan(buf, size, vt)
        if plan is None or plan[4] != self.status_off or (plan[1], plan[2].format) \
                != self.canonical:
            return None
        tbl_len = plan[0]
        if start + stride * (n - 1) + tbl_len > size:  # as strict as the per-item check
            return None
        columns: list[Any] = [values[1 + c::width] for c in self.slot_columns]
        if self.has_status:
            uoffs = values[width - 1::width]
            if uoffs != _progression(uoffs[0], -stride, n):
                return None  # not one shared status: item by item
            _charge(state, tbl_len * n)
            target = start + self.status_off + uoffs[0]
            status = self.ok if target == ok_at else self.status_at(buf, size, target, state)
            columns.append(repeat(status, n))
        else:
            _charge(state, tbl_len * n)
        return list(map(self.cls, *columns))

    def _read_each(self, buf: Any, size: int, base: int, offsets: tuple, f: Field,
                   state: _State) -> list:
        out: list[Any] = []
        append = out.append
        cls = self.cls
        ok = self.ok
        has_status = self.has_status
        generic = self.codec.read
        last_vt = None
        plan = None
        for i, off in enumerate(offsets):
            tpos = base + 4 * i + off
            if tpos + 4 > size:
                raise HeaderError(f"{f.qualname}[{i}] table at {tpos} is outside the "
                                  f"{size}-byte header")
            vt = tpos - _I32.unpack_from(buf, tpos)[0]
            if vt != last_vt:
                plan = self._read_plan(buf, size, vt) if 0 <= vt <= size - 4 else None
                last_vt = vt
            if plan is None:
                append(generic(buf, size, tpos, state))
                continue
            tbl_len, start, st, reorder, status_off = plan
            if tpos + tbl_len > size:
                raise HeaderError(f"{f.qualname}[{i}] table at {tpos} ({tbl_len} bytes) "
                                  f"overruns the {size}-byte header")
            _charge(state, tbl_len)
            values = reorder(st.unpack_from(buf, tpos + start))
            if has_status:
                status = ok
                if status_off:
                    spos = tpos + status_off
                    status = self.status_at(buf, size, spos + _U32.unpack_from(buf, spos)[0],
                                            state)
                append(cls(*values, status))
            else:
                append(cls(*values))
        return out


class _Exact(NamedTuple):
    """A header layout ``RowsCodec.encode`` writes for a given item count, all statuses OK."""

    size: int
    mask: int  # the bits every such header has the same (all but the values)
    fixed: int  # what they are
    rows: int  # where the item rows start


_UNKNOWN: Any = object()
# Headers of up to this many items are matched byte for byte (``RowsCodec._exact_layout``).
_EXACT_COUNTS = 64
# Struct formats of the integer types, and the value whose bytes are all ones in each.
_INTEGER_FORMATS = frozenset("bBhHiIlLqQ")
_ONES = {fmt: struct.unpack("<" + fmt, b"\xff" * struct.calcsize("<" + fmt))[0]
         for fmt in _INTEGER_FORMATS}


class RowsCodec(Codec):
    """A root table {0: int, 1: int or Status, 2: [flat item table]} in one fixed layout:
    root offset, root vtable, item vtable(s), root table, offset vector, item rows, then the
    shared empty Status and any other statuses."""

    def link(self, codecs: dict[str, Codec]) -> None:
        first, second, vec = self.fields
        if first.kind != SCALAR or first.fmt != "i" or vec.kind != VEC_TABLE or \
                (second.kind != TABLE and second.fmt != "i"):
            raise AssertionError(f"{self.name} is not the root-with-items table this codec "
                                 "writes")
        self.items = items = _Items(vec.sub, codecs["Status"])
        vec.reader = items.read_vector
        self.second_is_status = second.kind == TABLE
        self.getter = attrgetter(first.name, second.name, vec.name)
        # Items with a status share one vtable. A FetchRequest keeps, as in earlier versions,
        # the same vtable twice (from when OK items used a vtable without the status): its
        # bytes stay those every released client sent.
        copies = 1 if items.has_status else 2
        nvt = len(items.vtable)
        self.vt_pos = 14
        head_end = self.vt_pos + 2 * nvt * copies
        self.table_pos = _align(head_end, 4)
        self.vec_pos = self.table_pos + 16
        # The second root field is a forward offset (unsigned) when it is the status.
        second_fmt = "I" if self.second_is_status else "i"
        self.head = struct.Struct(
            f"<I5H{nvt * copies}H{self.table_pos - head_end}xii{second_fmt}II")
        # Root offset, root vtable (3 slots, 16-byte table, fields at 4, 8, 12), item
        # vtable(s), the root's soffset: the same for every header of this type.
        self.head_fixed = (self.table_pos, 10, 16, 4, 8, 12, *items.vtable * copies,
                           self.table_pos - 4)
        self.vec_uoff = self.vec_pos - (self.table_pos + 12)
        self.status_field_pos = self.table_pos + 8
        self._first = struct.Struct("<i")
        self._first_second = struct.Struct("<ii")
        self._frames: dict[int, tuple[bytes, int, int]] = {}
        self._exact: dict[int, _Exact | None] = {}

    def read_root(self, buf: Any, size: int, state: _State) -> Any:
        """A header byte for byte as ``encode`` writes one whose statuses are all OK (every
        answer of a healthy cluster) in one comparison and two struct calls; other headers of
        the layout ``encode`` writes in one struct call for the root; any other layout through
        the generic reader."""
        vec = self.vec_pos
        if size >= vec + 4:
            n = _U32.unpack_from(buf, vec)[0]
            exact = self._exact.get(n, _UNKNOWN)
            if exact is _UNKNOWN:
                # Only for counts the header has room for, and few: each costs an encode.
                fits = n <= _EXACT_COUNTS and size >= vec + 4 + (4 + self.items.stride) * n
                exact = self._exact_layout(n) if fits else None
            if exact is not None and size == exact.size and \
                    int.from_bytes(buf, "little") & exact.mask == exact.fixed:
                return self._read_exact(buf, n, exact)
        if size >= self.head.size:
            values = self.head.unpack_from(buf, 0)
            fixed = self.head_fixed
            if values[:len(fixed)] == fixed and values[-2] == self.vec_uoff:
                first, second = values[-4], values[-3]
                ok_at = -1
                if self.second_is_status:
                    at = self.status_field_pos + second
                    if at + 4 <= size and buf[at - 4:at + 4] == _EMPTY_STATUS:
                        second, ok_at = self.items.ok, at  # items share it: known OK
                        _charge(state, 8)
                    else:
                        second = self.items.status_at(buf, size, at, state)
                entries = self.items.read_vector(buf, size, self.vec_pos, self.fields[2],
                                                 state, ok_at)
                return self.cls(first, second, entries)
        return super().read_root(buf, size, state)

    def _exact_layout(self, n: int) -> _Exact | None:
        """What every header of ``n`` items with OK statuses shares, byte for byte: the
        bytes ``encode`` writes whatever the values (found by encoding all-zero and all-ones
        values: the bits that differ are the values' own). None where that does not apply
        (a field type without an all-ones value). Remembered."""
        items = self.items
        scalars = items.codec.fields[:items.nscalars]
        formats = [f.fmt for f in scalars] + ["i"] + ([] if self.second_is_status else ["i"])
        exact = None
        if all(fmt in _INTEGER_FORMATS for fmt in formats):
            def message(ones: bool) -> Any:
                def value(fmt: str) -> int:
                    return _ONES[fmt] if ones else 0
                status = [items.ok] if items.has_status else []
                row = items.cls(*[value(f.fmt) for f in scalars], *status)
                second = items.ok if self.second_is_status else value("i")
                return self.cls(value("i"), second, [row] * n)

            zeros, ones = self._encode(message(False)), self._encode(message(True))
            size = len(zeros)
            varying = int.from_bytes(zeros, "little") ^ int.from_bytes(ones, "little")
            mask = ((1 << (8 * size)) - 1) ^ varying
            exact = _Exact(size, mask, int.from_bytes(zeros, "little") & mask,
                           self._frame(n)[1])
        self._exact[n] = exact
        return exact

    def _read_exact(self, buf: Any, n: int, exact: _Exact) -> Any:
        """The header ``exact`` matched: its values, at the places ``encode`` puts them."""
        items = self.items
        values = self.head.unpack_from(buf, 0)
        second = items.ok if self.second_is_status else values[-3]
        if not n:
            return self.cls(values[-4], second, [])
        rows = items.rows_struct(n).unpack_from(buf, exact.rows)
        width = items.width
        columns: list[Any] = [rows[1 + c::width] for c in items.slot_columns]
        if items.has_status:
            columns.append(repeat(items.ok, n))
        return self.cls(values[-4], second, list(map(items.cls, *columns)))

    def encode(self, msg: Any) -> bytes:
        try:
            return self._encode(msg)
        except _ENCODE_ERRORS as exc:
            raise encode_error(self, msg, exc) from None

    def _frame(self, n: int) -> tuple[bytes, int, int]:
        """For ``n`` items: the header with every part that depends only on ``n`` written
        (root offset, vtables, root table with first and second fields 0 and an OK status,
        the offset vector, zeroed rows, the shared empty Status), where the rows start, and
        where the shared Status table is. Remembered for up to ``_CACHED_COUNTS`` items."""
        found = self._frames.get(n)
        if found is not None:
            return found
        items = self.items
        vec = self.vec_pos
        rows = _align(vec + 4 + 4 * n, 8)
        rows_end = rows + items.stride * n
        shared = rows_end + 4  # the shared empty Status table (after its vtable)
        out = bytearray(rows_end + len(_EMPTY_STATUS) if items.has_status else rows_end)
        if items.has_status:
            out[rows_end:] = _EMPTY_STATUS
        second = shared - self.status_field_pos if self.second_is_status else 0
        self.head.pack_into(out, 0, *self.head_fixed, 0, second, self.vec_uoff, n)
        step = items.stride - 4
        first_off = rows - (vec + 4)
        struct.pack_into(f"<{n}I", out, vec + 4, *range(first_off, first_off + step * n, step))
        found = (bytes(out), rows, shared)
        if n <= _CACHED_COUNTS:
            self._frames[n] = found
        return found

    def _encode(self, msg: Any) -> bytes:
        first, second, entries = self.getter(msg)
        items = self.items
        template, rows, shared = self._frame(len(entries))
        out = bytearray(template)
        status = None
        if not self.second_is_status:
            self._first_second.pack_into(out, self.table_pos + 4, first, second)
        else:
            self._first.pack_into(out, self.table_pos + 4, first)
            if second is not None and second is not items.ok and (
                    second.code or second.message or second.detail):
                status = second
        errors = items.fill(out, rows, entries, self.vt_pos, shared)
        if status is not None:
            errors.append((self.status_field_pos, status))
        write = items.status_codec.write
        for field_pos, item_status in errors:
            child = write(out, item_status)
            _U32.pack_into(out, field_pos, child - field_pos)
        return bytes(out)
