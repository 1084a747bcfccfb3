"""The connector's options: one table of names, defaults and parsers, one dataclass per use.

Spark hands a data source its options in a case-insensitive map (keys lower-cased), so names are
matched case-insensitively. Every option a query carries is checked when the query is planned:
an unknown name fails with a did-you-mean, a bad value fails with a ``ValueError`` that names the
option, the value and what is allowed.
"""

from __future__ import annotations

import datetime as dt
import difflib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sbp_spark.client.config import (
    DEFAULT_FETCH_MAX_BYTES,
    DEFAULT_MAX_INFLIGHT_FRAMES,
    ClientConfig,
    read_token_file,
)
from sbp_spark.protocol.constants import MAX_BATCH_BYTES, MAX_REPLICAS
from sbp_spark.protocol.names import CONSUMER_NAME_RULE, consumer_name_problem, parse_stream_ref

from .zones import arrow_zone

# Sentinels in offset specifications, as in Spark's Kafka source.
EARLIEST = -2
LATEST = -1
# Ours: startingOffsets=committed, the positions the consumer of option 'consumer' recorded.
COMMITTED = -3

# batch_max_bytes of a FETCH entry is an int32 on the wire.
MAX_FETCH_BYTES = (1 << 31) - 1
# record_count of an envelope is an int32.
MAX_BATCH_RECORDS = (1 << 31) - 1

# Options Spark itself adds to a source's options; they are not ours to reject.
SPARK_PROVIDED = frozenset({"checkpointlocation"})

PAYLOADS = ("records", "arrow")
TIME_STRATEGIES = ("error", "latest")
COMPRESSIONS = ("none", "lz4", "zstd")
SCHEMA_COMPATIBILITIES = ("none", "backward")


class OptionError(ValueError):
    """A connector option with a bad name or value."""




# -- value parsers ---------------------------------------------------------------------------


def _fail(name: str, value: str, allowed: str) -> OptionError:
    return OptionError(f"option '{name}' = {value!r} is not valid: expected {allowed}")


def parse_bool(name: str, value: str) -> bool:
    text = value.strip().lower()
    if text == "true":
        return True
    if text == "false":
        return False
    raise _fail(name, value, "true or false")


def parse_int(name: str, value: str, low: int, high: int | None = None,
              allowed: str | None = None) -> int:
    text = value.strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        raise _fail(name, value, allowed or _range_text(low, high))
    number = int(text)
    if number < low or (high is not None and number > high):
        raise _fail(name, value, allowed or _range_text(low, high))
    return number


def _range_text(low: int, high: int | None) -> str:
    if high is None:
        return f"an integer >= {low}"
    return f"an integer between {low} and {high}"


_SIZE_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
                "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
                "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(name: str, value: str, low: int, high: int) -> int:
    """A byte count: plain digits or digits with a binary suffix (``64k``, ``4m``, ``1g``)."""
    allowed = f"a byte count between {low} and {high} (digits, optionally with k, m or g)"
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", value.strip().lower())
    if not match or match.group(2) not in _SIZE_SUFFIX:
        raise _fail(name, value, allowed)
    number = int(match.group(1)) * _SIZE_SUFFIX[match.group(2)]
    if not low <= number <= high:
        raise _fail(name, value, allowed)
    return number


_DURATION_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000,
                     "d": 86_400_000}


# The latest time a Spark timestamp (microseconds in 64 bits) holds, in ms: no time or duration
# option goes past it, so sums of times and margins stay within 64 bits wherever they are used.
MAX_TIME_MS = (2**63 - 1) // 1000


def parse_duration_ms(name: str, value: str) -> int:
    """A duration in milliseconds: plain digits (ms) or digits with ms, s, m, h or d."""
    match = re.fullmatch(r"(\d+)\s*([a-z]*)", value.strip().lower())
    unit = match.group(2) if match else None
    if not match or (unit and unit not in _DURATION_UNIT_MS):
        raise _fail(name, value, "a duration such as 500ms, 30s, 15m, 1h (plain digits = ms)")
    ms = int(match.group(1)) * (_DURATION_UNIT_MS[unit] if unit else 1)
    if ms > MAX_TIME_MS:
        raise _fail(name, value, f"a duration of at most {MAX_TIME_MS} ms")
    return ms


def parse_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    text = value.strip().lower()
    if text not in choices:
        raise _fail(name, value, "one of " + ", ".join(choices))
    return text


def parse_time_zone(name: str, value: str) -> str:
    """A time zone as Spark names them (a region such as America/New_York, an offset such as
    +05:30, UTC)."""
    try:
        return arrow_zone(value)
    except ValueError:
        raise _fail(name, value, "a time zone such as America/New_York, +05:30 or UTC") from None


def parse_pd(name: str, value: str) -> tuple[str, ...]:
    """PD addresses ``host:port[,host:port]``."""
    addresses = []
    for part in value.split(","):
        address = part.strip()
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _fail(name, value, "host:port[,host:port...] with ports 1-65535")
        addresses.append(address)
    return tuple(addresses)


# Stream ids are signed 64-bit integers on the wire: a larger one could only fail when the
# first request is encoded, with a message that names no option.
MAX_STREAM_ID = (1 << 63) - 1


# Option 'streams' = '*': every live stream, those created while a streaming query runs too.
EVERY_STREAM = "*"


def _stream_ref(name: str, value: str, part: str, allowed: str) -> int | str:
    """One stream of an option's value: an id (digits) or a name (``protocol.names``)."""
    try:
        ref = parse_stream_ref(part)
    except ValueError as exc:
        raise OptionError(f"option '{name}' = {value!r}: {exc}") from None
    if isinstance(ref, int) and ref > MAX_STREAM_ID:
        raise OptionError(f"option '{name}' = {value!r} is not valid: {part} is no stream id "
                          f"(ids are 0 to {MAX_STREAM_ID})")
    return ref


def parse_stream(name: str, value: str) -> int | str:
    """The stream of a write: its id or its name."""
    return _stream_ref(name, value, value,
                       f"a stream id (an integer from 0 to {MAX_STREAM_ID}) or a stream name")


def parse_stream_refs(name: str, value: str) -> tuple[int | str, ...]:
    """A comma list of streams by id or name (``1,orders,7``), duplicates dropped, order kept;
    ``*`` alone: every stream (``(EVERY_STREAM,)``)."""
    allowed = ("a comma-separated list of stream ids and names such as 1,orders,7, or '*' for "
               "every stream")
    parts = [p.strip() for p in value.split(",")]
    if not value.strip() or any(not p for p in parts):
        raise _fail(name, value, allowed)
    if EVERY_STREAM in parts:
        if len(parts) > 1:
            raise OptionError(f"option '{name}' = {value!r}: '*' (every stream) stands alone")
        return (EVERY_STREAM,)
    refs: list[int | str] = []
    for part in parts:
        ref = _stream_ref(name, value, part, allowed)
        if ref not in refs:
            refs.append(ref)
    return tuple(refs)


def parse_consumer(name: str, value: str) -> str:
    """A named consumer (``protocol.names.consumer_name_problem``)."""
    problem = consumer_name_problem(value.strip())
    if problem is not None:
        raise _fail(name, value, f"a consumer name ({CONSUMER_NAME_RULE})")
    return value.strip()


def parse_pattern(name: str, value: str) -> str:
    """A regular expression (Python's ``re``), matched against whole stream names."""
    if not value or any(c.isspace() for c in value):
        # Names hold no whitespace: a pattern with some would match nothing, silently.
        raise _fail(name, value, "a regular expression over stream names such as orders-.*, "
                    "without whitespace (no stream name has any)")
    try:
        re.compile(value)
    except re.error as exc:
        raise OptionError(f"option '{name}' = {value!r} is not a regular expression: "
                          f"{exc}") from None
    return value


@dataclass(frozen=True)
class StreamSelection:
    """The streams a read names when they are not all ids: ids and names (``refs``), every
    live stream (``every``: ``streams '*'``), or the named streams whose whole name matches
    ``pattern`` (``streamPattern``). Names are looked up when the read is planned; a pattern
    or ``*`` is matched again while a streaming query runs (``dynamic``)."""

    refs: tuple[int | str, ...] = ()
    pattern: str | None = None
    every: bool = False

    @property
    def dynamic(self) -> bool:
        return self.every or self.pattern is not None

    def matches(self, name: str) -> bool:
        """Whether a live stream named ``name`` ("" for none) is one of a dynamic
        selection's."""
        if self.every:
            return True
        return (self.pattern is not None and bool(name)
                and re.fullmatch(self.pattern, name) is not None)

    def describe(self) -> str:
        """The selection as options give it, for messages."""
        if self.every:
            return "streams '*'"
        if self.pattern is not None:
            return f"streamPattern {self.pattern!r}"
        return "streams " + ",".join(str(r) for r in self.refs)


def _check_named_once(name: str, value: str, keys: Iterable[object]) -> None:
    """A JSON object of positions may name each stream once ("7" and "07" are one stream)."""
    seen: dict[int, str] = {}
    for key in keys:
        sid = int(str(key))
        if sid in seen:
            raise OptionError(f"option '{name}' = {value!r} names stream {sid} twice "
                              f"({seen[sid]!r} and {str(key)!r}): give each stream one position")
        seen[sid] = str(key)


@dataclass(frozen=True)
class OffsetSpec:
    """Where reading starts or ends in each stream.

    ``default`` (EARLIEST, LATEST, or unused when every stream is listed) applies to streams
    not in ``per_stream``; values in ``per_stream`` are offsets or the EARLIEST/LATEST sentinels.
    """

    default: int
    per_stream: tuple[tuple[int, int], ...] = ()

    def for_stream(self, stream_id: int) -> int:
        """The offset (or sentinel) for ``stream_id``."""
        for sid, offset in self.per_stream:
            if sid == stream_id:
                return offset
        return self.default

    def to_json(self) -> str:
        return json.dumps({str(sid): off for sid, off in self.per_stream})


def parse_offsets(name: str, value: str, default: int, *, allow_earliest: bool = True,
                  allow_latest: bool = True, allow_committed: bool = False,
                  streams: tuple[int, ...] | None = None) -> OffsetSpec:
    """``earliest``, ``latest``, ``committed`` (where allowed) or a JSON object
    ``{"<stream_id>": offset}``.

    Streams the JSON does not list get ``default``. ``allow_*`` forbid sentinels that make no
    sense at this end of a batch read; ``streams`` (when given) is what the JSON may name.
    """
    words = (["earliest"] if allow_earliest else []) + (["latest"] if allow_latest else [])
    words += ["committed"] if allow_committed else []
    allowed = " or ".join(words + ['a JSON object such as {"7": 120}'])
    text = value.strip()
    if text.lower() in ("earliest", "latest", "committed"):
        if text.lower() not in words:
            raise _fail(name, value, allowed)
        return OffsetSpec({"earliest": EARLIEST, "latest": LATEST,
                           "committed": COMMITTED}[text.lower()])
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise _fail(name, value, allowed) from None
    if not isinstance(parsed, dict) or not parsed:
        raise _fail(name, value, allowed)
    sentinels = ([EARLIEST] if allow_earliest else []) + ([LATEST] if allow_latest else [])
    entries: list[tuple[int, int]] = []
    for key, offset in parsed.items():
        if not re.fullmatch(r"\d+", str(key)):
            raise _fail(name, value, allowed + " whose keys are stream ids")
        sid = int(key)
        if isinstance(offset, bool) or not isinstance(offset, int) or (
                offset < 0 and offset not in sentinels):
            what = ", ".join(str(s) for s in sentinels)
            raise _fail(name, value, allowed + " whose values are offsets >= 0"
                        + (f" (or {what})" if what else ""))
        if streams is not None and sid not in streams:
            raise OptionError(
                f"option '{name}' = {value!r} names stream {sid}, which is not in option "
                f"'streams' ({','.join(str(s) for s in streams)})")
        entries.append((sid, offset))
    _check_named_once(name, value, parsed)
    return OffsetSpec(default, tuple(sorted(entries)))


@dataclass(frozen=True)
class TimeSpec:
    """Times (ms since the epoch) to position streams at: ``default`` for every stream not in
    ``per_stream`` (None: those streams are positioned by offsets)."""

    default: int | None
    per_stream: tuple[tuple[int, int], ...] = ()

    def for_stream(self, stream_id: int) -> int | None:
        """The time for ``stream_id``, or None."""
        return dict(self.per_stream).get(stream_id, self.default)


def parse_time(name: str, value: str) -> TimeSpec:
    """One time for every stream: ms since the epoch."""
    return TimeSpec(parse_int(name, value, 0, MAX_TIME_MS,
                              allowed=f"a time in ms since the epoch (0 to {MAX_TIME_MS})"))


def parse_times(name: str, value: str, streams: tuple[int, ...] | None = None) -> TimeSpec:
    """A JSON object ``{"<stream_id>": ms}``."""
    allowed = ('a JSON object {"<stream_id>": ms since the epoch} such as {"7": 1700000000000} '
               f"(times 0 to {MAX_TIME_MS})")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise _fail(name, value, allowed) from None
    if not isinstance(parsed, dict) or not parsed or any(
            not re.fullmatch(r"\d+", str(k)) or isinstance(v, bool) or not isinstance(v, int)
            or not 0 <= v <= MAX_TIME_MS for k, v in parsed.items()):
        raise _fail(name, value, allowed)
    _check_named_once(name, value, parsed)
    entries = tuple(sorted((int(k), v) for k, v in parsed.items()))
    unknown = [sid for sid, _ in entries if streams is not None and sid not in streams]
    if unknown:
        raise OptionError(
            f"option '{name}' = {value!r} names stream {unknown[0]}, which is not in option "
            f"'streams' ({','.join(str(s) for s in streams or ())})")
    return TimeSpec(None, entries)


def parse_out_of_orderness(name: str, value: str) -> int | None:
    """A duration, or ``unbounded`` (None)."""
    return None if value.strip().lower() == "unbounded" else parse_duration_ms(name, value)


def _time_spec(opts: _Options, one: OptionSpec, by_stream: OptionSpec, offsets: OptionSpec,
               streams: tuple[int, ...] | None) -> TimeSpec | None:
    """The time positions of one end of a read (None: positioned by offsets)."""
    given = [spec.name for spec in (one, by_stream, offsets) if opts.has(spec.name)]
    if len(given) > 1:
        raise OptionError(f"options '{given[0]}' and '{given[1]}' exclude each other: position "
                          "each end of a read one way")
    if opts.has(one.name):
        return opts.value(one)
    return opts.parse(by_stream.name, lambda n, v: parse_times(n, v, streams), None)


def parse_file(name: str, value: str) -> str:
    """A path to a readable file (the same path must work on every executor)."""
    path = value.strip()
    if not path or not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise _fail(name, value, "the path of a readable file")
    return path


_JWT_SHAPE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$")


def parse_token(name: str, value: str) -> str:
    """A signed token (a JWT: three base64url parts joined by dots). The message of a refusal
    never repeats the value: it is a secret."""
    token = value.strip()
    if not token:
        raise OptionError(f"option '{name}' is empty: give a signed token, or leave it out")
    if not _JWT_SHAPE.match(token):
        raise OptionError(f"option '{name}' is not a signed token (a JWT: three parts joined "
                          f"by dots, as `sbp token create` prints)")
    return token


def parse_retention(name: str, value: str) -> int:
    allowed = "-1 (keep forever) or a number of milliseconds >= 1"
    number = parse_int(name, value, -1, allowed=allowed)
    if number == 0:
        raise _fail(name, value, allowed)
    return number


# -- the options: one declaration each ----------------------------------------------------


@dataclass(frozen=True)
class OptionSpec:
    """One option: its canonical spelling, the default shown to users (``default``), where it
    applies and what it means (the README prints these), the check of a value on its own
    (``check``, also run for options an operation ignores) and the value when it is not given
    (``value``). Parsers that need more than the value (offsets checked against the stream list)
    run on top of ``check`` where the option is used."""

    name: str
    default: str
    where: str
    meaning: str
    check: Callable[[str, str], Any]
    value: Any = None


PD = OptionSpec(
    "pd", "(required)", "all",
    "placement driver address(es), host:port[,host:port...]",
    parse_pd, None)
STREAMS = OptionSpec(
    "streams", "(this or streamPattern to read)", "read (write)",
    "comma-separated stream ids and names to read (names and ids mixed; digits are ids), or "
    "'*' for every stream; a write without `stream` goes to the one stream, or routes rows "
    "by stream_id (or stream_name) among several (another stream fails it)",
    parse_stream_refs, None)
STREAM_PATTERN = OptionSpec(
    "streamPattern", "(not set)", "read",
    "read every stream whose whole name matches this regular expression (as Kafka's "
    "subscribePattern); a streaming query also reads those created while it runs",
    parse_pattern, None)
DISCOVERY_INTERVAL_MS = OptionSpec(
    "discoveryIntervalMs", "10000", "stream read",
    "with streamPattern or streams '*': how often, at most, a micro-batch looks for new "
    "matching streams",
    lambda n, v: parse_int(n, v, 0, None), 10_000)
STREAM = OptionSpec(
    "stream", "(none)", "write",
    "stream id or name every row goes to; without it each row's stream_id (or stream_name) "
    "column decides",
    parse_stream, None)
STARTING_OFFSETS = OptionSpec(
    "startingOffsets", "earliest (batch), latest (streaming)", "read",
    'earliest, latest, committed, or JSON {"<stream_id>": offset} (-2 = earliest, -1 = '
    "latest); latest and -1 only in streaming (a batch read starting at the end would read "
    "nothing); committed: where option 'consumer' recorded it had read each stream (streams "
    "without a record: committedFallback)",
    lambda n, v: parse_offsets(n, v, EARLIEST, allow_committed=True), None)
ENDING_OFFSETS = OptionSpec(
    "endingOffsets", "latest", "batch read",
    'latest, or JSON {"<stream_id>": offset} (-1 = latest): reading stops before it (an '
    "offset past the stream's end fails the read)",
    lambda n, v: parse_offsets(n, v, LATEST), OffsetSpec(LATEST))
STARTING_TIMESTAMP = OptionSpec(
    "startingTimestamp", "(none)", "read",
    "start each stream at its first record whose timestamp is at or after this time "
    "(ms since the epoch)",
    parse_time, None)
ENDING_TIMESTAMP = OptionSpec(
    "endingTimestamp", "(none)", "batch read",
    "stop each stream before its first record at or after this time (ms since the "
    "epoch); no such record: its end",
    parse_time, None)
STARTING_OFFSETS_BY_TIMESTAMP = OptionSpec(
    "startingOffsetsByTimestamp", "(none)", "read",
    'startingTimestamp per stream: JSON {"<stream_id>": ms}; streams not named '
    "start as without it",
    parse_times, None)
ENDING_OFFSETS_BY_TIMESTAMP = OptionSpec(
    "endingOffsetsByTimestamp", "(none)", "batch read",
    'endingTimestamp per stream: JSON {"<stream_id>": ms}; streams not named end at '
    "latest",
    parse_times, None)
TIME_STRATEGY = OptionSpec(
    "startingOffsetsByTimestampStrategy", "error", "read",
    "a stream with no record at or after its starting time: error, or latest (start "
    "at its end)",
    lambda n, v: parse_choice(n, v, TIME_STRATEGIES), "error")
MAX_OUT_OF_ORDERNESS = OptionSpec(
    "maxOutOfOrderness", "1m", "batch read",
    "how far a record's timestamp may be behind one stored before it: filters on "
    "timestamp narrow what is fetched by that much less (unbounded: not at all)",
    parse_out_of_orderness, 60_000)
FAIL_ON_DATA_LOSS = OptionSpec(
    "failOnDataLoss", "true", "read",
    "fail when requested offsets were trimmed away; false skips to the stream start",
    parse_bool, True)
INCLUDE_HEADERS = OptionSpec(
    "includeHeaders", "false", "read",
    "add the headers column (payload=records); writing stores a headers column "
    "whenever the DataFrame has one",
    parse_bool, False)
PAYLOAD = OptionSpec(
    "payload", "records", "read/write",
    "records (Kafka-like key/value rows) or arrow (the DataFrame's own columns)",
    lambda n, v: parse_choice(n, v, PAYLOADS), "records")
MERGE_SCHEMA = OptionSpec(
    "mergeSchema", "false", "read",
    "payload=arrow inference: union the schemas of the first and last batch of every "
    "range (default: the newest batch's schema)",
    parse_bool, False)
FETCH_MAX_BYTES = OptionSpec(
    "fetchMaxBytes", "64m", "read",
    "byte budget of one FETCH request (a partition larger than this takes several)",
    lambda n, v: parse_bytes(n, v, 1, MAX_FETCH_BYTES), DEFAULT_FETCH_MAX_BYTES)
FETCH_MAX_WAIT_MS = OptionSpec(
    "fetchMaxWaitMs", "500", "read",
    "how long a FETCH at the end of an open range waits for new records (a server waits at "
    "most 60 s per FETCH)",
    lambda n, v: parse_int(n, v, 0, 3_600_000), 500)
MAX_RECORDS_PER_PARTITION = OptionSpec(
    "maxRecordsPerPartition", "(none)", "read",
    "split a range holding more records than this into several partitions",
    lambda n, v: parse_int(n, v, 1), None)
MIN_PARTITIONS = OptionSpec(
    "minPartitions", "(none)", "read",
    "split ranges (by offset, in proportion to their size) to reach this many "
    "partitions",
    lambda n, v: parse_int(n, v, 1), None)
BATCH_MAX_RECORDS = OptionSpec(
    "batchMaxRecords", "65536", "write", "most records per SBP record batch",
    lambda n, v: parse_int(n, v, 1, MAX_BATCH_RECORDS), 65_536)
BATCH_MAX_BYTES = OptionSpec(
    "batchMaxBytes", "4m", "write",
    f"most bytes per SBP record batch (1024 to {MAX_BATCH_BYTES}; suffixes k, m)",
    lambda n, v: parse_bytes(n, v, 1024, MAX_BATCH_BYTES), 4 * 1024 * 1024)
MAX_INFLIGHT_FRAMES = OptionSpec(
    "maxInflightFrames", str(DEFAULT_MAX_INFLIGHT_FRAMES), "write",
    "APPEND frames a task keeps in flight on one connection",
    lambda n, v: parse_int(n, v, 1, 1024), DEFAULT_MAX_INFLIGHT_FRAMES)
IDEMPOTENT_APPENDS = OptionSpec(
    "idempotentAppends", "true", "write",
    "append under the client's producer id and per-range sequence numbers, so a batch the "
    "client sends again (a lost answer, a failover) is stored once; false: at least once",
    parse_bool, True)
REQUEST_TIMEOUT_MS = OptionSpec(
    "requestTimeoutMs", "30000", "read/write",
    "how long to wait for each answer frame of a request",
    lambda n, v: parse_int(n, v, 1, 24 * 3_600_000), 30_000)
RETRIES = OptionSpec(
    "retries", "(none)", "read/write",
    "most retries of one call (a read, a write's append): without it, a retriable failure "
    "(sealed range, busy or restarting server, a failover of a range server or of the PD "
    "leader) is retried, backing off, until a minute after the call began",
    lambda n, v: parse_int(n, v, 0, 1_000_000), None)
CREATE_IF_MISSING = OptionSpec(
    "createIfMissing", "false", "write",
    "create the stream of option 'stream' when no stream has that name (by id: refused); "
    "without a stream option or stream_id/stream_name column, create a new stream",
    parse_bool, False)
REPLICAS = OptionSpec(
    "replicas", "1", "write", "replicas of a stream created by createIfMissing",
    lambda n, v: parse_int(n, v, 1, MAX_REPLICAS), 1)
RETENTION_MS = OptionSpec(
    "retentionMs", "-1", "write",
    "retention of a stream created by createIfMissing (-1 keeps records forever)",
    parse_retention, -1)
COMPRESSION = OptionSpec(
    "compression", "none", "write",
    "Arrow IPC buffer compression of record-batch bodies: none, lz4, zstd",
    lambda n, v: parse_choice(n, v, COMPRESSIONS), "none")
TIME_ZONE = OptionSpec(
    "timeZone", "spark.sql.session.timeZone", "write",
    "time zone in which a TIMESTAMP_NTZ `timestamp` column's wall-clock values become record "
    "times (payload=records), as CAST(... AS TIMESTAMP) does in the session's zone",
    parse_time_zone, None)
SCHEMA_COMPATIBILITY = OptionSpec(
    "schemaCompatibility", "none", "write",
    "none, or backward: a payload=arrow write first checks that readers of its "
    "schema can read the stream's newest stored batch",
    lambda n, v: parse_choice(n, v, SCHEMA_COMPATIBILITIES), "none")
CONSUMER = OptionSpec(
    "consumer", "(none)", "read",
    "a name under which a streaming query records, in the cluster, the end offsets of each "
    "micro-batch it committed (`sbp consumers list` shows them, with the lag); a second "
    "query under the same name takes it over and the first fails; with startingOffsets="
    "committed a read starts where the name's record stands",
    parse_consumer, None)
COMMITTED_FALLBACK = OptionSpec(
    "committedFallback", "earliest", "read",
    "with startingOffsets=committed: where a stream the consumer has no record of starts, "
    "earliest or latest (streaming only)",
    lambda n, v: parse_choice(n, v, ("earliest", "latest")), "earliest")
MAX_RECORDS_PER_TRIGGER = OptionSpec(
    "maxRecordsPerTrigger", "(none)", "stream read",
    "most records one micro-batch reads",
    lambda n, v: parse_int(n, v, 1), None)
MAX_BYTES_PER_TRIGGER = OptionSpec(
    "maxBytesPerTrigger", "(none)", "stream read",
    "most bytes one micro-batch reads (estimated)",
    lambda n, v: parse_bytes(n, v, 1, 1 << 62), None)
MIN_RECORDS_PER_TRIGGER = OptionSpec(
    "minRecordsPerTrigger", "(none)", "stream read",
    "wait for this many new records (or maxTriggerDelay) before a micro-batch",
    lambda n, v: parse_int(n, v, 1), None)
MAX_TRIGGER_DELAY = OptionSpec(
    "maxTriggerDelay", "15m", "stream read",
    "longest wait for minRecordsPerTrigger (e.g. 500ms, 30s, 15m, 1h)",
    parse_duration_ms, 15 * 60_000)
SKIP_INCOMPATIBLE_BATCHES = OptionSpec(
    "skipIncompatibleBatches", "false", "stream read",
    "payload=arrow: skip stored batches that do not fit the read schema (counted in "
    "the query's progress) instead of failing the micro-batch",
    parse_bool, False)
IDEMPOTENT = OptionSpec(
    "idempotent", "false", "stream write",
    "write each micro-batch exactly once, also when Spark re-runs it",
    parse_bool, False)
TLS_ENABLED = OptionSpec(
    "tls.enabled", "false", "all", "talk to the cluster over TLS",
    parse_bool, False)
TLS_CA_FILE = OptionSpec(
    "tls.caFile", "(system trust store)", "all",
    "CA certificates (PEM) the servers' certificates must chain to",
    parse_file, None)
TLS_CERT_FILE = OptionSpec(
    "tls.certFile", "(none)", "all",
    "client certificate (PEM) for clusters that require one (mutual TLS)",
    parse_file, None)
TLS_KEY_FILE = OptionSpec(
    "tls.keyFile", "(none)", "all", "private key (PEM) of tls.certFile",
    parse_file, None)
TOKEN = OptionSpec(
    "token", "(none)", "all",
    "signed token for clusters that authenticate; never printed (Spark redacts options "
    "named like it in plans and its UI; prefer tokenFile, which keeps it out of the plan)",
    parse_token, None)
TOKEN_FILE = OptionSpec(
    "tokenFile", "(none)", "all",
    "file holding the token, read where the cluster is called (readable on every executor)",
    parse_file, None)

OPTIONS: tuple[OptionSpec, ...] = (
    PD,
    STREAMS,
    STREAM_PATTERN,
    STREAM,
    STARTING_OFFSETS,
    ENDING_OFFSETS,
    STARTING_TIMESTAMP,
    ENDING_TIMESTAMP,
    STARTING_OFFSETS_BY_TIMESTAMP,
    ENDING_OFFSETS_BY_TIMESTAMP,
    TIME_STRATEGY,
    MAX_OUT_OF_ORDERNESS,
    FAIL_ON_DATA_LOSS,
    INCLUDE_HEADERS,
    PAYLOAD,
    MERGE_SCHEMA,
    FETCH_MAX_BYTES,
    FETCH_MAX_WAIT_MS,
    MAX_RECORDS_PER_PARTITION,
    MIN_PARTITIONS,
    BATCH_MAX_RECORDS,
    BATCH_MAX_BYTES,
    MAX_INFLIGHT_FRAMES,
    IDEMPOTENT_APPENDS,
    REQUEST_TIMEOUT_MS,
    RETRIES,
    CREATE_IF_MISSING,
    REPLICAS,
    RETENTION_MS,
    COMPRESSION,
    TIME_ZONE,
    SCHEMA_COMPATIBILITY,
    MAX_RECORDS_PER_TRIGGER,
    MAX_BYTES_PER_TRIGGER,
    MIN_RECORDS_PER_TRIGGER,
    MAX_TRIGGER_DELAY,
    SKIP_INCOMPATIBLE_BATCHES,
    DISCOVERY_INTERVAL_MS,
    CONSUMER,
    COMMITTED_FALLBACK,
    IDEMPOTENT,
    TLS_ENABLED,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    TOKEN,
    TOKEN_FILE,
)
_CANONICAL: dict[str, str] = {spec.name.lower(): spec.name for spec in OPTIONS}


# -- names -----------------------------------------------------------------------------------


def check_option_names(options: Mapping[str, Any]) -> None:
    """Fail on any option name the connector does not know (case-insensitive)."""
    for raw in options:
        key = str(raw).lower()
        if key in _CANONICAL or key in SPARK_PROVIDED:
            continue
        if key == "path":
            raise OptionError(
                "format sbp takes no path: name streams with option 'streams' (reading) or "
                "'stream' (writing)")
        close = difflib.get_close_matches(key, list(_CANONICAL), n=1, cutoff=0.6)
        hint = f"; did you mean '{_CANONICAL[close[0]]}'?" if close else ""
        raise OptionError(
            f"unknown option '{raw}' for format sbp{hint} Known options: "
            + ", ".join(spec.name for spec in OPTIONS))


class _Options:
    """Case-insensitive access to raw option strings, with the canonical name for messages."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        check_option_names(options)
        self._values = {str(k).lower(): str(v) for k, v in options.items() if v is not None}

    def get(self, name: str) -> str | None:
        return self._values.get(name.lower())

    def has(self, name: str) -> bool:
        return name.lower() in self._values

    def parse(self, name: str, parser: Callable[[str, str], Any], default: Any) -> Any:
        raw = self.get(name)
        return default if raw is None else parser(name, raw)

    def value(self, spec: OptionSpec) -> Any:
        """The option's value, checked, or its declared default."""
        return self.parse(spec.name, spec.check, spec.value)

    def require(self, name: str, parser: Callable[[str, str], Any], purpose: str) -> Any:
        raw = self.get(name)
        if raw is None or not raw.strip():
            raise OptionError(f"option '{name}' is required {purpose}")
        return parser(name, raw)


# -- the dataclasses -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientOptions:
    """What every operation needs to reach the cluster."""

    pd: tuple[str, ...]
    request_timeout_ms: int = REQUEST_TIMEOUT_MS.value
    retries: int | None = RETRIES.value
    max_inflight_frames: int = MAX_INFLIGHT_FRAMES.value
    idempotent_appends: bool = IDEMPOTENT_APPENDS.value
    tls: bool = TLS_ENABLED.value
    tls_ca_file: str | None = TLS_CA_FILE.value
    tls_cert_file: str | None = TLS_CERT_FILE.value
    tls_key_file: str | None = TLS_KEY_FILE.value
    # A secret: out of repr, so no message, log line or plan string shows it.
    token: str | None = field(default=TOKEN.value, repr=False)
    token_file: str | None = TOKEN_FILE.value

    def client_config(self) -> ClientConfig:
        """The client settings these options stand for (``tokenFile`` read now, where the
        cluster is called: on an executor, the executor's copy of the file)."""
        token = self.token
        if token is None and self.token_file is not None:
            try:
                token = read_token_file(self.token_file)
            except ValueError as exc:
                raise OptionError(f"option 'tokenFile': {exc}") from None
        return ClientConfig(request_timeout_s=self.request_timeout_ms / 1000.0,
                            retries=self.retries, max_inflight_frames=self.max_inflight_frames,
                            idempotent=self.idempotent_appends, tls=self.tls,
                            tls_ca_file=self.tls_ca_file, tls_cert_file=self.tls_cert_file,
                            tls_key_file=self.tls_key_file, token=token)


def _tls_options(opts: _Options) -> dict[str, Any]:
    enabled = opts.value(TLS_ENABLED)
    files = {field: opts.value(spec) for field, spec in (
        ("tls_ca_file", TLS_CA_FILE), ("tls_cert_file", TLS_CERT_FILE),
        ("tls_key_file", TLS_KEY_FILE))}
    given = [spec.name for spec in (TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE)
             if opts.has(spec.name)]
    if given and not enabled:
        raise OptionError(f"option '{given[0]}' needs 'tls.enabled' = true")
    if (files["tls_cert_file"] is None) != (files["tls_key_file"] is None):
        raise OptionError("options 'tls.certFile' and 'tls.keyFile' go together")
    return {"tls": enabled, **files}


def _client_options(opts: _Options) -> ClientOptions:
    return ClientOptions(
        pd=opts.require(PD.name, PD.check, "(the placement driver address, host:port)"),
        request_timeout_ms=opts.value(REQUEST_TIMEOUT_MS),
        retries=opts.value(RETRIES),
        max_inflight_frames=opts.value(MAX_INFLIGHT_FRAMES),
        idempotent_appends=opts.value(IDEMPOTENT_APPENDS),
        **_tls_options(opts),
        **_token_options(opts),
    )


def _token_options(opts: _Options) -> dict[str, Any]:
    if opts.has(TOKEN.name) and opts.has(TOKEN_FILE.name):
        raise OptionError("options 'token' and 'tokenFile' both give the token: give one")
    return {"token": opts.value(TOKEN), "token_file": opts.value(TOKEN_FILE)}


@dataclass(frozen=True)
class ReadOptions:
    """A batch read (and the shared part of a streaming read)."""

    client: ClientOptions
    # The streams' ids; () until ``selection`` (names, a pattern, '*') is resolved
    # (``stream_names.resolve_read``).
    streams: tuple[int, ...]
    starting: OffsetSpec = OffsetSpec(EARLIEST)
    ending: OffsetSpec = OffsetSpec(LATEST)
    fail_on_data_loss: bool = FAIL_ON_DATA_LOSS.value
    include_headers: bool = INCLUDE_HEADERS.value
    payload: str = PAYLOAD.value
    fetch_max_bytes: int = FETCH_MAX_BYTES.value
    fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS.value
    max_records_per_partition: int | None = MAX_RECORDS_PER_PARTITION.value
    min_partitions: int | None = MIN_PARTITIONS.value
    starting_time: TimeSpec | None = None
    ending_time: TimeSpec | None = None
    time_strategy: str = TIME_STRATEGY.value
    max_out_of_orderness_ms: int | None = MAX_OUT_OF_ORDERNESS.value
    merge_schema: bool = MERGE_SCHEMA.value
    # None: option 'streams' gave ids only, which ``streams`` holds.
    selection: StreamSelection | None = None
    consumer: str | None = CONSUMER.value
    # Where startingOffsets=committed starts a stream the consumer has no record of.
    committed_fallback: int = EARLIEST


@dataclass(frozen=True)
class StreamReadOptions:
    """A streaming read: the read options plus admission control."""

    read: ReadOptions
    max_records_per_trigger: int | None = MAX_RECORDS_PER_TRIGGER.value
    max_bytes_per_trigger: int | None = MAX_BYTES_PER_TRIGGER.value
    min_records_per_trigger: int | None = MIN_RECORDS_PER_TRIGGER.value
    max_trigger_delay_ms: int = MAX_TRIGGER_DELAY.value
    skip_incompatible_batches: bool = SKIP_INCOMPATIBLE_BATCHES.value
    discovery_interval_ms: int = DISCOVERY_INTERVAL_MS.value


@dataclass(frozen=True)
class WriteOptions:
    """A batch write (and the shared part of a streaming write)."""

    client: ClientOptions
    # An id, or a name looked up (``stream_names.resolve_write``) before tasks run.
    stream: int | str | None = STREAM.value
    # Without 'stream': the streams rows may route to by stream_id (None: any); names are
    # looked up before tasks run.
    routes: tuple[int | str, ...] | None = None
    payload: str = PAYLOAD.value
    batch_max_records: int = BATCH_MAX_RECORDS.value
    batch_max_bytes: int = BATCH_MAX_BYTES.value
    create_if_missing: bool = CREATE_IF_MISSING.value
    replicas: int = REPLICAS.value
    retention_ms: int = RETENTION_MS.value
    compression: str = COMPRESSION.value
    schema_compatibility: str = SCHEMA_COMPATIBILITY.value
    # The zone of TIMESTAMP_NTZ record times (None: the session's, read in each task).
    time_zone: str | None = TIME_ZONE.value


@dataclass(frozen=True)
class StreamWriteOptions:
    """A streaming write: the write options plus the delivery mode."""

    write: WriteOptions
    idempotent: bool = IDEMPOTENT.value


def _check_all_values(opts: _Options) -> None:
    """Validate the values of options that this operation does not use (typos in values of
    options meant for another operation still fail early)."""
    for spec in OPTIONS:
        if opts.has(spec.name):
            opts.value(spec)


def _parse_common_read(opts: _Options, *, streaming: bool | None) -> ReadOptions:
    """The read options; ``streaming`` None: not known yet (``parse_schema_options``)."""
    if opts.has("stream") and not opts.has("streams"):
        raise OptionError(
            "option 'stream' is for writing; to read, name the streams with option 'streams' "
            "(for example streams=7 or streams=1,2)")
    _check_all_values(opts)
    pattern = opts.value(STREAM_PATTERN)
    if pattern is not None and opts.has(STREAMS.name):
        raise OptionError("options 'streams' and 'streamPattern' exclude each other: name the "
                          "streams, or give the pattern their names match")
    refs = (() if pattern is not None else opts.require(
        STREAMS.name, STREAMS.check,
        "to read (comma-separated stream ids or names such as 1,orders; '*' for every stream; "
        "or option streamPattern)"))
    selection = None
    if pattern is not None or any(not isinstance(r, int) for r in refs):
        selection = StreamSelection(() if refs == (EVERY_STREAM,) else refs, pattern,
                                    refs == (EVERY_STREAM,))
    # The ids, when options gave ids only; otherwise known once looked up, and positions per
    # stream are checked then (``stream_names.resolve_read``).
    streams: tuple[int, ...] = tuple(int(r) for r in refs) if selection is None else ()
    known = streams if selection is None else None
    starting = opts.parse(
        STARTING_OFFSETS.name,
        lambda n, v: parse_offsets(n, v, LATEST if streaming else EARLIEST,
                                   allow_latest=streaming is not False, allow_committed=True,
                                   streams=known),
        OffsetSpec(LATEST if streaming else EARLIEST))
    consumer, fallback = _consumer_options(opts, starting, streaming)
    starting_time = _time_spec(opts, STARTING_TIMESTAMP, STARTING_OFFSETS_BY_TIMESTAMP,
                               STARTING_OFFSETS, known)
    if opts.has("startingOffsetsByTimestampStrategy") and starting_time is None:
        raise OptionError("option 'startingOffsetsByTimestampStrategy' needs "
                          "'startingTimestamp' or 'startingOffsetsByTimestamp'")
    ending_time = None
    if streaming:
        for name in ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp"):
            if opts.has(name):
                raise OptionError(f"option '{name}' is for batch reads; a streaming read has "
                                  "no end")
        ending = OffsetSpec(LATEST)
    else:
        ending = opts.parse(
            ENDING_OFFSETS.name,
            lambda n, v: parse_offsets(n, v, LATEST, allow_earliest=False, streams=known),
            OffsetSpec(LATEST))
        ending_time = _time_spec(opts, ENDING_TIMESTAMP, ENDING_OFFSETS_BY_TIMESTAMP,
                                 ENDING_OFFSETS, known)
        if starting_time and ending_time:
            _check_time_order(starting_time, ending_time, streams)
    payload = opts.value(PAYLOAD)
    include_headers = opts.value(INCLUDE_HEADERS)
    if include_headers and payload == "arrow":
        raise OptionError("option 'includeHeaders' = 'true' needs payload=records: "
                          "payload=arrow rows have no headers")
    return ReadOptions(
        client=_client_options(opts),
        streams=streams,
        starting=starting,
        ending=ending,
        fail_on_data_loss=opts.value(FAIL_ON_DATA_LOSS),
        include_headers=include_headers,
        payload=payload,
        fetch_max_bytes=opts.value(FETCH_MAX_BYTES),
        fetch_max_wait_ms=opts.value(FETCH_MAX_WAIT_MS),
        max_records_per_partition=opts.value(MAX_RECORDS_PER_PARTITION),
        min_partitions=opts.value(MIN_PARTITIONS),
        starting_time=starting_time,
        ending_time=ending_time,
        time_strategy=opts.value(TIME_STRATEGY),
        max_out_of_orderness_ms=opts.value(MAX_OUT_OF_ORDERNESS),
        merge_schema=_arrow_only(opts, MERGE_SCHEMA, payload),
        selection=selection,
        consumer=consumer,
        committed_fallback=fallback,
    )


def _consumer_options(opts: _Options, starting: OffsetSpec, streaming: bool | None
                      ) -> tuple[str | None, int]:
    """Options 'consumer' and 'committedFallback', checked against startingOffsets: (the
    consumer, where committed starts a stream it has no record of)."""
    consumer = opts.value(CONSUMER)
    committed = starting.default == COMMITTED
    if committed and consumer is None:
        raise OptionError("option 'startingOffsets' = 'committed' needs option 'consumer': "
                          "the name whose recorded positions the read starts at")
    if opts.has(COMMITTED_FALLBACK.name) and not committed:
        raise OptionError("option 'committedFallback' applies only with "
                          "startingOffsets=committed")
    if consumer is not None and streaming is False and not committed:
        raise OptionError("option 'consumer' in a batch read only says where "
                          "startingOffsets=committed starts (a batch read records no "
                          "positions): add startingOffsets=committed, or leave it out")
    fallback = opts.value(COMMITTED_FALLBACK)
    if fallback == "latest" and streaming is False:
        raise OptionError("option 'committedFallback' = 'latest' is for streaming reads: a "
                          "batch read starting a stream at its end would read nothing of it")
    return consumer, EARLIEST if fallback == "earliest" else LATEST


def _check_time_order(starting: TimeSpec, ending: TimeSpec, streams: tuple[int, ...]) -> None:
    """Refuse an end time before the start time, for every stream and whichever form (one
    time for all streams, or per stream) gives each: the read would silently hold nothing."""
    if (starting.default is not None and ending.default is not None
            and ending.default < starting.default):
        raise OptionError(f"option 'endingTimestamp' ({ending.default}) is before "
                          f"'startingTimestamp' ({starting.default})")
    start_named, end_named = dict(starting.per_stream), dict(ending.per_stream)
    for sid in streams:
        start, end = starting.for_stream(sid), ending.for_stream(sid)
        if start is None or end is None or end >= start:
            continue
        start_name = ("startingOffsetsByTimestamp" if sid in start_named
                      else "startingTimestamp")
        end_name = "endingOffsetsByTimestamp" if sid in end_named else "endingTimestamp"
        raise OptionError(
            f"option '{end_name}' ends stream {sid} at {describe_time(end)}, before option "
            f"'{start_name}' starts it at {describe_time(start)}: the read would hold none of "
            "its records; give it an end time at or after its start time")


def check_positions(options: ReadOptions) -> None:
    """Refuse positions per stream (startingOffsets, endingOffsets and their timestamp forms)
    naming a stream the read does not read, and an end time before a start time: the checks
    parsing makes when option 'streams' gives ids, made once names are looked up."""
    named = [("startingOffsets", options.starting.per_stream),
             ("endingOffsets", options.ending.per_stream)]
    for key, spec in (("startingOffsetsByTimestamp", options.starting_time),
                      ("endingOffsetsByTimestamp", options.ending_time)):
        if spec is not None:
            named.append((key, spec.per_stream))
    for key, entries in named:
        for sid, _ in entries:
            if sid not in options.streams:
                raise OptionError(
                    f"option '{key}' names stream {sid}, which is not one of the streams "
                    f"read ({','.join(map(str, options.streams)) or 'none'})")
    if options.starting_time and options.ending_time:
        _check_time_order(options.starting_time, options.ending_time, options.streams)


def describe_time(ms: int) -> str:
    """``1700000000000 (2023-11-14T22:13:20Z)`` for messages."""
    when = dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc)
    return f"{ms} ({when.isoformat(timespec='milliseconds').replace('+00:00', 'Z')})"


def _arrow_only(opts: _Options, spec: OptionSpec, payload: str) -> bool:
    """A boolean option that only payload=arrow reads use."""
    value = opts.value(spec)
    if value and payload != "arrow":
        raise OptionError(f"option '{spec.name}' = 'true' needs payload=arrow: "
                          f"payload={payload} rows have a fixed schema")
    return bool(value)


def parse_read_options(options: Mapping[str, Any]) -> ReadOptions:
    """Options of ``spark.read.format("sbp")``."""
    return _parse_common_read(_Options(options), streaming=False)


def parse_schema_options(options: Mapping[str, Any]) -> ReadOptions:
    """Read options as ``DataSource.schema()`` sees them: it runs for batch and streaming reads
    alike and cannot tell which, so it accepts what either allows (``startingOffsets=latest``
    is a streaming read's); the reader made next checks them for its kind of read."""
    return _parse_common_read(_Options(options), streaming=None)


def parse_stream_read_options(options: Mapping[str, Any]) -> StreamReadOptions:
    """Options of ``spark.readStream.format("sbp")``."""
    opts = _Options(options)
    read = _parse_common_read(opts, streaming=True)
    return StreamReadOptions(
        read=read,
        max_records_per_trigger=opts.value(MAX_RECORDS_PER_TRIGGER),
        max_bytes_per_trigger=opts.value(MAX_BYTES_PER_TRIGGER),
        min_records_per_trigger=opts.value(MIN_RECORDS_PER_TRIGGER),
        max_trigger_delay_ms=opts.value(MAX_TRIGGER_DELAY),
        skip_incompatible_batches=_arrow_only(opts, SKIP_INCOMPATIBLE_BATCHES, read.payload),
        discovery_interval_ms=opts.value(DISCOVERY_INTERVAL_MS),
    )


def _parse_common_write(opts: _Options) -> WriteOptions:
    _check_all_values(opts)
    stream = opts.value(STREAM)
    # 'streams' without 'stream' (a view or table that reads what it writes): one stream is
    # the target; among several, each row's stream_id picks one.
    streams = opts.value(STREAMS) if stream is None else None
    if streams == (EVERY_STREAM,):
        raise OptionError("option 'streams' = '*' is for reading; a write names its stream "
                          "with option 'stream' (or rows name theirs in stream_id or "
                          "stream_name)")
    if streams is not None and len(streams) == 1:
        stream, streams = streams[0], None
    if streams is not None and opts.value(CREATE_IF_MISSING):
        raise OptionError(
            "option 'createIfMissing' cannot go with option 'streams': rows route to one of "
            "the streams named by their stream_id column, and a new stream is none of them")
    payload = opts.value(PAYLOAD)
    compatibility = opts.value(SCHEMA_COMPATIBILITY)
    if compatibility != "none" and payload != "arrow":
        raise OptionError(f"option 'schemaCompatibility' = '{compatibility}' needs "
                          f"payload=arrow: payload={payload} records have a fixed schema")
    return WriteOptions(
        client=_client_options(opts),
        stream=stream,
        routes=None if streams is None else tuple(streams),
        payload=payload,
        batch_max_records=opts.value(BATCH_MAX_RECORDS),
        batch_max_bytes=opts.value(BATCH_MAX_BYTES),
        create_if_missing=opts.value(CREATE_IF_MISSING),
        replicas=opts.value(REPLICAS),
        retention_ms=opts.value(RETENTION_MS),
        compression=opts.value(COMPRESSION),
        schema_compatibility=compatibility,
        time_zone=opts.value(TIME_ZONE),
    )


def parse_write_options(options: Mapping[str, Any]) -> WriteOptions:
    """Options of ``df.write.format("sbp")``."""
    opts = _Options(options)
    if opts.value(IDEMPOTENT):
        # Taken silently, it would promise exactly once to a write that is at least once.
        raise OptionError(
            "option 'idempotent' = 'true' is for streaming writes (writeStream), whose "
            "micro-batch ids let a re-run find what an earlier attempt wrote; a batch write is "
            "at least once (a retried task appends its records again), so leave it out here")
    return _parse_common_write(opts)


def parse_stream_write_options(options: Mapping[str, Any]) -> StreamWriteOptions:
    """Options of ``df.writeStream.format("sbp")``."""
    opts = _Options(options)
    return StreamWriteOptions(write=_parse_common_write(opts),
                              idempotent=opts.value(IDEMPOTENT))


def options_table_markdown() -> str:
    """The options table as Markdown (the README prints it)."""
    lines = ["| option | default | where | meaning |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {s.default} | {s.where} | {s.meaning} |" for s in OPTIONS]
    return "\n".join(lines)


__all__ = [
    "COMMITTED", "EARLIEST", "LATEST", "OPTIONS", "ClientOptions", "OffsetSpec", "OptionError",
    "OptionSpec", "ReadOptions", "StreamReadOptions", "StreamWriteOptions", "TimeSpec",
    "WriteOptions",
    "check_option_names", "options_table_markdown", "parse_read_options",
    "parse_offsets", "parse_schema_options", "parse_stream_read_options",
    "parse_stream_write_options", "parse_write_options",
]
