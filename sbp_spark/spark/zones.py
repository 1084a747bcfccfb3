"""Wall-clock times (Spark's TIMESTAMP_NTZ) as instants, the way Spark's
``CAST(ntz AS TIMESTAMP)`` makes them: read in the session time zone
(``spark.sql.session.timeZone``), a time that a DST change skips moved forward by the length of
the skipped span, a time that happens twice taken at its earlier instant (Java's
``LocalDateTime.atZone``, which Spark uses).

The session time zone cannot be read where the writer is built: ``writer()`` runs in a
driver-side Python worker that has no SparkSession and is handed no SQL settings. Spark does
hand every task of a query the settings its session had explicitly set, as task properties, so
a task reads the zone there (``session_time_zone``); a session that never set it uses the JVM's
default zone, which a task finds as the JVM does (``local_time_zone``).
"""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.compute as pc

from .settings import task_property

SESSION_TIME_ZONE = "spark.sql.session.timeZone"

# Java's ZoneId.SHORT_IDS, which Spark accepts for its session time zone.
JAVA_SHORT_IDS = {
    "ACT": "Australia/Darwin", "AET": "Australia/Sydney",
    "AGT": "America/Argentina/Buenos_Aires", "ART": "Africa/Cairo",
    "AST": "America/Anchorage", "BET": "America/Sao_Paulo", "BST": "Asia/Dhaka",
    "CAT": "Africa/Harare", "CNT": "America/St_Johns", "CST": "America/Chicago",
    "CTT": "Asia/Shanghai", "EAT": "Africa/Addis_Ababa", "ECT": "Europe/Paris",
    "IET": "America/Indiana/Indianapolis", "IST": "Asia/Kolkata", "JST": "Asia/Tokyo",
    "MIT": "Pacific/Apia", "NET": "Asia/Yerevan", "NST": "Pacific/Auckland",
    "PLT": "Asia/Karachi", "PNT": "America/Phoenix", "PRT": "America/Puerto_Rico",
    "PST": "America/Los_Angeles", "SST": "Pacific/Guadalcanal", "VST": "Asia/Ho_Chi_Minh",
    "EST": "-05:00", "MST": "-07:00", "HST": "-10:00",
}
# Java's fixed offsets: Z, +h, +hh, +hh:mm, +hhmm, +hh:mm:ss, +hhmmss, alone or after UTC, GMT
# or UT.
_OFFSET = re.compile(r"(?:UTC|GMT|UT)?([+-])(\d{1,2})(?::?(\d{2}))?(?::?(\d{2}))?")
_UTC_NAMES = frozenset({"Z", "UTC", "GMT", "UT"})
_PROBE = pa.array([0], pa.timestamp("us"))


def arrow_zone(name: str) -> str:
    """The name pyarrow knows for the Spark (Java) time zone ``name``; ValueError when it is
    none."""
    text = JAVA_SHORT_IDS.get(name.strip(), name.strip())
    if text in _UTC_NAMES:
        return "UTC"
    match = _OFFSET.fullmatch(text)
    if match:
        sign, hours, minutes, seconds = match.groups()
        if int(hours) > 18 or int(minutes or 0) > 59 or int(seconds or 0):
            raise ValueError(f"time zone {name!r} is not an offset of whole minutes up to 18 h")
        text = f"{sign}{int(hours):02d}:{minutes or '00'}"
    try:
        pc.assume_timezone(_PROBE, text)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise ValueError(
            f"time zone {name!r} is not one Spark and pyarrow both know: use a region such as "
            "America/New_York, or an offset such as +05:30") from None
    return text


def local_time_zone() -> str:
    """The zone a JVM on this machine defaults to: TZ, else /etc/timezone, else the zone
    /etc/localtime links to, else UTC."""
    zone = os.environ.get("TZ", "").lstrip(":").strip()
    if zone:
        return zone
    try:
        with open("/etc/timezone", encoding="utf-8") as file:
            zone = file.readline().strip()
    except OSError:
        zone = ""
    if zone:
        return zone
    try:
        target = os.path.realpath("/etc/localtime")
    except OSError:
        return "UTC"
    _, found, zone = target.partition("/zoneinfo/")
    return zone if found and zone else "UTC"


def session_time_zone() -> str:
    """In a task: its session's time zone (the JVM's default when the session never set
    one)."""
    return task_property(SESSION_TIME_ZONE) or local_time_zone()


def wall_clock_to_instants(values: pa.Array, zone: str) -> pa.Array:
    """``values`` (Arrow timestamps without a zone: wall-clock times) as the instants they are
    in ``zone`` (a name ``arrow_zone`` gave), typed ``timestamp[unit, tz=UTC]``."""
    unit = values.type.unit
    if zone in ("UTC", "+00:00", "-00:00"):
        return values.cast(pa.timestamp(unit, tz="UTC"))
    # The earliest reading gives each time its earlier instant when it happens twice, and for
    # a skipped time the last instant before the skip; the offset in force at that instant,
    # applied to the wall-clock value, is Java's answer in every case.
    earliest = pc.assume_timezone(values, zone, ambiguous="earliest", nonexistent="earliest")
    offsets = pc.subtract(pc.local_timestamp(earliest).cast(pa.int64()),
                          earliest.cast(pa.int64()))
    instants = pc.subtract(values.cast(pa.int64()), offsets)
    return instants.cast(pa.timestamp(unit, tz="UTC"))


__all__ = ["SESSION_TIME_ZONE", "arrow_zone", "local_time_zone", "session_time_zone",
           "wall_clock_to_instants"]
