"""Hand-written codecs for the per-frame headers of the data path (APPEND and FETCH).

They write the same FlatBuffers format as ``_flatbuf`` (tests check both against flatc's
generated readers and builders), with layouts fixed in advance so a whole header is one
``struct`` call:

- ``AppendRequest``: the entries are a vector of 16-byte structs, packed in one go. Only a
  request without ``committed_offset`` (every client append) has this layout; a forward that
  sets it is written and read by the generic codec.
- ``AppendResponse``, ``FetchResponse``, ``FetchRequest``: the root table, then a vector of
  offsets, then the item tables at a fixed stride, every scalar written (defaults too) so all
  items share one vtable. Items whose status is not OK use a second vtable that also names
  the status, whose table goes after all the items.

Decoding goes through the generic verifying decoder, except the item vectors: items sharing a
vtable (the normal case) are read with one precomputed ``struct`` each, and an item with any
other vtable falls back to the generic table reader. Every bound is checked as in
``_flatbuf``.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from itertools import chain, repeat, starmap
from operator import attrgetter, itemgetter
from typing import Any

from ._flatbuf import (
    SCALAR,
    TABLE,
    Codec,
    Field,
    HeaderError,
    _charge,
    _scalar_groups,
    _State,
    _vector_span,
    encode_error,
)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_ENCODE_ERRORS = (struct.error, TypeError, AttributeError, OverflowError)
# Structs for up to this many items are compiled once and kept; larger (rare) headers build a
# throw-away one, so a peer cannot fill the cache with huge compiled formats.
_CACHED_COUNTS = 256


def _align(n: int, to: int) -> int:
    return n + (-n % to)


class _Items:
    """Fixed layout of one item table type (scalars, then optionally a trailing status)."""

    def __init__(self, codec: Codec, ok: Any) -> None:
        fields = codec.fields
        self.codec = codec
        self.cls = codec.cls
        self.ok = ok
        self.has_status = fields[-1].kind == TABLE
        scalars = fields[:-1] if self.has_status else fields
        if not all(f.kind == SCALAR and f.convert is None for f in scalars):
            raise AssertionError(f"{codec.name} is not a flat table")
        layout = codec._layout((1 << len(fields)) - 1)
        self.tbl_len = layout.tbl_len
        self.stride = _align(layout.tbl_len, layout.align)
        vt_err = struct.unpack(f"<{len(layout.vtable) // 2}H", layout.vtable)
        self.vt_err = vt_err
        self.vt_ok = vt_err[:-1] + (0,) if self.has_status else vt_err
        self.status_off = vt_err[-1] if self.has_status else 0
        # Row = soffset + scalars in offset order, padded to the stride.
        row = layout.struct.format.lstrip("<")
        self.row_fmt = row + f"{self.stride - layout.struct.size}x"
        by_offset = [scalars[i].name for i in layout.scalar_order]
        self.getter = attrgetter(*by_offset)
        # Where each slot's value sits among a row's scalars (which are in offset order).
        self.slot_columns = [layout.scalar_order.index(i) for i in range(len(scalars))]
        # The scalar run of a row as the generic plan describes it, to recognise our layout.
        offsets = vt_err[2:2 + len(scalars)]
        (start, run, _), = _scalar_groups(sorted(
            (off, i, f) for i, (off, f) in enumerate(zip(offsets, scalars, strict=True))))
        self.canonical = (start, run.format)
        self.status_getter = attrgetter("status") if self.has_status else None
        # Reading: the scalars of one item in slot order, from the row's struct values.
        self._read_plans: dict[bytes, tuple | None] = {}
        self.nscalars = len(scalars)

    def rows_struct(self, n: int) -> struct.Struct:
        """The struct of ``n`` consecutive rows."""
        if n > _CACHED_COUNTS:
            return struct.Struct("<" + self.row_fmt * n)
        return self._cached_rows(n)

    @lru_cache(maxsize=64)  # noqa: B019 - three _Items objects live for the whole process
    def _cached_rows(self, n: int) -> struct.Struct:
        return struct.Struct("<" + self.row_fmt * n)

    def fill(self, out: bytearray, pos: int, items: list, vt_ok_pos: int, vt_err_pos: int
             ) -> list[tuple[int, Any]]:
        """Pack ``items`` as rows from ``pos``; return (status field position, status) of the
        items whose status must be written after the rows."""
        getter = self.getter
        values: list[int] = []
        errors = []
        stride = self.stride
        if self.has_status:
            ok = self.ok
            status_of = self.status_getter
            row = pos
            for item in items:
                status = status_of(item)
                if status is ok or status is None or not (
                        status.code or status.message or status.detail):
                    values.append(row - vt_ok_pos)
                else:
                    values.append(row - vt_err_pos)
                    errors.append((row + self.status_off, status))
                values.extend(getter(item))
                row += stride
        else:
            soff = pos - vt_ok_pos
            for fields in map(getter, items):
                values.append(soff)
                values.extend(fields)
                soff += stride
        self.rows_struct(len(items)).pack_into(out, pos, *values)
        return errors

    # -- reading -------------------------------------------------------------------------

    def _read_plan(self, buf: Any, size: int, vt: int) -> tuple | None:
        """(tbl_len, start, struct, reorder, status_off) when every scalar of the item is in
        one non-overlapping run described by this vtable; None to use the generic reader."""
        plan = self.codec._plan(buf, size, vt)  # validates the vtable
        key = bytes(buf[vt:vt + _U16.unpack_from(buf, vt)[0]])
        cached = self._read_plans.get(key, False)
        if cached is not False:
            return cached
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

    def read_vector(self, buf: Any, size: int, pos: int, f: Field, state: _State) -> list:
        """Reader of a vector of these items (installed on the root codec's field)."""
        n = _vector_span(buf, size, pos, f, 4)
        _charge(state, 4 + 4 * n)
        base = pos + 4
        offsets = struct.unpack_from(f"<{n}I", buf, base)
        if n:
            items = self._read_rows(buf, size, base, offsets, state)
            if items is not None:
                return items
        return self._read_each(buf, size, base, offsets, f, state)

    def _read_rows(self, buf: Any, size: int, base: int, offsets: tuple, state: _State
                   ) -> list | None:
        """All items in one struct call when they are laid out as this module writes them
        (consecutive rows, one shared vtable, no status); None otherwise."""
        n = len(offsets)
        stride = self.stride
        first = offsets[0]
        if offsets != tuple(range(first, first + (stride - 4) * n, stride - 4)):
            return None
        start = base + first
        if start + stride * n > size:
            return None
        values = self.rows_struct(n).unpack_from(buf, start)
        width = self.nscalars + 1
        soff = values[0]
        if values[0::width] != tuple(range(soff, soff + stride * n, stride)):
            return None
        vt = start - soff
        if not 0 <= vt <= size - 4:
            return None
        plan = self._read_plan(buf, size, vt)
        if plan is None or plan[4] or (plan[1], plan[2].format) != self.canonical:
            return None
        tbl_len = plan[0]
        if start + stride * (n - 1) + tbl_len > size:  # as strict as the per-item check
            return None
        _charge(state, tbl_len * n)
        columns = [values[1 + c::width] for c in self.slot_columns]
        if self.has_status:
            columns.append(repeat(self.ok, n))
        return list(map(self.cls, *columns))

    def _read_each(self, buf: Any, size: int, base: int, offsets: tuple, f: Field,
                   state: _State) -> list:
        out = []
        append = out.append
        cls = self.cls
        ok = self.ok
        has_status = self.has_status
        status_codec = self.codec.fields[-1].sub if has_status else None
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
                if status_off:
                    spos = tpos + status_off
                    status = status_codec.read(buf, size, spos + _U32.unpack_from(buf, spos)[0],
                                               state)
                else:
                    status = ok
                append(cls(*values, status))
            else:
                append(cls(*values))
        return out


class _RootWithItems:
    """Root table {slot 0: int, slot 1: int or status, slot 2: [item]} in a fixed layout:
    root offset, root vtable, item vtables, root table, offset vector, item rows, tail."""

    def __init__(self, codec: Codec, items: _Items, second_is_status: bool,
                 status_codec: Codec) -> None:
        self.codec = codec
        self.items = items
        self.second_is_status = second_is_status
        self.status_codec = status_codec
        self.getter = attrgetter(*[f.name for f in codec.fields])
        nvt = len(items.vt_ok)
        self.vt_ok_pos = 14
        self.vt_err_pos = 14 + 2 * nvt
        head_end = self.vt_err_pos + 2 * nvt
        self.table_pos = _align(head_end, 4)
        self.vec_pos = self.table_pos + 16
        self.head = struct.Struct(
            f"<I5H{nvt}H{nvt}H{self.table_pos - head_end}xiiiII")
        self.head_prefix = (self.table_pos, 10, 16, 4)
        self.head_vts = (12, *items.vt_ok, *items.vt_err)
        self.head_table = (self.table_pos - 4,)
        # Reading our own layout: the constant part of the head after the second slot.
        self.head_fixed = self.head_vts + self.head_table
        self.vec_uoff = self.vec_pos - (self.table_pos + 12)
        self.vec_field = codec.fields[2]

    def read_root(self, buf: Any, size: int, state: _State) -> Any:
        """Decode a header in the layout ``encode`` writes (one struct call for the root);
        None for any other layout."""
        if size < self.head.size:
            return None
        values = self.head.unpack_from(buf, 0)
        fixed = self.head_fixed
        if values[:4] != self.head_prefix or values[5:5 + len(fixed)] != fixed \
                or values[-2] != self.vec_uoff or values[4] not in (0, 8):
            return None
        first, second = values[-4], values[-3]
        entries = self.items.read_vector(buf, size, self.vec_pos, self.vec_field, state)
        if self.second_is_status:
            second = self.items.ok
            if values[4]:
                spos = self.table_pos + 8
                second = self.status_codec.read(buf, size, spos + _U32.unpack_from(buf, spos)[0],
                                                state)
        elif not values[4]:
            second = 0
        return self.codec.cls(first, second, entries)

    def encode(self, msg: Any) -> bytes:
        try:
            return self._encode(msg)
        except _ENCODE_ERRORS as exc:
            raise encode_error(self.codec, msg, exc) from None

    def _encode(self, msg: Any) -> bytes:
        first, second, entries = self.getter(msg)
        items = self.items
        n = len(entries)
        vec = self.vec_pos
        rows = _align(vec + 4 + 4 * n, 8)
        out = bytearray(rows + items.stride * n)
        status = None
        if self.second_is_status:
            if second is not None and second is not items.ok and (
                    second.code or second.message or second.detail):
                status = second
            second_slot = 8 if status is not None else 0
            second_value = 0
        else:
            second_slot = 8
            second_value = second
        self.head.pack_into(out, 0, *self.head_prefix, second_slot, *self.head_vts,
                            *self.head_table, first, second_value, vec - (self.table_pos + 12),
                            n)
        step = items.stride - 4
        first_off = rows - (vec + 4)
        struct.pack_into(f"<{n}I", out, vec + 4,
                         *range(first_off, first_off + step * n, step))
        errors = items.fill(out, rows, entries, self.vt_ok_pos, self.vt_err_pos)
        if status is not None:
            errors.append((self.table_pos + 8, status))
        write = self.status_codec.write
        for field_pos, item_status in errors:
            child = write(out, item_status)
            _U32.pack_into(out, field_pos, child - field_pos)
        return bytes(out)


# AppendRequest: root offset, vtable (8 bytes: 2 slots), table {soffset, timeout_ms, vector
# offset}, 4 bytes so the structs start 8-aligned, vector length, 16-byte entries.
_APPEND_REQUEST_HEAD = (12, 8, 12, 4, 8, 8)
_APPEND_REQUEST_READ = struct.Struct("<I4HiiI4xI")
_STRUCT_CODEC_FMT = struct.Struct("<qii")  # AppendEntry


def _append_request_struct(n: int) -> struct.Struct:
    if n > _CACHED_COUNTS:
        return struct.Struct("<I4HiiI4xI" + "qii" * n)
    return _cached_append_request_struct(n)


@lru_cache(maxsize=64)
def _cached_append_request_struct(n: int) -> struct.Struct:
    return struct.Struct("<I4HiiI4xI" + "qii" * n)


def install(*, AppendRequest: type, AppendEntry: type, AppendResponse: type,
            AppendResult: type, FetchRequest: type, FetchEntry: type, FetchResponse: type,
            FetchResult: type, Status: type, OK: Any, codecs: dict[str, Codec]) -> None:
    """Give the four data-path message classes their hand-written encoders and item readers."""
    append_request_codec = codecs["AppendRequest"]
    entry_fields = attrgetter("stream_id", "request_index", "batch_length")

    generic_encode = append_request_codec.encode

    def encode_append_request(msg: Any) -> bytes:
        if msg.committed_offset != -1:
            # A primary's forward (one per secondary per frame): the generic layout, which
            # also writes the third slot. The fast reader below sees its longer vtable and
            # leaves it to the generic reader.
            return generic_encode(msg)
        try:
            entries = msg.append_requests
            values = list(chain.from_iterable(map(entry_fields, entries)))
            return _append_request_struct(len(entries)).pack(
                *_APPEND_REQUEST_HEAD, msg.timeout_ms, 8, len(entries), *values)
        except _ENCODE_ERRORS as exc:
            raise encode_error(append_request_codec, msg, exc) from None

    AppendRequest.to_flatbuffers = encode_append_request
    entry_struct = _STRUCT_CODEC_FMT

    def read_append_request(buf: Any, size: int, state: _State) -> Any:
        if size < 32:
            return None
        head = _APPEND_REQUEST_READ.unpack_from(buf, 0)
        if head[:6] != _APPEND_REQUEST_HEAD or head[7] != 8:
            return None
        n = head[8]
        if 32 + 16 * n > size:
            return None  # the generic reader names the problem
        entries = list(starmap(AppendEntry, entry_struct.iter_unpack(buf[32:32 + 16 * n])))
        return AppendRequest(head[6], entries)

    append_request_codec.fast_root = read_append_request

    for root_name, item_name, second_is_status in (
            ("AppendResponse", "AppendResult", True),
            ("FetchResponse", "FetchResult", True),
            ("FetchRequest", "FetchEntry", False)):
        root_codec = codecs[root_name]
        items = _Items(codecs[item_name], OK)
        root_codec.fields[2].reader = items.read_vector
        encoder = _RootWithItems(root_codec, items, second_is_status, codecs["Status"])
        root_codec.cls.to_flatbuffers = _method(encoder.encode)
        root_codec.fast_root = encoder.read_root


def _method(encode: Any) -> Any:
    def to_flatbuffers(self: Any) -> bytes:
        return encode(self)

    to_flatbuffers.__doc__ = "This message as a FlatBuffers root table (hand-written layout)."
    return to_flatbuffers
