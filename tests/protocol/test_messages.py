"""Typed headers: round trips, agreement with flatc's generated code, hostile input, frames."""

from __future__ import annotations

import importlib
import random
import struct

import flatbuffers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sbp_spark.protocol import _flatbuf, messages
from sbp_spark.protocol.constants import Flags, Opcode
from sbp_spark.protocol.errors import (
    ErrorCode,
    HeaderError,
    PdNotLeaderError,
    RangeSealedError,
    ServerError,
)
from sbp_spark.protocol.frame import decode_frame, encode_frame, frame_bytes
from sbp_spark.protocol.messages import (
    OK,
    REQUESTS,
    RESPONSES,
    TABLES,
    AppendEntry,
    AppendRequest,
    AppendResponse,
    AppendResult,
    ClientRole,
    FetchEntry,
    FetchRequest,
    FetchResponse,
    FetchResult,
    ListRangesRequest,
    ListRangesResponse,
    PingRequest,
    PingResponse,
    PlacementDriverCluster,
    PlacementDriverNode,
    ProducerSequence,
    Range,
    RangeId,
    RangeOwner,
    RangeReplica,
    RangeServer,
    Status,
    SystemError,
    decode_request,
    decode_response,
    request_frame,
    response_frame,
    system_error_frame,
)
from tests.conftest import load_vectors

HOT = (AppendRequest, AppendResponse, FetchRequest, FetchResponse)
_RANGES = {"b": 8, "h": 16, "i": 32, "q": 64}

# ---- strategies built from the codecs' field declarations ---------------------------------


def _scalar(fmt: str) -> st.SearchStrategy:
    if fmt == "?":
        return st.booleans()
    bits = _RANGES[fmt]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # Mostly the values that matter (defaults, -1, 0, small ids), sometimes the extremes.
    return st.one_of(st.integers(-2, 70), st.sampled_from([lo, hi]), st.integers(lo, hi))


_STRATEGIES: dict[str, st.SearchStrategy] = {}


def strategy(cls: type, max_items: int = 3) -> st.SearchStrategy:
    """Any valid instance of a table class, nested tables and vectors included."""
    key = f"{cls.__name__}/{max_items}"
    if key in _STRATEGIES:
        return _STRATEGIES[key]
    if cls is RangeOwner:
        s = st.one_of(
            st.builds(RangeOwner, stream_id=st.integers(0, 2**63 - 1), range_server=st.none()),
            st.builds(RangeOwner, stream_id=st.just(-1),
                      range_server=strategy(RangeServer)))
        _STRATEGIES[key] = s
        return s
    kwargs = {}
    for f in cls._CODEC.fields:
        kwargs[f.name] = _field_strategy(f, max_items)
    s = st.builds(cls, **kwargs)
    _STRATEGIES[key] = s
    return s


def _field_strategy(f: _flatbuf.Field, max_items: int) -> st.SearchStrategy:
    k = f.kind
    if k == _flatbuf.SCALAR:
        return _scalar(f.fmt)
    if k == _flatbuf.STRING:
        return st.text(max_size=12)
    if k == _flatbuf.BYTES:
        return st.binary(max_size=12)
    if k == _flatbuf.TABLE:
        sub = st.deferred(lambda: strategy(f.sub.cls))
        return st.one_of(st.none(), sub) if f.default is None and f.factory is None else sub
    if k == _flatbuf.VEC_SCALAR:
        return st.lists(_scalar(f.fmt), max_size=max_items)
    if k == _flatbuf.VEC_STRUCT:
        fmts = [c for c in f.sub.struct.format if c.isalpha() and c != "x"]
        entry = st.builds(f.sub.cls, *(_scalar(fmt) for fmt in fmts))
        return st.lists(entry, max_size=max(max_items, 20))
    sub = st.deferred(lambda: strategy(f.sub.cls))
    hot = f.sub.cls in (AppendResult, FetchResult, FetchEntry)
    return st.lists(sub, max_size=20 if hot else max_items)


def _status_mostly_ok() -> st.SearchStrategy:
    return st.one_of(st.just(OK), st.just(OK), strategy(Status))


def hot_strategy(cls: type) -> st.SearchStrategy:
    """Hot messages shaped like real traffic: up to 20 items, statuses mostly OK."""
    if cls is AppendRequest:
        return strategy(AppendRequest)
    item_cls = {AppendResponse: AppendResult, FetchResponse: FetchResult,
                FetchRequest: FetchEntry}[cls]
    item_kwargs = {f.name: _field_strategy(f, 3) for f in item_cls._CODEC.fields}
    if "status" in item_kwargs:
        item_kwargs["status"] = _status_mostly_ok()
    items = st.lists(st.builds(item_cls, **item_kwargs), max_size=20)
    fields = cls._CODEC.fields
    kwargs = {fields[0].name: _scalar("i"), fields[2].name: items}
    kwargs[fields[1].name] = _status_mostly_ok() if fields[1].kind == _flatbuf.TABLE \
        else _scalar("i")
    return st.builds(cls, **kwargs)


ALL_TABLES = sorted(TABLES.values(), key=lambda c: c.__name__)

# ---- the generated code as an independent reader and writer -------------------------------


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _gen_module(name: str):
    return importlib.import_module(f"tests.flatc_classes.{name}")


def gen_read(cls: type, buf: bytes):
    """Decode ``buf`` with flatc's generated accessors into our dataclass."""
    mod = _gen_module(cls.__name__)
    return _gen_read_table(cls, getattr(mod, cls.__name__).GetRootAs(buf, 0))


def _gen_read_table(cls: type, obj):
    values = {}
    for f in cls._CODEC.fields:
        acc = _camel(f.name)
        k = f.kind
        if k == _flatbuf.SCALAR:
            v = getattr(obj, acc)()
            if f.convert is not None:
                v = f.convert(v)
        elif k == _flatbuf.STRING:
            raw = getattr(obj, acc)()
            v = "" if raw is None else raw.decode("utf-8")
        elif k == _flatbuf.BYTES:
            v = bytes(getattr(obj, acc)(j) for j in range(getattr(obj, acc + "Length")()))
        elif k == _flatbuf.TABLE:
            sub = getattr(obj, acc)()
            if sub is None:
                v = f.factory() if f.factory else f.default
            else:
                v = _gen_read_table(f.sub.cls, sub)
        else:
            n = getattr(obj, acc + "Length")()
            items = [getattr(obj, acc)(j) for j in range(n)]
            if k == _flatbuf.VEC_SCALAR:
                v = items
            elif k == _flatbuf.VEC_STRUCT:
                v = [f.sub.cls(*(getattr(e, _camel(name))() for name in f.sub.names))
                     for e in items]
            else:
                v = [_gen_read_table(f.sub.cls, e) for e in items]
        values[f.name] = v
    return cls(**values)


def gen_write(msg) -> bytes:
    """Encode ``msg`` with flatc's generated builders."""
    b = flatbuffers.Builder(64)
    b.Finish(_gen_write_table(b, msg))
    return bytes(b.Output())


def _gen_write_table(b: flatbuffers.Builder, msg) -> int:
    name = type(msg).__name__
    mod = _gen_module(name)
    refs = {}
    for f in msg._CODEC.fields:  # children first: a builder cannot nest objects
        v = getattr(msg, f.name)
        k = f.kind
        acc = _camel(f.name)
        if k == _flatbuf.SCALAR:
            continue
        if k == _flatbuf.STRING:
            refs[f.name] = b.CreateString(v)
        elif k == _flatbuf.BYTES:
            refs[f.name] = b.CreateByteVector(v)
        elif k == _flatbuf.TABLE:
            if v is not None:
                refs[f.name] = _gen_write_table(b, v)
        elif k == _flatbuf.VEC_TABLE:
            children = [_gen_write_table(b, item) for item in v]
            getattr(mod, f"Start{acc}Vector")(b, len(v))
            for child in reversed(children):
                b.PrependUOffsetTRelative(child)
            refs[f.name] = b.EndVector()
        elif k == _flatbuf.VEC_SCALAR:
            getattr(mod, f"Start{acc}Vector")(b, len(v))
            prepend = {"q": b.PrependInt64, "i": b.PrependInt32}[f.fmt]
            for item in reversed(v):
                prepend(item)
            refs[f.name] = b.EndVector()
        else:
            struct_name = f.sub.cls.__name__
            create = getattr(_gen_module(struct_name), f"Create{struct_name}")
            getattr(mod, f"Start{acc}Vector")(b, len(v))
            for e in reversed(v):
                create(b, *(getattr(e, name) for name in f.sub.names))
            refs[f.name] = b.EndVector()
    mod.Start(b)
    for f in msg._CODEC.fields:
        add = getattr(mod, f"Add{_camel(f.name)}")
        if f.kind == _flatbuf.SCALAR:
            add(b, getattr(msg, f.name))
        elif f.name in refs:
            add(b, refs[f.name])
    return mod.End(b)


# ---- round trips and cross-checks --------------------------------------------------------


@pytest.mark.parametrize("cls", ALL_TABLES, ids=lambda c: c.__name__)
@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_and_generated_code_agree(cls, data):
    msg = data.draw(strategy(cls))
    ours = msg.to_flatbuffers()
    assert cls.from_flatbuffers(ours) == msg
    assert gen_read(cls, ours) == msg  # flatc's reader understands our bytes
    theirs = gen_write(msg)
    assert cls.from_flatbuffers(theirs) == msg  # we understand flatc's builder's bytes
    assert cls.from_flatbuffers(memoryview(bytearray(theirs))) == msg


@pytest.mark.parametrize("cls", HOT, ids=lambda c: c.__name__)
@given(data=st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_hot_fast_path_agrees_with_generic_codec_and_generated_code(cls, data):
    msg = data.draw(hot_strategy(cls))
    fast = msg.to_flatbuffers()
    generic = _flatbuf.Codec.encode(cls._CODEC, msg)  # the layout any other table gets
    assert cls.from_flatbuffers(fast) == msg
    assert cls.from_flatbuffers(generic) == msg
    assert gen_read(cls, fast) == msg
    assert cls.from_flatbuffers(gen_write(msg)) == msg


def test_hot_messages_declare_their_codec_and_nothing_is_patched():
    for cls in HOT:
        assert cls.CODEC_TYPE is not _flatbuf.Codec
        assert type(cls._CODEC) is cls.CODEC_TYPE
        assert cls.to_flatbuffers is messages.Message.to_flatbuffers
        assert cls.from_flatbuffers.__func__ is messages.Message.from_flatbuffers.__func__
    for cls in set(TABLES.values()) - set(HOT):
        assert type(cls._CODEC) is _flatbuf.Codec, cls.__name__
    response = AppendResponse(append_responses=[AppendResult(i, i, i) for i in range(4)])
    # Every scalar written, one vtable: the layout the bulk reader recognises.
    assert response.to_flatbuffers() != _flatbuf.Codec.encode(AppendResponse._CODEC, response)


def test_defaults_match_the_schema():
    for cls in ALL_TABLES:
        b = flatbuffers.Builder(16)
        mod = _gen_module(cls.__name__)
        mod.Start(b)
        b.Finish(mod.End(b))
        empty = bytes(b.Output())
        if cls is RangeOwner:  # neither owner set is invalid, see below
            continue
        assert cls.from_flatbuffers(empty) == cls(), cls.__name__
        assert gen_read(cls, cls().to_flatbuffers()) == cls(), cls.__name__


def test_error_code_enum_in_schema_matches_python():
    gen = _gen_module("ErrorCode").ErrorCode
    schema = {k: v for k, v in vars(gen).items() if not k.startswith("_")}
    assert schema == {c.name: c.value for c in ErrorCode}
    role = _gen_module("ClientRole").ClientRole
    assert {k: v for k, v in vars(role).items() if not k.startswith("_")} == \
        {r.name: r.value for r in ClientRole}


def test_every_opcode_has_a_request_and_a_response():
    assert set(REQUESTS) == set(Opcode) == set(RESPONSES)
    for op in Opcode:
        assert REQUESTS[op].OPCODE == op == RESPONSES[op].OPCODE
        assert REQUESTS[op].__name__.endswith("Request")
        assert RESPONSES[op].__name__.endswith("Response")


def test_decoded_enums_are_members_when_known():
    status = Status.from_flatbuffers(Status(12, "sealed").to_flatbuffers())
    assert status.code is ErrorCode.RANGE_SEALED
    assert Status.from_flatbuffers(Status(999).to_flatbuffers()).code == 999
    hb = messages.HeartbeatRequest("c", ClientRole.RANGE_SERVER, RangeServer(3, "h:1"))
    assert messages.HeartbeatRequest.from_flatbuffers(hb.to_flatbuffers()).client_role \
        is ClientRole.RANGE_SERVER


STATUS_TABLES = sorted((c for c in ALL_TABLES if "status" in c.__dataclass_fields__),
                       key=lambda c: c.__name__)


def test_every_response_and_result_has_a_status_and_the_schema_requires_it():
    from sbp_spark.protocol._generated import wire_tables

    responses = {c for c in ALL_TABLES if c.__name__.endswith(("Response", "Result"))}
    empty = {PingResponse, messages.GoAwayResponse}  # no fields at all
    assert {c for c in STATUS_TABLES if c is not SystemError} == responses - empty
    for cls in STATUS_TABLES:
        [status] = [f for f in wire_tables.TABLES[cls.__name__] if f[0] == "status"]
        assert status[2:] == ("Status", None, True), cls.__name__


@pytest.mark.parametrize("cls", STATUS_TABLES, ids=lambda c: c.__name__)
def test_ok_statuses_are_written_and_absent_ones_read_as_ok(cls):
    msg = cls()  # status OK, everything else default
    ours = msg.to_flatbuffers()
    gen = getattr(_gen_module(cls.__name__), cls.__name__).GetRootAs(ours, 0)
    status = gen.Status()  # what a peer's generated accessor returns: never None
    assert status is not None and status.Code() == 0
    assert cls.from_flatbuffers(ours) == msg
    # A peer built on the earlier schemas leaves an OK status out: still success, and the
    # shared OK object.
    b = flatbuffers.Builder(16)
    mod = _gen_module(cls.__name__)
    mod.Start(b)
    b.Finish(mod.End(b))
    assert cls.from_flatbuffers(bytes(b.Output())).status is OK


# ---- Status and errors -------------------------------------------------------------------


def test_status_ok_and_raise_for_status():
    assert Status().ok
    Status().raise_for_status()
    with pytest.raises(RangeSealedError) as info:
        Status(ErrorCode.RANGE_SEALED, "range 3 sealed", b"x").raise_for_status()
    assert info.value.retriable and info.value.invalid_metadata
    assert info.value.message == "range 3 sealed" and info.value.detail == b"x"
    with pytest.raises(ServerError) as unknown:
        Status(4242, "new code").raise_for_status()
    assert unknown.value.code == 4242


def test_status_from_error_round_trips():
    cluster = PlacementDriverCluster([PlacementDriverNode("pd-1", "10.0.0.1:2378", True),
                                      PlacementDriverNode("pd-2", "10.0.0.2:2378", False)])
    exc = PdNotLeaderError("not the leader", detail=cluster.to_flatbuffers())
    status = Status.from_error(exc)
    assert status == Status(ErrorCode.PD_NOT_LEADER, "not the leader", cluster.to_flatbuffers())
    decoded = Status.from_flatbuffers(status.to_flatbuffers())
    with pytest.raises(PdNotLeaderError) as info:
        decoded.raise_for_status()
    redirect = PlacementDriverCluster.from_flatbuffers(info.value.detail)
    assert redirect.leader == PlacementDriverNode("pd-1", "10.0.0.1:2378", True)


def test_range_helpers():
    primary = RangeServer(2, "b:2")
    r = Range(7, 0, 0, 10, -1, [RangeReplica(RangeServer(1, "a:1"), False),
                                RangeReplica(primary, True)])
    assert r.is_open and r.primary == primary
    assert not Range(end_offset=10).is_open and Range().primary is None


# ---- encoding errors name the field ------------------------------------------------------


@pytest.mark.parametrize("msg, where", [
    (AppendRequest(0, [AppendEntry(2**63, 0, 1)]), "AppendRequest.append_requests[0].stream_id"),
    (AppendResponse(0, OK, [AppendResult(1, 2**31, 0, 0)]),
     "AppendResponse.append_responses[0].request_index"),
    (FetchRequest(0, 0, [FetchEntry(1, 0, 0, 2**40)]),
     "FetchRequest.fetch_requests[0].batch_max_bytes"),
    (FetchResponse(0, Status(2**15), []), "FetchResponse.status.code"),
    (Range(servers=[RangeReplica(RangeServer(2**31))]), "Range.servers[0].server.server_id"),
    (messages.Stream(replica_nums=300), "Stream.replica_nums"),
])
def test_out_of_range_values_raise_value_error_naming_the_field(msg, where):
    with pytest.raises(ValueError, match=where.replace("[", r"\[").replace("]", r"\]")):
        msg.to_flatbuffers()


@pytest.mark.parametrize("msg, where", [
    (AppendRequest(0, [(1, 2, 3)]), "AppendRequest.append_requests[0]"),
    (AppendResponse(0, OK, [AppendEntry(1, 2, 3)]), "AppendResponse.append_responses[0]"),
    (FetchRequest(0, 0, [FetchEntry(stream_id="7")]), "FetchRequest.fetch_requests[0].stream_id"),
    (messages.RangeServer(1, b"bytes"), "RangeServer.advertise_addr"),
    (ListRangesResponse(list_responses=[Range()]), "ListRangesResponse.list_responses[0]"),
])
def test_wrong_types_raise_type_error_naming_the_field(msg, where):
    with pytest.raises(TypeError, match=where.replace("[", r"\[").replace("]", r"\]")):
        msg.to_flatbuffers()


def test_range_owner_must_set_exactly_one_owner():
    for bad in (RangeOwner(), RangeOwner(5, RangeServer(1, "a:1"))):
        with pytest.raises(ValueError, match="exactly one"):
            ListRangesRequest(0, [bad]).to_flatbuffers()
        # The same owner from another encoder is rejected when decoded.
        with pytest.raises(HeaderError, match="exactly one"):
            ListRangesRequest.from_flatbuffers(gen_write(ListRangesRequest(0, [bad])))
    ok = ListRangesRequest(0, [RangeOwner(5), RangeOwner(range_server=RangeServer(1, "a:1"))])
    assert ListRangesRequest.from_flatbuffers(ok.to_flatbuffers()) == ok


# ---- hostile input -----------------------------------------------------------------------


def _random_value(f: _flatbuf.Field, rng: random.Random):
    k = f.kind
    if k == _flatbuf.SCALAR:
        if f.fmt == "?":
            return rng.random() < 0.5
        bits = _RANGES[f.fmt]
        return rng.choice([-1, 0, 1, rng.randrange(1 << min(10, bits - 1)), (1 << (bits - 1)) - 1])
    if k == _flatbuf.STRING:
        return rng.choice(["", "a", "host-1:2378", "\u00e9t\u00e9"])
    if k == _flatbuf.BYTES:
        return rng.randbytes(rng.randrange(6))
    if k == _flatbuf.TABLE:
        return _random_instance(f.sub.cls, rng)
    n = rng.randrange(4)
    if k == _flatbuf.VEC_SCALAR:
        return [rng.randrange(-5, 1 << min(40, _RANGES[f.fmt] - 2)) for _ in range(n)]
    if k == _flatbuf.VEC_STRUCT and f.sub.cls is AppendEntry:
        return [AppendEntry(rng.randrange(1 << 40), i, rng.randrange(1 << 20)) for i in range(n)]
    if k == _flatbuf.VEC_STRUCT:
        return [f.sub.cls(rng.randrange(1 << 40), *(rng.randrange(1 << 20)
                                                    for _ in f.sub.names[1:]))
                for i in range(n)]
    return [_random_instance(f.sub.cls, rng) for _ in range(n)]


def _random_instance(cls: type, rng: random.Random):
    if cls is RangeOwner:
        return RangeOwner(5) if rng.random() < 0.5 else RangeOwner(range_server=RangeServer(1))
    return cls(**{f.name: _random_value(f, rng) for f in cls._CODEC.fields})


def _samples(cls: type, rng: random.Random) -> list[bytes]:
    """Valid encodings of ``cls`` (ours and flatc's) to mutate."""
    seeds = [cls().to_flatbuffers()] if cls is not RangeOwner else []
    for _ in range(4):
        msg = _random_instance(cls, rng)
        seeds.append(msg.to_flatbuffers())
        seeds.append(gen_write(msg))
    return seeds


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0 and b:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:  # truncate
        del b[rng.randrange(len(b) + 1):]
    elif op == 2 and len(b) >= 4:  # a huge or odd 32-bit value somewhere (lengths, offsets)
        pos = rng.randrange(len(b) - 3)
        b[pos:pos + 4] = struct.pack("<I", rng.choice(
            [0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, len(b), len(b) + 1, 1 << 20, 3]))
    elif op == 3 and len(b) >= 2:  # vtable-sized values
        pos = rng.randrange(len(b) - 1)
        b[pos:pos + 2] = struct.pack("<H", rng.choice([0, 1, 3, 0xFFFF, len(b), 4]))
    elif op == 4:  # insert or append junk
        pos = rng.randrange(len(b) + 1)
        b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    else:  # random bytes of the same length
        b = bytearray(rng.randbytes(len(b)))
    return bytes(b)


def _only_header_errors(cls: type, data: bytes) -> None:
    try:
        cls.from_flatbuffers(data)
    except HeaderError as exc:
        assert cls.__name__ in str(exc)


def _fuzz(cls: type, cases: int, seed: int) -> None:
    rng = random.Random(seed)
    samples = _samples(cls, rng)
    for _ in range(cases):
        data = rng.choice(samples)
        for _ in range(rng.randint(1, 3)):
            data = _mutate(data, rng)
        _only_header_errors(cls, data)
        _only_header_errors(cls, memoryview(data))


@pytest.mark.parametrize("cls", ALL_TABLES, ids=lambda c: c.__name__)
def test_mutated_headers_only_raise_header_error(cls):
    _fuzz(cls, 300, seed=hash(cls.__name__) & 0xFFFF)


@pytest.mark.slow
def test_mutated_headers_only_raise_header_error_many_cases():
    per_class = 500_000 // len(ALL_TABLES) + 1
    for cls in ALL_TABLES:
        _fuzz(cls, per_class, seed=len(cls.__name__))


@pytest.mark.parametrize("cls", ALL_TABLES, ids=lambda c: c.__name__)
@given(data=st.binary(max_size=200))
@settings(max_examples=40, deadline=None)
def test_random_bytes_only_raise_header_error(cls, data):
    _only_header_errors(cls, data)


def test_huge_vector_length_is_rejected_without_allocating():
    msg = AppendRequest(0, [AppendEntry(1, 2, 3)])
    buf = bytearray(msg.to_flatbuffers())
    # The vector length sits just before the single 16-byte entry at the end.
    struct.pack_into("<I", buf, len(buf) - 20, 0xFFFFFFFF)
    with pytest.raises(HeaderError, match="AppendRequest.*append_requests"):
        AppendRequest.from_flatbuffers(bytes(buf))


def _shared_tree(n: int) -> bytes:
    """A small ListRangesResponse whose vectors all point at one shared child, so that naive
    decoding would build n**3 objects."""
    b = flatbuffers.Builder(1024)
    server = _gen_write_table(b, RangeServer(1, "a:1"))
    rr = _gen_module("RangeReplica")
    rr.Start(b)
    rr.AddServer(b, server)
    replica = rr.End(b)

    def shared_vector(start, child):
        start(b, n)
        for _ in range(n):
            b.PrependUOffsetTRelative(child)
        return b.EndVector()

    rng_mod = _gen_module("Range")
    servers = shared_vector(rng_mod.StartServersVector, replica)
    rng_mod.Start(b)
    rng_mod.AddServers(b, servers)
    range_ = rng_mod.End(b)
    res_mod = _gen_module("ListRangesResult")
    ranges = shared_vector(res_mod.StartRangesVector, range_)
    res_mod.Start(b)
    res_mod.AddRanges(b, ranges)
    result = res_mod.End(b)
    resp_mod = _gen_module("ListRangesResponse")
    results = shared_vector(resp_mod.StartListResponsesVector, result)
    resp_mod.Start(b)
    resp_mod.AddListResponses(b, results)
    b.Finish(resp_mod.End(b))
    return bytes(b.Output())


def test_shared_subtables_cannot_blow_up_decoding():
    small = _shared_tree(3)
    decoded = ListRangesResponse.from_flatbuffers(small)
    assert len(decoded.list_responses) == 3 and len(decoded.list_responses[0].ranges) == 3
    bomb = _shared_tree(2000)  # ~24 KB that would decode to 8e9 replicas
    with pytest.raises(HeaderError, match="budget"):
        ListRangesResponse.from_flatbuffers(bomb)


def test_invalid_utf8_is_a_header_error():
    buf = bytearray(RangeServer(1, "abc").to_flatbuffers())
    pos = bytes(buf).index(b"abc")
    buf[pos] = 0xFF
    with pytest.raises(HeaderError, match="RangeServer.advertise_addr.*UTF-8"):
        RangeServer.from_flatbuffers(bytes(buf))


def test_short_buffers_are_header_errors_except_empty_ping_and_goaway():
    assert PingRequest.from_flatbuffers(b"") == PingRequest()
    assert PingResponse.from_flatbuffers(memoryview(b"")) == PingResponse()
    assert messages.GoAwayRequest.from_flatbuffers(b"") == messages.GoAwayRequest()
    for cls in (AppendRequest, Status, PingRequest):
        with pytest.raises(HeaderError, match=cls.__name__):
            cls.from_flatbuffers(b"\x04\x00\x00")


# ---- frames ------------------------------------------------------------------------------


def _one_frame(buffers):
    return decode_frame(b"".join(bytes(b) for b in buffers))


def test_cap_notice_round_trips_with_its_range_and_no_payload():
    # A primary's read cap notice: cap_notice names the range, no entries, no payload,
    # committed_offset set (or -1 when it only asks a secondary how far it stored the range).
    for committed in (12345678901, 0, -1):
        req = AppendRequest(10_000, committed_offset=committed, cap_notice=RangeId(7, 3))
        frame = _one_frame(request_frame(3, req))
        assert (frame.opcode, frame.flags, frame.stream_id) == (Opcode.APPEND, 0, 3)
        assert decode_request(frame) == req and bytes(frame.payload) == b""
        data = req.to_flatbuffers()
        assert gen_read(AppendRequest, data) == req  # flatc's reader sees the range
        assert AppendRequest.from_flatbuffers(gen_write(req)) == req
    assert AppendRequest.from_flatbuffers(
        AppendRequest(5, [AppendEntry(7, 0, 9)]).to_flatbuffers()).cap_notice is None
    answer = AppendResponse(append_responses=[AppendResult(7, 0, 42, 1)])
    frame = _one_frame(response_frame(3, answer))
    assert decode_response(frame) == answer


def test_request_and_response_frames_round_trip():
    req = AppendRequest(500, [AppendEntry(7, 0, 3), AppendEntry(7, 1, 2)])
    frame = _one_frame(request_frame(11, req, [b"abc", b"de"]))
    assert (frame.opcode, frame.flags, frame.stream_id) == (Opcode.APPEND, 0, 11)
    assert decode_request(frame) == req and bytes(frame.payload) == b"abcde"
    resp = AppendResponse(0, OK, [AppendResult(7, 0, 100, 5), AppendResult(7, 1, 101, 5)])
    middle = _one_frame(response_frame(11, resp, end=False))
    assert middle.flags == Flags.RESPONSE and decode_response(middle) == resp
    last = _one_frame(response_frame(11, FetchResponse(), b"xy"))
    assert last.flags == Flags.RESPONSE | Flags.END
    assert decode_response(last) == FetchResponse() and bytes(last.payload) == b"xy"


def test_system_error_frames():
    status = Status(ErrorCode.INVALID_REQUEST, "header does not parse")
    frame = _one_frame(system_error_frame(9, Opcode.FETCH, status))
    assert frame.flags == Flags.RESPONSE | Flags.END | Flags.SYSTEM_ERROR
    assert frame.opcode == Opcode.FETCH
    assert decode_response(frame) == SystemError(status)


def test_decode_response_checks_the_table_the_caller_expects():
    frame = _one_frame(response_frame(3, FetchResponse(), b"xy"))
    assert decode_response(frame, FetchResponse) == FetchResponse()
    with pytest.raises(HeaderError, match="is a FetchResponse, not the AppendResponse expected"):
        decode_response(frame, AppendResponse)
    failed = _one_frame(system_error_frame(
        9, Opcode.APPEND, Status(ErrorCode.INVALID_REQUEST, "header does not parse")))
    with pytest.raises(HeaderError, match="is a SystemError, not the AppendResponse expected"):
        decode_response(failed, AppendResponse)


def test_decode_rejects_wrong_direction_and_unknown_opcodes():
    request = _one_frame(request_frame(1, PingRequest()))
    response = _one_frame(response_frame(1, PingResponse()))
    with pytest.raises(HeaderError, match="request, not a response"):
        decode_response(request)
    with pytest.raises(HeaderError, match="response, not a request"):
        decode_request(response)
    unknown = decode_frame(frame_bytes(0x7777, 0, 1, b"", b""))
    with pytest.raises(HeaderError, match="0x7777"):
        decode_request(unknown)
    garbage = decode_frame(frame_bytes(Opcode.APPEND, 0, 1, b"\x01\x02\x03\x04\x05", b""))
    with pytest.raises(HeaderError, match="AppendRequest"):
        decode_request(garbage)


def test_ping_vectors_decode():
    vectors = {v["name"]: v for v in load_vectors("frames.json")}
    ping = decode_frame(bytes.fromhex(vectors["ping request, no header, no payload"]["hex"]))
    assert decode_request(ping) == PingRequest()
    pong = decode_frame(bytes.fromhex(vectors["ping response echoing 4 payload bytes"]["hex"]))
    assert decode_response(pong) == PingResponse()
    # A pong may also echo a real (empty-table) header.
    echo = encode_frame(Opcode.PING, Flags.RESPONSE | Flags.END, 3, PingRequest().to_flatbuffers())
    assert decode_response(_one_frame(echo)) == PingResponse()


# ---- schema evolution --------------------------------------------------------------------


def test_fields_from_a_newer_schema_are_ignored():
    """A peer with more fields at the end of a table (a later schema) still decodes."""
    b = flatbuffers.Builder(64)
    addr = b.CreateString("a:1")
    b.StartObject(4)  # RangeServer has 2 fields; slots 2 and 3 are unknown here
    b.PrependInt32Slot(0, 3, -1)
    b.PrependUOffsetTRelativeSlot(1, addr, 0)
    b.PrependInt64Slot(2, 99, 0)
    b.PrependBoolSlot(3, True, False)
    b.Finish(b.EndObject())
    assert RangeServer.from_flatbuffers(bytes(b.Output())) == RangeServer(3, "a:1")


def test_views_of_any_item_size_are_read_as_bytes():
    msg = FetchResponse(1, OK, [FetchResult(5, 0, 100)])
    data = msg.to_flatbuffers()
    data += bytes(-len(data) % 4)
    assert FetchResponse.from_flatbuffers(memoryview(data).cast("I")) == msg


@pytest.mark.parametrize("n", [0, 1, 256, 257, 3000])
def test_hot_messages_with_many_items(n):
    msgs = [
        AppendRequest(1, [AppendEntry(i, i, 100) for i in range(n)]),
        AppendResponse(0, OK, [AppendResult(i, i, i, i, Status(i % 2)) for i in range(n)]),
        FetchRequest(1, 2, [FetchEntry(i, i, i, 1 << 20) for i in range(n)]),
        FetchResponse(0, OK, [FetchResult(i, i, 10) for i in range(n)]),
    ]
    for msg in msgs:
        data = msg.to_flatbuffers()
        assert type(msg).from_flatbuffers(data) == msg
        assert gen_read(type(msg), data) == msg


# ---- AppendRequest.committed_offset (set on a primary's forwards) -------------------------


def test_append_request_without_committed_offset_keeps_the_two_slot_layout():
    """Client appends (committed_offset -1) are byte-identical to the layout before the field
    existed: a 2-slot vtable, then the entries as packed structs."""
    req = AppendRequest(500, [AppendEntry(7, 0, 3), AppendEntry(8, 1, 2)])
    data = req.to_flatbuffers()
    expected = struct.pack("<I4HiiI4xI", 12, 8, 12, 4, 8, 8, 500, 8, 2) + \
        struct.pack("<qii", 7, 0, 3) + struct.pack("<qii", 8, 1, 2)
    assert data == expected
    assert AppendRequest.from_flatbuffers(data).committed_offset == -1
    assert gen_read(AppendRequest, data) == req


@pytest.mark.parametrize("committed", [0, 1, 41, 2**63 - 1, -2])
@pytest.mark.parametrize("n", [0, 1, 3, 300])
def test_append_request_with_committed_offset_round_trips_both_ways(committed, n):
    req = AppendRequest(30_000, [AppendEntry(5, i, 100 + i) for i in range(n)],
                        committed_offset=committed)
    ours = req.to_flatbuffers()
    root = struct.unpack_from("<I", ours)[0]
    vt = root - struct.unpack_from("<i", ours, root)[0]
    assert struct.unpack_from("<H", ours, vt)[0] == 4 + 2 * 3  # a third slot is written
    assert AppendRequest.from_flatbuffers(ours) == req  # fast reader falls back correctly
    assert AppendRequest.from_flatbuffers(memoryview(bytearray(ours))) == req
    assert gen_read(AppendRequest, ours) == req  # flatc's reader sees the field
    theirs = gen_write(req)
    assert AppendRequest.from_flatbuffers(theirs) == req  # and flatc's builder's bytes read back


@pytest.mark.parametrize("committed", [-1, 0, 77])
@pytest.mark.parametrize("range_index", [0, 5, 2**31 - 1])
def test_append_request_naming_its_range_round_trips_both_ways(committed, range_index):
    # A primary's forward names the range its batches belong to (with or without a cap).
    req = AppendRequest(2_000, [AppendEntry(5, 0, 100), AppendEntry(5, 1, 50)],
                        committed_offset=committed, range_index=range_index)
    ours = req.to_flatbuffers()
    assert AppendRequest.from_flatbuffers(ours) == req
    assert gen_read(AppendRequest, ours) == req
    assert AppendRequest.from_flatbuffers(gen_write(req)) == req
    # A client's append names none, and keeps the packed two-slot layout.
    assert AppendRequest.from_flatbuffers(
        AppendRequest(2_000, req.append_requests).to_flatbuffers()).range_index == -1


def test_append_request_committed_offset_out_of_range_names_the_field():
    with pytest.raises(ValueError, match="AppendRequest.committed_offset"):
        AppendRequest(0, [], committed_offset=2**63).to_flatbuffers()


# ---- APPEND entries must be structs --------------------------------------------------------


def append_request_with_table_entries(entries: list[tuple[int, int, int]],
                                      timeout_ms: int = 500,
                                      cap_notice: tuple[int, int] | None = None) -> bytes:
    """An APPEND header as a peer reading the specification's grammar might build it: each
    entry a table {stream_id, request_index, batch_length} instead of a struct; with
    ``cap_notice`` (stream_id, range_index), a primary's forward carrying one."""
    b = flatbuffers.Builder(256)
    tables = []
    for stream_id, request_index, batch_length in entries:
        b.StartObject(3)
        b.PrependInt64Slot(0, stream_id, -1)
        b.PrependInt32Slot(1, request_index, 0)
        b.PrependInt32Slot(2, batch_length, 0)
        tables.append(b.EndObject())
    b.StartVector(4, len(tables), 4)
    for t in reversed(tables):
        b.PrependUOffsetTRelative(t)
    vec = b.EndVector()
    notice = None
    if cap_notice is not None:
        b.StartObject(2)
        b.PrependInt64Slot(0, cap_notice[0], -1)
        b.PrependInt32Slot(1, cap_notice[1], -1)
        notice = b.EndObject()
    b.StartObject(3 if notice is None else 5)
    b.PrependInt32Slot(0, timeout_ms, 0)
    b.PrependUOffsetTRelativeSlot(1, vec, 0)
    if notice is not None:
        b.PrependInt64Slot(2, 10, -1)  # committed_offset
        b.PrependInt32Slot(3, 0, -1)  # range_index
        b.PrependUOffsetTRelativeSlot(4, notice, 0)
    b.Finish(b.EndObject())
    return bytes(b.Output())


@pytest.mark.parametrize("entries", [
    [(7, 0, 100)], [(7, 0, 100), (8, 1, 50)], [(2**40, i, 10) for i in range(20)]])
def test_append_entries_sent_as_tables_are_refused_naming_the_struct(entries):
    data = append_request_with_table_entries(entries)
    for buf in (data, memoryview(bytearray(data))):
        with pytest.raises(HeaderError, match=r"AppendRequest: append_requests holds "
                                              rf"{len(entries)} offset\(s\) to tables, but "
                                              r"AppendEntry is a struct: each entry is 16 "
                                              r"bytes"):
            AppendRequest.from_flatbuffers(buf)


def test_struct_entries_that_look_a_little_like_offsets_are_read_as_structs():
    # Small stream ids and lengths are also small "offsets"; only a whole vector of valid
    # offsets to valid tables is taken for tables.
    for entries in ([AppendEntry(s, 0, 0) for s in (4, 8, 12, 16)],
                    [AppendEntry(8, 8, 8)], [AppendEntry(12, 4, 4)], [AppendEntry(4, 0, 0)]):
        msg = AppendRequest(1, entries)
        for data in (msg.to_flatbuffers(), _flatbuf.Codec.encode(AppendRequest._CODEC, msg),
                     gen_write(msg)):
            assert AppendRequest.from_flatbuffers(data) == msg


def test_no_one_entry_append_is_taken_for_a_table_vector():
    # Found by integration/bench/slow_links.py: a client appending 1 MiB batches (one per
    # frame) to stream 8 had batch 32 refused, its struct taken for an offset to a table
    # whose vtable had no field. With one entry, only the entry's own words can look like an
    # offset and a vtable: sweep every small stream id and request index.
    for stream_id in range(0, 64):
        for request_index in range(0, 160):
            for batch_length in (0, 28, 1 << 20, (1 << 20) + 6, 16 * 1024 * 1024):
                msg = AppendRequest(30_000, [AppendEntry(stream_id, request_index,
                                                         batch_length)])
                for data in (msg.to_flatbuffers(),
                             _flatbuf.Codec.encode(AppendRequest._CODEC, msg)):
                    assert AppendRequest.from_flatbuffers(data) == msg


def test_no_one_entry_forward_is_taken_for_a_table_vector():
    # Found by hypothesis in CI: a forward (the generic layout) of one entry to stream 24 with
    # a cap notice was refused: the entry's first word, read as an offset, reached the cap
    # notice's table, which has an AppendEntry table's shape. The message's own tables are
    # never entries: sweep every small stream id against forwards with and without them.
    notices = (None, RangeId(0, 0), RangeId(7, 3), RangeId(-1, -1), RangeId(2**40, 0))
    for stream_id in range(0, 64):
        for request_index, batch_length in ((0, 0), (1, 28), (5, 1 << 20)):
            for notice in notices:
                for committed, range_index in ((0, 0), (-1, 2), (1 << 33, 7)):
                    msg = AppendRequest(0, [AppendEntry(stream_id, request_index,
                                                        batch_length)],
                                        committed, range_index, notice)
                    for data in (msg.to_flatbuffers(),
                                 _flatbuf.Codec.encode(AppendRequest._CODEC, msg),
                                 gen_write(msg)):
                        assert AppendRequest.from_flatbuffers(data) == msg


def test_no_forward_with_producers_is_taken_for_a_table_vector():
    # Found by hypothesis: a forward of one entry to stream 56 carrying its producers (what
    # a primary sends its secondaries for idempotent appends) was refused: the entry's first
    # word, read as an offset, reached bytes inside the producers vector that read as a
    # table. No part of the message's other fields can hold an entry table: sweep every small
    # stream id against forwards with one and two producers.
    producer_sets = ([ProducerSequence(0, 40, 0)],
                     [ProducerSequence(0, 40, 0), ProducerSequence(0, 0, 0)],
                     [ProducerSequence(2**62 + 9, 7, 3)],
                     [ProducerSequence(5, 1, 2), ProducerSequence(12, 3, 4)])
    for stream_id in range(0, 96):
        for producers in producer_sets:
            for notice in (None, RangeId(0, 0)):
                msg = AppendRequest(0, [AppendEntry(stream_id, 0, 0)], 0, 0, notice,
                                    producers=producers)
                for data in (msg.to_flatbuffers(),
                             _flatbuf.Codec.encode(AppendRequest._CODEC, msg),
                             gen_write(msg)):
                    assert AppendRequest.from_flatbuffers(data) == msg


def test_table_entries_next_to_a_cap_notice_are_still_refused():
    # A forward built with entry tables and a cap notice: leaving the message's own tables
    # out of the check must not let real entry tables through.
    data = append_request_with_table_entries([(7, 0, 100), (9, 1, 50)], cap_notice=(7, 3))
    with pytest.raises(HeaderError, match=r"holds 2 offset\(s\) to tables, but AppendEntry is "
                                          r"a struct"):
        AppendRequest.from_flatbuffers(data)


def test_table_entries_behind_the_packed_layouts_head_are_refused_too():
    # The exact head the packed codec writes (so its fast reader looks at it), then one offset
    # to an AppendEntry table: vtable at 36, table at 48 {stream_id, request_index,
    # batch_length}.
    head = struct.pack("<I4HiiI4xI", 12, 8, 12, 4, 8, 8, 500, 8, 1)
    data = head + struct.pack("<I", 16) + struct.pack("<5H2x", 10, 20, 4, 12, 16) + \
        struct.pack("<iqii", 12, 7, 0, 100)
    with pytest.raises(HeaderError, match=r"1 offset\(s\) to tables, but AppendEntry is a "
                                          r"struct"):
        AppendRequest.from_flatbuffers(data)


# ---- the byte-for-byte path of the rows codecs (all statuses OK) ------------------------------


def _rows_messages(cls, n, rng):
    """A ``cls`` header of ``n`` items, every status OK, values from each field's extremes."""
    def value(bits=32, signed=True):
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        return rng.choice([lo, hi, 0, -1 if signed else 1, rng.randint(lo, hi)])

    if cls is AppendResponse:
        return AppendResponse(value(), OK, [
            AppendResult(value(64), value(), value(64), value(64)) for _ in range(n)])
    if cls is FetchResponse:
        return FetchResponse(value(), OK, [FetchResult(value(64), value(), value())
                                           for _ in range(n)])
    return FetchRequest(value(), value(), [FetchEntry(value(64), value(), value(64), value())
                                           for _ in range(n)])


@pytest.mark.parametrize("cls", [AppendResponse, FetchResponse, FetchRequest],
                         ids=lambda c: c.__name__)
def test_rows_headers_with_ok_statuses_are_read_byte_for_byte_and_agree(cls, monkeypatch):
    codec = cls._CODEC
    rng = random.Random(18)
    exact_reads = []
    read_exact = codec._read_exact
    monkeypatch.setattr(codec, "_read_exact",
                        lambda *args: exact_reads.append(1) or read_exact(*args))
    for n in (0, 1, 2, 5, 64):
        for _ in range(20 if n <= 5 else 2):
            msg = _rows_messages(cls, n, rng)
            data = msg.to_flatbuffers()
            before = len(exact_reads)
            assert cls.from_flatbuffers(data) == msg
            assert cls.from_flatbuffers(memoryview(bytearray(data))) == msg
            assert len(exact_reads) == before + 2, (n, msg)
            assert gen_read(cls, data) == msg
            # Any byte that is not a value changed (an offset, a vtable, padding): the header
            # is not taken for the fixed layout, and reads as the generic reader reads it.
            for at in range(len(data) if n <= 5 else 0):
                changed = bytearray(data)
                changed[at] ^= 0x5A
                state = _flatbuf._State(len(changed))
                try:
                    generic = _flatbuf.Codec.read_root(codec, changed, len(changed), state)
                except (messages.HeaderError, struct.error, IndexError, ValueError):
                    with pytest.raises(messages.HeaderError):
                        cls.from_flatbuffers(bytes(changed))
                    continue
                got = cls.from_flatbuffers(bytes(changed))
                assert got == generic, (n, at)
    # A header for more items than the fixed layouts cover takes the other readers.
    many = _rows_messages(cls, 65, rng)
    before = len(exact_reads)
    assert cls.from_flatbuffers(many.to_flatbuffers()) == many
    assert len(exact_reads) == before
