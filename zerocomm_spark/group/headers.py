"""The one rule for a group message's headers, and its wording.

A message's headers map non-empty string keys to string values: at most ``MAX_HEADERS`` entries
(one fewer when the agent is to sign it: the origin proof is one more), each key and value at most
``MAX_HEADER_LENGTH`` characters, and no ``zc-origin`` entry of its own when the agent signs it
(the agent adds the proof; it never signs over someone else's claim).

Three places refuse headers, and all three ask :func:`header_problem`: the data plane
(:meth:`DataPlane.publish <zerocomm_spark.group.dataplane.DataPlane.publish>`, a ConfigurationError),
the agent's publish call (``agent/calls.py``, a BadRowError naming the row) and the Spark sink
(``connector/writer.py``, a SinkHeaderError naming the partition row; its vectorised look over a chunk
only decides whether a row needs asking). Each says where; what is wrong is :attr:`HeaderProblem.text`,
the same words everywhere, so the three can neither disagree on a row nor describe it differently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.group.datamessage import MAX_HEADER_LENGTH, MAX_HEADERS
from zerocomm_spark.group.origin import ORIGIN_HEADER
from zerocomm_spark.text import is_utf8_text

__all__ = ["HeaderProblem", "check_headers", "header_problem", "most_headers", "repeated_key"]

_SHOWN = 64  # characters of a key quoted in a problem's text


@dataclass(frozen=True)
class HeaderProblem:
    """Why a header map cannot be a group message's.

    ``kind``: one of ``not-a-map``, ``too-many``, ``not-a-string``, ``null-value``, ``empty-key``,
    ``too-long``, ``not-text``, ``reserved``, ``repeated-key`` (for a caller that picks a fix to suggest by
    it). ``text``: the problem in words that follow "has" ("row 3 of partition 5 has " + text). ``key``:
    the entry's key, if one."""

    kind: str
    text: str
    key: str | None = None

    def __str__(self) -> str:
        return self.text


def most_headers(sign: str | None = None) -> int:
    """How many entries a message's headers may have: one fewer when the agent is to sign it."""
    return MAX_HEADERS - 1 if sign else MAX_HEADERS


def header_problem(headers: object, *, sign: str | None = None) -> HeaderProblem | None:
    """The first thing that keeps ``headers`` (a mapping, or None for none) from being a group
    message's, or None if nothing does.

    ``sign``: the name of the switch that asks the agent to sign the message (``"sign"``,
    ``"signOrigin"``), or None: with it a ``zc-origin`` entry of the row's own is refused and one entry
    fewer fits, and the text names the switch."""
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        return HeaderProblem("not-a-map", f"headers that are a {type(headers).__name__}, not a mapping "
                                          "(headers map non-empty strings to strings)")
    most = most_headers(sign)
    if len(headers) > most:
        return HeaderProblem("too-many", f"{len(headers)} headers; a group message carries at most {most}"
                                         f"{f' with {sign} (which adds {ORIGIN_HEADER})' if sign else ''}")
    for key, value in headers.items():
        if not isinstance(key, str):
            return HeaderProblem("not-a-string", f"a header key of type {type(key).__name__} ({key!r:.{_SHOWN}}) "
                                                 "(headers map non-empty strings to strings)")
        shown = key[:_SHOWN]
        if value is None:
            return HeaderProblem("null-value", f"a null value for header {shown!r}", key)
        if not isinstance(value, str):
            return HeaderProblem("not-a-string", f"a value of type {type(value).__name__} for header {shown!r} "
                                                 "(headers map non-empty strings to strings)", key)
        if not key:
            return HeaderProblem("empty-key", "a header with an empty key", key)
        if len(key) > MAX_HEADER_LENGTH or len(value) > MAX_HEADER_LENGTH:
            return HeaderProblem("too-long", f"header {shown!r} whose key or value is longer than "
                                             f"{MAX_HEADER_LENGTH} characters", key)
        if not is_utf8_text(key) or not is_utf8_text(value):  # no UTF-8 form: no member could journal it
            return HeaderProblem("not-text", f"header {shown!r} whose key or value holds a lone surrogate "
                                             "(\\ud800-\\udfff), not text", key)
        if sign and key == ORIGIN_HEADER:
            return HeaderProblem("reserved", f"a {ORIGIN_HEADER!r} header, and {sign} is true: the agent adds the "
                                             "origin proof itself", key)
    return None


def repeated_key(pairs: list[tuple[str, object]] | None) -> HeaderProblem | None:
    """A key given twice among a row's header entries (an Arrow map may hold that; a mapping cannot):
    taking the last value would drop the others without a word, so it is a problem of its own."""
    if not pairs:
        return None
    seen: set[object] = set()
    for key, _ in pairs:
        if key in seen:
            times = sum(1 for k, _ in pairs if k == key)
            shown = key[:_SHOWN] if isinstance(key, str) else key
            return HeaderProblem("repeated-key", f"the header {shown!r} {times} times (a message's header keys are "
                                                 "unique)", key if isinstance(key, str) else None)
        seen.add(key)
    return None


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """``headers`` as a plain dict (None for none or empty), or ConfigurationError saying what
    :func:`header_problem` found: the data plane's check of what it is asked to publish."""
    problem = header_problem(headers)
    if problem is not None:
        raise ConfigurationError(f"a message has {problem.text}",
                                 hint=f"Headers map non-empty strings to strings: at most {MAX_HEADERS} entries, each "
                                      f"key and value at most {MAX_HEADER_LENGTH} characters")
    if headers is None:
        return None
    return dict(headers) or None
