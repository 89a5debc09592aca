"""Whether a str is text that UTF-8 can carry.

JSON (and Python's surrogateescape) can spell a lone surrogate such as "\\ud800", which has no UTF-8
form: a value holding one fails later, half-way, wherever it is signed, hashed, sent or stored.
Untrusted strings are checked with this where they come in.
"""

from __future__ import annotations

__all__ = ["is_utf8_text"]


def is_utf8_text(value: str) -> bool:
    if value.isascii():  # nearly every value: no encoding needed
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
