"""Stream names: which texts are names, and how a text naming a stream is read.

A stream may carry a name (``Stream.name``, ours), unique among the live streams of a
cluster. Every place that takes a stream takes its id or its name, so the two must never be
confused: a text of digits only is always an id, and a name may not be digits only. A name is
1 to ``MAX_NAME_LENGTH`` characters from ASCII letters, digits, ``.``, ``_`` and ``-``, and does
not start with ``.`` or ``-`` (so ``-1`` stays a number to every reader, and ``..`` no path).
"""

from __future__ import annotations

import re

MAX_NAME_LENGTH = 200
NAME_RULE = (f"1 to {MAX_NAME_LENGTH} ASCII letters, digits, '.', '_' and '-', starting with a "
             "letter, a digit or '_', and not digits only (digits alone are a stream id)")

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid stream name, or None when it is."""
    if not isinstance(name, str):
        return f"a stream name is text, got {type(name).__name__}"
    if not name:
        return "a stream name cannot be empty"
    if len(name) > MAX_NAME_LENGTH:
        return f"stream name {name[:40]!r}... is {len(name)} characters, above {MAX_NAME_LENGTH}"
    if name.isascii() and name.isdigit():
        return (f"stream name {name!r} is digits only, which always means a stream id: "
                "give the stream a name with a letter in it")
    if not _NAME.fullmatch(name):
        return f"{name!r} is not a valid stream name: a name is {NAME_RULE}"
    return None


def check_name(name: str) -> str:
    """``name`` if it is a valid stream name; ``ValueError`` saying why not otherwise."""
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


def parse_stream_ref(text: str | int) -> int | str:
    """A stream as a user wrote it: digits (or an int) are its id, anything else its name.

    Raises ``ValueError`` naming the problem for a negative id or a text that is neither.
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is neither a stream id nor a stream name")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"stream id must be >= 0, got {text}")
        return text
    ref = text.strip()
    if ref.isascii() and ref.isdigit():
        return int(ref)
    if ref.startswith("-") and ref[1:].isascii() and ref[1:].isdigit():
        raise ValueError(f"stream id must be >= 0, got {ref}")
    problem = name_problem(ref)
    if problem is not None:
        raise ValueError(f"{text!r} is neither a stream id (digits) nor a stream name "
                         f"({NAME_RULE})")
    return ref


# -- consumer names ---------------------------------------------------------------------------

MAX_CONSUMER_NAME_LENGTH = 200
CONSUMER_NAME_RULE = (f"1 to {MAX_CONSUMER_NAME_LENGTH} ASCII letters, digits, '.', '_' and "
                      "'-', starting with a letter, a digit or '_'")


def consumer_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid consumer name (a named consumer's, ours), or None. Unlike
    a stream's, a consumer's name may be digits only: nothing else names a consumer."""
    if not isinstance(name, str):
        return f"a consumer name is text, got {type(name).__name__}"
    if not name:
        return "a consumer name cannot be empty"
    if len(name) > MAX_CONSUMER_NAME_LENGTH:
        return (f"consumer name {name[:40]!r}... is {len(name)} characters, above "
                f"{MAX_CONSUMER_NAME_LENGTH}")
    if not _NAME.fullmatch(name):
        return f"{name!r} is not a valid consumer name: a name is {CONSUMER_NAME_RULE}"
    return None
