"""A FlatBuffers encoder and verifying decoder built from the schemas' generated tables.

``_generated/wire_tables.py`` (made by schemas/generate.py from flatc's parse of
``schemas/*.fbs``) gives every table's fields with their ids, types and defaults, and every
struct's layout. ``build_codecs`` joins those with the dataclasses of ``messages`` into
``Codec`` objects that write and read the standard FlatBuffers binary format, byte-compatible
with the code flatc generates (tests cross-check both directions). It refuses to build when a
dataclass and its table disagree (names, order, scalar defaults, enum numbers), so the schema,
the tables and the classes cannot drift apart.

Why not the generated code: the pure-Python FlatBuffers runtime trusts its input (a bad offset
raises IndexError or struct.error, a huge vector length makes a loop run for ever) and has no
verifier; it is also an order of magnitude slower. Here every offset, length and vtable is
checked against the buffer before it is used, and a work budget proportional to the buffer
size bounds the decoding of buffers whose offsets share sub-objects (a small buffer that
decodes to an exponential tree).

Layout written by the encoder (any valid layout is accepted by the decoder): the root offset,
then each table's vtable followed by the table, then the table's strings, vectors and child
tables, in field order. Children always follow their parent, so every unsigned offset points
forward as the format requires. Scalars equal to their default, empty strings, empty vectors
and absent tables are left out, as flatc's builders do; a table field the schema marks
``required`` (every ``status``) is always written.

A message class picks its codec with ``CODEC_TYPE`` (``Codec`` unless it says otherwise):
``_fastpath`` holds the hand-written layouts of the data path.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from enum import IntEnum
from itertools import starmap
from typing import Any

from .errors import HeaderError

# Field kinds.
SCALAR, STRING, BYTES, TABLE, VEC_TABLE, VEC_SCALAR, VEC_STRUCT = range(7)

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_VT_HEAD = struct.Struct("<HH")
_SIZES = {"b": 1, "B": 1, "?": 1, "h": 2, "H": 2, "i": 4, "I": 4, "q": 8, "Q": 8}
_RANGES = {
    "b": (-(1 << 7), (1 << 7) - 1),
    "B": (0, (1 << 8) - 1),
    "h": (-(1 << 15), (1 << 15) - 1),
    "i": (-(1 << 31), (1 << 31) - 1),
    "q": (-(1 << 63), (1 << 63) - 1),
}
_FBS_NAMES = {"b": "byte", "B": "ubyte", "?": "bool", "h": "short", "i": "int", "q": "long"}

# Decoding may visit at most this many bytes per byte of input (plus a constant). An honest
# buffer visits each byte about once; the factor leaves room for shared strings.
BUDGET_FACTOR = 4
BUDGET_BASE = 4096
# Distinct vtables remembered per codec; honest peers use a handful.
MAX_CACHED_PLANS = 64


# Struct formats of the schema's scalar types (the codec supports these; generate.py names them).
SCALAR_FORMATS = {"bool": "?", "byte": "b", "ubyte": "B", "short": "h", "int": "i",
                  "long": "q"}


class SchemaMismatch(RuntimeError):
    """A message class and the generated schema tables disagree (names, order, defaults...)."""


# A table field that must always be written compares unequal to every value.
_NEVER_OMIT = object()


class Field:
    """One resolved field of a table."""

    __slots__ = ("name", "slot", "kind", "fmt", "size", "default", "factory", "omit_value",
                 "sub", "convert", "qualname", "reader")

    def __init__(self, owner: str, name: str, slot: int, kind: int, fmt: str,
                 default: Any, factory: Callable[[], Any] | None, omit_value: Any, sub: Any,
                 convert: Callable[[int], Any] | None) -> None:
        self.name = name
        self.slot = slot
        self.kind = kind
        self.fmt = fmt
        self.size = _SIZES[fmt]
        self.default = default
        self.factory = factory
        # A table field equal to its default instance (Status(), RangeServer()) is left out.
        self.omit_value = omit_value
        self.sub = sub
        self.convert = convert
        self.qualname = f"{owner}.{name}"
        # Reads the field's target (offset kinds; set when codecs are linked); a codec may
        # give a hot vector its own.
        self.reader: Callable[..., Any] = _unlinked


def _unlinked(*args: Any) -> Any:
    raise AssertionError("a field was read before build_codecs linked its reader")


class StructCodec:
    """A FlatBuffers struct: fixed little-endian layout, no vtable."""

    __slots__ = ("name", "cls", "struct", "align", "names", "formats", "getter")

    def __init__(self, cls: type, fmt: str, align: int) -> None:
        self.name = cls.__name__
        self.cls = cls
        self.struct = struct.Struct("<" + fmt)
        self.align = align
        self.names = tuple(f.name for f in dataclasses.fields(cls))
        # Each field's own format, in order (``fmt`` may also hold padding).
        self.formats = [c for c in fmt if c.isalpha() and c != "x"]
        self.getter = _tuple_getter(list(self.names))

    @classmethod
    def from_schema(cls, name: str, msg_cls: type, spec: tuple) -> StructCodec:
        """The codec of struct ``name`` with the layout ``spec`` (alignment, size, fields)."""
        align, size, fields = spec
        names = [f[0] for f in fields]
        declared = list(getattr(msg_cls, "__dataclass_fields__", ()))
        if declared != names:
            raise SchemaMismatch(f"struct {name}: the class declares fields {declared}, the "
                                 f"schema {names}")
        fmt, pos = [], 0
        for fname, ftype, offset in fields:
            if ftype not in SCALAR_FORMATS:
                raise SchemaMismatch(f"struct {name}.{fname}: type {ftype} is not supported")
            if offset > pos:
                fmt.append(f"{offset - pos}x")
            fmt.append(SCALAR_FORMATS[ftype])
            pos = offset + _SIZES[SCALAR_FORMATS[ftype]]
        if size > pos:
            fmt.append(f"{size - pos}x")
        return cls(msg_cls, "".join(fmt), align)


class _Plan:
    """How to read tables that use one particular vtable."""

    __slots__ = ("tbl_len", "template", "factories", "groups", "converts", "refs")
    tbl_len: int
    template: list[Any]  # each field's value when absent
    factories: list[tuple[int, Callable[[], Any]]]  # absent fields that get a fresh default
    groups: list[tuple[int, struct.Struct, list[int]]]  # scalar runs: start, struct, fields
    converts: list[tuple[int, Callable[[int], Any]]]  # enum fields
    refs: list[tuple[int, int, Field]]  # offset fields: index, offset in the table, field


class _Layout:
    """How to write a table with one particular set of present fields."""

    __slots__ = ("vtable", "tbl_len", "align", "struct", "scalar_order", "refs")
    vtable: bytes
    tbl_len: int
    align: int
    struct: struct.Struct  # the soffset and every present scalar, in offset order
    scalar_order: list[int]  # for each scalar of that struct, its index among present values
    refs: list[tuple[int, Field, int]]  # offset fields: present index, field, offset


class Codec:
    """Encoder and decoder for one table type: the generic one, for any table of the schemas.

    Subclasses (``_fastpath``) write one fixed layout of their table and read it back in
    fewer steps, overriding ``encode`` and ``read_root``; any other layout goes through the
    generic code.
    """

    def __init__(self, cls: type, fields: list[Field]) -> None:
        self.name = cls.__name__
        self.cls = cls
        self.index = 0  # position among all codecs, set by build_codecs
        # Optional cross-field rule of the class (``_problem``): why an instance is invalid.
        self.check: Callable[[Any], str | None] | None = getattr(cls, "_problem", None)
        self.fields = fields
        self.nslots = len(fields)
        names = [f.name for f in fields]
        self.getter = (lambda obj: ()) if not names else _tuple_getter(names)
        self._plans: dict[bytes, _Plan] = {}
        self._layouts: dict[int, _Layout] = {}
        self._absent = [f.default for f in fields]
        self._absent_factories = [(i, f.factory) for i, f in enumerate(fields) if f.factory]

    # -- encoding ------------------------------------------------------------------------

    def encode(self, obj: Any) -> bytes:
        """The FlatBuffers bytes of ``obj`` as a root table."""
        out = bytearray(4)
        try:
            root = self.write(out, obj)
        except (struct.error, TypeError, AttributeError, UnicodeEncodeError, OverflowError) \
                as exc:
            raise encode_error(self, obj, exc) from None
        _U32.pack_into(out, 0, root)
        return bytes(out)

    def write(self, out: bytearray, obj: Any) -> int:
        """Append ``obj`` (vtable, table, then children) to ``out``; return the table's position."""
        if self.check is not None:
            problem = self.check(obj)
            if problem:
                raise ValueError(f"cannot encode {self.name}: {problem}")
        present = []
        mask = 0
        for f, v in zip(self.fields, self.getter(obj), strict=True):
            kind = f.kind
            if kind == SCALAR:
                if v == f.default:
                    continue
            elif kind == TABLE:
                if v is None or v == f.omit_value:
                    continue
            elif not v:
                continue
            present.append(v)
            mask |= 1 << f.slot
        layout = self._layouts.get(mask)
        if layout is None:
            layout = self._layouts[mask] = self._layout(mask)
        if len(out) & 1:
            out.append(0)
        vt_pos = len(out)
        out += layout.vtable
        pad = -len(out) % layout.align
        tpos = len(out) + pad
        out += bytes(pad + layout.tbl_len)
        layout.struct.pack_into(out, tpos, tpos - vt_pos,
                                *[present[i] for i in layout.scalar_order])
        for i, f, off in layout.refs:
            child = _WRITERS[f.kind](out, f, present[i])
            field_pos = tpos + off
            _U32.pack_into(out, field_pos, child - field_pos)
        return tpos

    def _layout(self, mask: int) -> _Layout:
        fields = [f for f in self.fields if mask >> f.slot & 1]  # slot order
        rank = {f.slot: i for i, f in enumerate(fields)}  # index among the present values
        inline = [(f, 4 if f.kind != SCALAR else f.size) for f in fields]
        # Offsets within the table: one 4-byte field right after the soffset when 8-byte
        # fields follow (no hole), then largest first, each aligned to its size.
        has8 = any(size == 8 for _, size in inline)
        order = sorted(inline, key=lambda fs: -fs[1])
        fours = [fs for fs in order if fs[1] == 4]
        if has8 and fours:
            order.remove(fours[0])
            order.insert(0, fours[0])
        offsets: dict[int, int] = {}
        pos = 4
        for f, size in order:
            pos += -pos % size
            offsets[f.slot] = pos
            pos += size
        nslots = (fields[-1].slot + 1) if fields else 0
        layout = _Layout()
        layout.tbl_len = pos
        layout.align = 8 if has8 else 4
        layout.vtable = struct.pack(f"<HH{nslots}H", 4 + 2 * nslots, pos,
                                    *(offsets.get(s, 0) for s in range(nslots)))
        # One struct writes the soffset and every scalar, in offset order; offset fields are
        # patched once their targets are written.
        fmt = ["<i"]
        cur = 4
        scalar_at = sorted((offsets[f.slot], f.slot, f) for f in fields if f.kind == SCALAR)
        for off, _, f in scalar_at:
            if off > cur:
                fmt.append(f"{off - cur}x")
            fmt.append(f.fmt)
            cur = off + f.size
        layout.struct = struct.Struct("".join(fmt))
        layout.scalar_order = [rank[slot] for _, slot, _ in scalar_at]
        layout.refs = [(rank[f.slot], f, offsets[f.slot]) for f in fields if f.kind != SCALAR]
        return layout

    # -- decoding ------------------------------------------------------------------------

    def decode(self, buf: Any) -> Any:
        """Verify and decode ``buf`` as a root table of this type; HeaderError if malformed."""
        if isinstance(buf, memoryview) and buf.itemsize != 1:
            buf = buf.cast("B")  # offsets count bytes, not items
        size = len(buf)
        if size < 8:
            raise HeaderError(f"{self.name}: {size} bytes cannot hold a FlatBuffers table")
        state = _State(size)
        try:
            return self.read_root(buf, size, state)
        except HeaderError as exc:
            raise HeaderError(f"{self.name}: {exc}") from None
        except (struct.error, IndexError, ValueError, TypeError, OverflowError,
                RecursionError) as exc:
            # Every bound is checked first; this is a safety net that keeps the promise that
            # malformed input only ever raises HeaderError.
            raise HeaderError(f"{self.name}: malformed header ({exc})") from None

    def link(self, codecs: dict[str, Codec]) -> None:
        """Called once every codec exists (and its fields are resolved): a subclass prepares
        what its layout needs from the codecs it nests."""

    def read_root(self, buf: Any, size: int, state: _State) -> Any:
        """Read the root table of a whole header (``decode`` checks and wraps errors)."""
        return self.read(buf, size, _U32.unpack_from(buf, 0)[0], state)

    def read(self, buf: Any, size: int, tpos: int, state: _State) -> Any:
        if tpos + 4 > size:
            raise HeaderError(f"{self.name} table at {tpos} is outside the {size}-byte header")
        vt = tpos - _I32.unpack_from(buf, tpos)[0]
        key = (vt << 8) | self.index
        plan = state.plans.get(key)
        if plan is None:
            plan = state.plans[key] = self._plan(buf, size, vt)
        tbl_len = plan.tbl_len
        if tpos + tbl_len > size:
            raise HeaderError(f"{self.name} table at {tpos} ({tbl_len} bytes) overruns the "
                              f"{size}-byte header")
        state.budget -= tbl_len
        if state.budget < 0:
            raise HeaderError(_BUDGET_MESSAGE)
        args = plan.template.copy()
        for i, factory in plan.factories:
            args[i] = factory()
        for start, st, idxs in plan.groups:
            for i, v in zip(idxs, st.unpack_from(buf, tpos + start), strict=True):
                args[i] = v
        for i, convert in plan.converts:
            args[i] = convert(args[i])
        for i, off, f in plan.refs:
            fpos = tpos + off
            args[i] = f.reader(buf, size, fpos + _U32.unpack_from(buf, fpos)[0], f, state)
        obj = self.cls(*args)
        if self.check is not None:
            problem = self.check(obj)
            if problem:
                raise HeaderError(problem)
        return obj

    def _plan(self, buf: Any, size: int, vt: int) -> _Plan:
        if vt < 0 or vt + 4 > size:
            raise HeaderError(f"{self.name} vtable at {vt} is outside the {size}-byte header")
        vt_len, tbl_len = _VT_HEAD.unpack_from(buf, vt)
        if vt_len < 4 or vt_len & 1 or vt + vt_len > size:
            raise HeaderError(f"{self.name} vtable at {vt} has an invalid length {vt_len}")
        if tbl_len < 4:
            raise HeaderError(f"{self.name} vtable at {vt} gives a table length {tbl_len} < 4")
        vt_bytes = bytes(buf[vt:vt + vt_len])
        cached = self._plans.get(vt_bytes)
        if cached is not None:
            return cached
        nslots = min((vt_len - 4) // 2, self.nslots)
        offs = struct.unpack_from(f"<{nslots}H", vt_bytes, 4)
        plan = _Plan()
        plan.tbl_len = tbl_len
        plan.template = list(self._absent)
        present = set()
        scalars = []
        plan.refs = []
        plan.converts = []
        for i, f in enumerate(self.fields):
            off = offs[f.slot] if f.slot < nslots else 0
            if off == 0:
                continue
            width = f.size if f.kind == SCALAR else 4
            if off + width > tbl_len:
                raise HeaderError(f"{f.qualname} at offset {off} lies beyond the table's "
                                  f"{tbl_len} bytes")
            present.add(i)
            if f.kind == SCALAR:
                scalars.append((off, i, f))
                if f.convert is not None:
                    plan.converts.append((i, f.convert))
            else:
                plan.refs.append((i, off, f))
        plan.factories = [(i, fac) for i, fac in self._absent_factories if i not in present]
        plan.groups = _scalar_groups(sorted(scalars, key=lambda s: s[0]))
        if len(self._plans) >= MAX_CACHED_PLANS:
            self._plans.clear()
        self._plans[vt_bytes] = plan
        return plan


def _tuple_getter(names: list[str]) -> Callable[[Any], tuple]:
    from operator import attrgetter
    get = attrgetter(*names)
    if len(names) == 1:
        return lambda obj: (get(obj),)
    return get


def _scalar_groups(scalars: list[tuple[int, int, Field]]) -> list[tuple[int, struct.Struct,
                                                                         list[int]]]:
    """Scalars sorted by offset, packed into as few structs as possible (fields may overlap in
    a hostile vtable, which one struct cannot express)."""
    groups = []
    fmt: list[str] = []
    idxs: list[int] = []
    start = cur = 0
    for off, i, f in scalars:
        if idxs and off < cur:
            groups.append((start, struct.Struct("<" + "".join(fmt)), idxs))
            fmt, idxs = [], []
        if not idxs:
            start = cur = off
        if off > cur:
            fmt.append(f"{off - cur}x")
        fmt.append(f.fmt)
        idxs.append(i)
        cur = off + f.size
    if idxs:
        groups.append((start, struct.Struct("<" + "".join(fmt)), idxs))
    return groups


class _State:
    """Per-decode bookkeeping: the remaining work budget and the vtables already read."""

    __slots__ = ("budget", "plans")

    def __init__(self, size: int) -> None:
        self.budget = BUDGET_FACTOR * size + BUDGET_BASE
        self.plans: dict[int, _Plan] = {}


_BUDGET_MESSAGE = "the header refers to the same data too many times (decoding budget exceeded)"


def _charge(state: _State, nbytes: int) -> None:
    state.budget -= nbytes
    if state.budget < 0:
        raise HeaderError(_BUDGET_MESSAGE)


def _vector_span(buf: Any, size: int, pos: int, f: Field, item: int, align: int = 4) -> int:
    if pos + 4 > size:
        raise HeaderError(f"{f.qualname}: vector at {pos} is outside the {size}-byte header")
    n = _U32.unpack_from(buf, pos)[0]
    if pos + 4 + n * item > size:
        raise HeaderError(f"{f.qualname}: vector at {pos} of {n} elements overruns the "
                          f"{size}-byte header")
    return n


def _read_string(buf: Any, size: int, pos: int, f: Field, state: _State) -> str:
    n = _vector_span(buf, size, pos, f, 1)
    _charge(state, 4 + n)
    try:
        return str(buf[pos + 4:pos + 4 + n], "utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"{f.qualname}: string at {pos} is not UTF-8 ({exc.reason})") \
            from None


def _read_bytes(buf: Any, size: int, pos: int, f: Field, state: _State) -> bytes:
    n = _vector_span(buf, size, pos, f, 1)
    _charge(state, 4 + n)
    return bytes(buf[pos + 4:pos + 4 + n])


def _read_table(buf: Any, size: int, pos: int, f: Field, state: _State) -> Any:
    return f.sub.read(buf, size, pos, state)


def _read_vec_table(buf: Any, size: int, pos: int, f: Field, state: _State) -> list:
    n = _vector_span(buf, size, pos, f, 4)
    _charge(state, 4 + 4 * n)
    read = f.sub.read
    base = pos + 4
    offsets = struct.unpack_from(f"<{n}I", buf, base)
    return [read(buf, size, base + 4 * i + off, state) for i, off in enumerate(offsets)]


def _read_vec_scalar(buf: Any, size: int, pos: int, f: Field, state: _State) -> list:
    n = _vector_span(buf, size, pos, f, f.size)
    _charge(state, 4 + f.size * n)
    values = list(struct.unpack_from(f"<{n}{f.fmt}", buf, pos + 4))
    if f.convert is not None:
        values = [f.convert(v) for v in values]
    return values


def _read_vec_struct(buf: Any, size: int, pos: int, f: Field, state: _State) -> list:
    sc: StructCodec = f.sub
    item = sc.struct.size
    n = _vector_span(buf, size, pos, f, item)
    _charge(state, 4 + item * n)
    return list(starmap(sc.cls, sc.struct.iter_unpack(buf[pos + 4:pos + 4 + n * item])))


_READERS: dict[int, Callable[..., Any]] = {
    STRING: _read_string, BYTES: _read_bytes, TABLE: _read_table, VEC_TABLE: _read_vec_table,
    VEC_SCALAR: _read_vec_scalar, VEC_STRUCT: _read_vec_struct}


def _align_for_vector(out: bytearray, elem_align: int) -> int:
    """Pad ``out`` so a vector's length prefix goes at the returned position and its first
    element is aligned to ``elem_align``."""
    pad = -(len(out) + 4) % max(elem_align, 4)
    if pad:
        out += bytes(pad)
    return len(out)


def _write_string(out: bytearray, f: Field, v: str) -> int:
    data = v.encode("utf-8")
    pos = _align_for_vector(out, 4)
    out += _U32.pack(len(data))
    out += data
    out.append(0)  # FlatBuffers strings keep a NUL after their bytes
    return pos


def _write_bytes(out: bytearray, f: Field, v: bytes) -> int:
    pos = _align_for_vector(out, 4)
    out += _U32.pack(len(v))
    out += v
    return pos


def _write_table(out: bytearray, f: Field, v: Any) -> int:
    return f.sub.write(out, v)


def _write_vec_table(out: bytearray, f: Field, v: list) -> int:
    pos = _align_for_vector(out, 4)
    n = len(v)
    out += _U32.pack(n)
    out += bytes(4 * n)
    write = f.sub.write
    for i, item in enumerate(v):
        if not isinstance(item, f.sub.cls):
            raise TypeError(f"{f.qualname}[{i}] is a {type(item).__name__}, "
                            f"not a {f.sub.name}")
        child = write(out, item)
        slot = pos + 4 + 4 * i
        _U32.pack_into(out, slot, child - slot)
    return pos


def _write_vec_scalar(out: bytearray, f: Field, v: list) -> int:
    pos = _align_for_vector(out, f.size)
    out += _U32.pack(len(v))
    out += struct.pack(f"<{len(v)}{f.fmt}", *v)
    return pos


def _write_vec_struct(out: bytearray, f: Field, v: list) -> int:
    sc: StructCodec = f.sub
    pos = _align_for_vector(out, sc.align)
    out += _U32.pack(len(v))
    pack = sc.struct.pack
    get = sc.getter
    out += b"".join([pack(*get(item)) for item in v])
    return pos


_WRITERS: dict[int, Callable[..., int]] = {
    STRING: _write_string, BYTES: _write_bytes, TABLE: _write_table, VEC_TABLE: _write_vec_table,
    VEC_SCALAR: _write_vec_scalar, VEC_STRUCT: _write_vec_struct}


def check_value(qualname: str, fmt: str, value: Any) -> str | None:
    """Why ``value`` cannot be encoded as a scalar of type ``fmt`` (None if it can)."""
    if fmt == "?":
        return None
    if not isinstance(value, int):
        return f"{qualname}={value!r} is a {type(value).__name__}, not an int"
    lo, hi = _RANGES[fmt]
    if not lo <= value <= hi:
        return f"{qualname}={value} does not fit in a FlatBuffers {_FBS_NAMES[fmt]}"
    return None


def find_problem(codec: Codec | StructCodec, obj: Any, path: str) -> str | None:
    """Name the first field of ``obj`` (recursively) that cannot be encoded."""
    if not isinstance(obj, codec.cls):
        return f"{path} is a {type(obj).__name__}, not a {codec.name}"
    if isinstance(codec, StructCodec):
        return next((p for name, fmt in zip(codec.names, codec.formats, strict=True)
                     if (p := check_value(f"{path}.{name}", fmt, getattr(obj, name)))), None)
    return next((p for f in codec.fields
                 if (p := _field_problem(f, getattr(obj, f.name), f"{path}.{f.name}"))), None)


def _field_problem(f: Field, v: Any, where: str) -> str | None:
    """Why ``v`` cannot be encoded as field ``f`` (None if it can)."""
    if f.kind == SCALAR:
        return check_value(where, f.fmt, v)
    if f.kind == STRING:
        if not isinstance(v, str):
            return f"{where} is a {type(v).__name__}, not a str"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"{where} cannot be encoded as UTF-8 ({exc.reason})"
        return None
    if f.kind == BYTES:
        return None if isinstance(v, (bytes, bytearray, memoryview)) else \
            f"{where} is a {type(v).__name__}, not bytes"
    if f.kind == TABLE:
        return None if v is None else find_problem(f.sub, v, where)
    if not isinstance(v, list):
        return f"{where} is a {type(v).__name__}, not a list"
    if f.kind == VEC_SCALAR:
        return next((p for i, x in enumerate(v)
                     if (p := check_value(f"{where}[{i}]", f.fmt, x))), None)
    return next((p for i, x in enumerate(v)
                 if (p := find_problem(f.sub, x, f"{where}[{i}]"))), None)


def encode_error(codec: Codec, obj: Any, exc: Exception) -> Exception:
    """A ValueError/TypeError naming the field that made encoding ``obj`` fail."""
    problem = find_problem(codec, obj, codec.name)
    if problem is None:
        return ValueError(f"cannot encode {codec.name}: {exc}")
    if " is a " in problem:
        return TypeError(f"cannot encode {codec.name}: {problem}")
    return ValueError(f"cannot encode {codec.name}: {problem}")


def build_codecs(schema: Any, classes: dict[str, type],
                 enums: dict[str, type[IntEnum]]) -> dict[str, Codec]:
    """Codecs for every table of ``schema`` (the generated ``wire_tables`` module: TABLES,
    STRUCTS, ENUMS), each bound to the dataclass of the same name in ``classes``; ``enums``
    gives the Python enum of each schema enum (decoded fields become its members).

    Raises ``SchemaMismatch`` naming the class and field when a class and its table disagree.
    A class chooses a codec type with a ``CODEC_TYPE`` attribute (default ``Codec``).
    """
    enum_types = {name: _enum_converter(name, spec, enums.get(name))
                  for name, spec in schema.ENUMS.items()}
    structs = {name: StructCodec.from_schema(name, _class_for(name, classes), spec)
               for name, spec in schema.STRUCTS.items()}
    extra = set(classes) - set(schema.TABLES) - set(schema.STRUCTS)
    if extra:
        raise SchemaMismatch(f"no schema table for the message classes {sorted(extra)}")
    codecs: dict[str, Codec] = {}
    links: list[tuple[Field, str]] = []
    for index, (name, spec) in enumerate(schema.TABLES.items()):
        cls = _class_for(name, classes)
        dc_fields = dataclasses.fields(cls)
        names = [f[0] for f in spec]
        if [f.name for f in dc_fields] != names:
            raise SchemaMismatch(f"{name}: the class declares fields "
                                 f"{[f.name for f in dc_fields]}, the schema (in id order) "
                                 f"{names}")
        fields = []
        for dcf, (_, fid, ftype, fdefault, required) in zip(dc_fields, spec, strict=True):
            f = _field(name, dcf, fid, ftype, fdefault, required, enum_types, structs,
                       schema.TABLES)
            fields.append(f)
            if f.kind not in (SCALAR, STRING, BYTES, VEC_SCALAR):
                links.append((f, ftype.strip("[]")))
        codec = getattr(cls, "CODEC_TYPE", Codec)(cls, fields)
        codec.index = index
        codecs[name] = codec
    for f, target in links:
        f.sub = structs[target] if f.kind == VEC_STRUCT else codecs[target]
    for codec in codecs.values():
        for f in codec.fields:
            if f.kind != SCALAR:
                f.reader = _READERS[f.kind]
    for codec in codecs.values():
        codec.link(codecs)
    return codecs


def _class_for(name: str, classes: dict[str, type]) -> type:
    cls = classes.get(name)
    if cls is None:
        raise SchemaMismatch(f"the schemas declare {name}, but no message class has that name")
    return cls


def _enum_converter(name: str, spec: tuple, py_enum: type[IntEnum] | None
                    ) -> tuple[str, Callable[[int], Any]]:
    """The enum's underlying type, and its converter: decoded numbers become members of
    ``py_enum`` when known, else stay ints (a newer peer may send values this version does
    not know)."""
    underlying, members = spec
    if py_enum is None:
        raise SchemaMismatch(f"no Python enum given for the schema enum {name}")
    ours = {m.name: int(m) for m in py_enum}
    if ours != members:
        raise SchemaMismatch(f"enum {name}: {py_enum.__qualname__} has {ours}, the schema "
                             f"{members}")
    by_value = {int(m): m for m in py_enum}
    return underlying, lambda v: by_value.get(v, v)


def _field(owner: str, dcf: dataclasses.Field, slot: int, ftype: str, schema_default: Any,
           required: bool, enums: dict[str, tuple[str, Callable[[int], Any]]],
           structs: dict[str, StructCodec], tables: dict[str, tuple]) -> Field:
    """One table field from its schema entry and its dataclass field (checked to agree)."""
    where = f"{owner}.{dcf.name}"
    factory = None
    if dcf.default is not dataclasses.MISSING:
        # Immutable: absent fields share it (Status() is frozen).
        default = omit_value = dcf.default
    elif dcf.default_factory is not dataclasses.MISSING:
        # Mutable: absent fields get a new one; a table equal to it is left out.
        default, factory = None, dcf.default_factory
        omit_value = factory()
    else:
        raise SchemaMismatch(f"{where} needs a default")
    vector = ftype.startswith("[")
    base = ftype.strip("[]")
    convert = None
    if base in enums:
        base, convert = enums[base]
    if base in SCALAR_FORMATS:
        fmt = SCALAR_FORMATS[base]
        if vector and fmt == "B" and convert is None:
            return Field(owner, dcf.name, slot, BYTES, "I", default, factory, None, None, None)
        if vector:
            return Field(owner, dcf.name, slot, VEC_SCALAR, fmt, default, factory, None, None,
                         convert)
        if factory is not None or default != schema_default or \
                isinstance(default, bool) != (fmt == "?"):
            raise SchemaMismatch(f"{where}: the class's default is {default!r}, the schema's "
                                 f"{schema_default!r}")
        return Field(owner, dcf.name, slot, SCALAR, fmt, default, None, None, None, convert)
    if ftype == "string":
        return Field(owner, dcf.name, slot, STRING, "I", default, factory, None, None, None)
    if base not in structs and base not in tables:
        raise SchemaMismatch(f"{where}: type {ftype} is not supported by the codec")
    kind = (VEC_STRUCT if base in structs else VEC_TABLE) if vector else TABLE
    if required:
        omit_value = _NEVER_OMIT
    return Field(owner, dcf.name, slot, kind, "I", default, factory, omit_value, None, None)
