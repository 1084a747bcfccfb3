"""The error tree: one written-out class per status code, flags instead of lists of classes,
three kinds of timeout, and pickling that keeps every field (Spark pickles executor errors)."""

from __future__ import annotations

import copy
import pickle
import re
from pathlib import Path

import pytest

from sbp_spark.protocol import errors
from sbp_spark.protocol.errors import (
    ChecksumError,
    ConnectTimeoutError,
    ErrorCode,
    HeaderError,
    RangeSealedError,
    ReadTimeoutError,
    ReplicaBehindError,
    SbpError,
    SbpTimeoutError,
    ServerError,
    TransportError,
    WriteTimeoutError,
)

COMMON_FBS = Path(__file__).resolve().parents[2] / "schemas" / "common.fbs"


def _all_error_classes() -> list[type[SbpError]]:
    # The tree reaches into the client and the server too (ConnectionClosed, CorruptDataError).
    import sbp_spark.client  # noqa: F401
    import sbp_spark.server.net  # noqa: F401
    import sbp_spark.server.storage.segment  # noqa: F401

    found: list[type[SbpError]] = []
    todo: list[type[SbpError]] = [SbpError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__qualname__)


ALL = _all_error_classes()


def test_every_code_has_exactly_one_written_out_class():
    server_classes = [c for c in ALL if issubclass(c, ServerError) and c is not ServerError]
    assert sorted(c.code for c in server_classes) == [c for c in ErrorCode if c]
    for cls in server_classes:
        assert cls.__module__ == errors.__name__
        assert cls.__name__ == "".join(p.capitalize() for p in cls.code.name.split("_")) \
            + "Error"
        assert getattr(errors, cls.__name__) is cls  # importable by name, for type checkers
        assert type(ServerError.for_status(cls.code, "m")) is cls


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__qualname__)
def test_pickle_and_copy_round_trips_keep_the_message_and_fields(cls):
    exc = cls("it broke")
    exc.throttle_time_ms = 250  # set by the client on throttled answers
    for clone in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
        assert type(clone) is cls
        assert str(clone) == str(exc) and clone.args == exc.args
        assert clone.__dict__ == exc.__dict__
        assert clone.retriable == exc.retriable
        assert clone.invalid_metadata == exc.invalid_metadata


def test_unpickled_server_error_does_not_repeat_its_prefix():
    exc = ServerError.for_status(ErrorCode.RANGE_SEALED, "range 3 sealed", b"detail")
    clone = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(exc))))
    assert str(clone) == "RANGE_SEALED: range 3 sealed"
    assert (clone.code, clone.message, clone.detail) == (12, "range 3 sealed", b"detail")
    unknown = pickle.loads(pickle.dumps(ServerError("from a newer server", code=4242)))
    assert str(unknown) == "code 4242: from a newer server" and not unknown.retriable


def test_flags_follow_the_code_whatever_the_class():
    assert ServerError("x", code=ErrorCode.RANGE_SEALED).retriable
    assert ServerError("x", code=ErrorCode.RANGE_SEALED).invalid_metadata
    assert not ServerError("x", code=ErrorCode.INVALID_REQUEST).retriable
    assert RangeSealedError("x").retriable and ErrorCode.RANGE_SEALED.retriable
    assert ErrorCode.NONE.meaning == "success" and not ErrorCode.NONE.retriable


@pytest.mark.parametrize("cls, retriable, invalid_metadata", [
    (TransportError, True, True),
    (SbpTimeoutError, True, True),
    (ConnectTimeoutError, True, True),
    (ReadTimeoutError, True, True),
    (WriteTimeoutError, True, True),
    (ChecksumError, True, False),
    (ReplicaBehindError, True, False),
    (HeaderError, False, False),
    (SbpError, False, False),
])
def test_transport_and_timeout_errors_carry_their_flags(cls, retriable, invalid_metadata):
    assert (cls("x").retriable, cls("x").invalid_metadata) == (retriable, invalid_metadata)


def test_timeouts_are_split_and_still_caught_as_sbp_timeout_error():
    for cls in (ConnectTimeoutError, ReadTimeoutError, WriteTimeoutError):
        with pytest.raises(SbpTimeoutError):
            raise cls("slow")
    assert len({ConnectTimeoutError, ReadTimeoutError, WriteTimeoutError}) == 3


def test_schema_comments_state_the_same_flags_as_the_classes():
    """common.fbs says, per code, "retriable" or "not retriable", and "refresh" when the
    caller must ask the PD again: the error classes must say the same."""
    said = {}
    for name, comment in re.findall(r"^\s*(\w+) = \d+,\s*//\s*(.*)$", COMMON_FBS.read_text(),
                                    re.MULTILINE):
        said[name] = ("not retriable" not in comment and "retriable" in comment,
                      "refresh" in comment)
    assert set(said) == {c.name for c in ErrorCode}
    for code in ErrorCode:
        if code is ErrorCode.NONE:
            continue
        assert said[code.name] == (code.retriable, code.invalid_metadata), code.name
