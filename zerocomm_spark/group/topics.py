"""Topic names of a group's queues (thesis 4.3) and their exact wire form.

ZeroMQ subscriptions match by prefix, so ``urn:didcomm-queue:bob`` would also receive
``urn:didcomm-queue:bob2``'s traffic and the single-mode data topic would match every multi-mode
pair topic of the same group. On the wire every topic is therefore its UTF-8 bytes plus a NUL
terminator, and receivers compare the whole first frame with the topic they expect: prefix
matching in ZeroMQ is only a filter, equality decides.
"""

from __future__ import annotations

from zerocomm_spark.errors import InvalidGroupNameError
from zerocomm_spark.text import is_utf8_text

__all__ = [
    "MAX_GROUP_NAME",
    "PREFIX",
    "TERMINATOR",
    "check_did",
    "check_group",
    "data_topic",
    "is_topic",
    "pair_topic",
    "state_topic",
    "topic_name",
]

PREFIX = "urn:didcomm-queue:"
TERMINATOR = b"\0"
MAX_GROUP_NAME = 200


def check_group(group: str) -> str:
    """The group name, if it can name topics unambiguously; InvalidGroupNameError otherwise.

    ':' is refused because it separates a topic's fields: with it, group ``g:data:x`` could forge
    another group's pair topic.
    """
    if not isinstance(group, str) or not group:
        raise InvalidGroupNameError(f"a group name is a non-empty string, got {type(group).__name__}")
    if len(group) > MAX_GROUP_NAME:
        raise InvalidGroupNameError(f"a group name is at most {MAX_GROUP_NAME} characters, got {len(group)}")
    if ":" in group or any(ord(c) < 0x20 or ord(c) == 0x7F for c in group):
        raise InvalidGroupNameError(f"the group name {group!r} contains ':' or a control character")
    if not is_utf8_text(group):  # topics are the name's UTF-8: a lone surrogate has none (create() failed half-way)
        raise InvalidGroupNameError(f"the group name {group!r} holds a lone surrogate (\\ud800-\\udfff), not text")
    return group


def check_did(did: str) -> str:
    """A DID usable inside a topic: non-empty, no NUL or control characters."""
    if not isinstance(did, str) or not did or any(ord(c) < 0x20 or ord(c) == 0x7F for c in did):
        raise InvalidGroupNameError("a member DID must be a non-empty string without control characters",
                                    hint="Pass the member's did:peer DID as produced by the DID exchange.")
    return did


def _wire(name: str) -> bytes:
    return name.encode("utf-8") + TERMINATOR


def data_topic(group: str) -> bytes:
    """``urn:didcomm-queue:<group>:data``: the common data queue (single and shared modes)."""
    return _wire(f"{PREFIX}{check_group(group)}:data")


def pair_topic(group: str, publisher: str, subscriber: str) -> bytes:
    """``urn:didcomm-queue:<group>:data:<pub>:<sub>``: one publisher-to-subscriber queue (multi mode)."""
    return _wire(f"{PREFIX}{check_group(group)}:data:{check_did(publisher)}:{check_did(subscriber)}")


def state_topic(group: str) -> bytes:
    """``urn:didcomm-queue:<group>:state``: the group's state (status) queue."""
    return _wire(f"{PREFIX}{check_group(group)}:state")


def is_topic(frame: bytes | memoryview, expected: bytes) -> bool:
    """Whether a received first frame is exactly ``expected`` (prefix matches do not count)."""
    return bytes(frame) == expected if isinstance(frame, memoryview) else frame == expected


def topic_name(frame: bytes) -> str:
    """The readable name of a wire topic, for logs and errors."""
    if not frame.endswith(TERMINATOR):
        raise ValueError("a wire topic ends with a NUL byte")
    return frame[:-1].decode("utf-8")
