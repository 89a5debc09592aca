"""The DIDComm message base: field validation, decorators, registry, base64 helpers."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from zerocomm_spark.errors import ProtocolError, UnknownMessageTypeError
from zerocomm_spark.protocols.basic_message.v1_0.messages import BasicMessage
from zerocomm_spark.protocols.message import (
    LEGACY_PREFIX,
    SUPPORTED_PROTOCOLS,
    Thread,
    Timing,
    b64url_decode,
    b64url_encode,
    message_types,
    parse_message,
)


def test_no_message_shows_its_body_in_repr_or_str() -> None:
    """AgentMessage's repr shows only the id and thread "as bodies can be payloads", but every concrete
    message is a @dataclass, whose generated repr replaced it: repr(BasicMessage) printed the private
    message's text, so one %r of a message in a log line or an error would have carried it."""
    from dataclasses import dataclass
    from typing import ClassVar

    from zerocomm_spark.protocols.message import AgentMessage

    msg = BasicMessage(content="PLAINTEXT-PRIVATE-NOTE", thread=Thread(thid="t-1"))
    for shown in (repr(msg), str(msg), f"{msg}"):
        assert shown == f"BasicMessage(id={msg.id!r}, thid='t-1')"
    assert "PLAINTEXT" not in f"{[msg]} {({'m': msg})}"
    for cls in message_types().values():  # every registered type (the protocols' modules are imported by it)
        assert cls.__repr__ is AgentMessage.__repr__, cls

    @dataclass(kw_only=True)
    class Custom(AgentMessage):  # a protocol an application registers (Agent.register_protocol)
        message_type: ClassVar[str] = "https://example.org/custom/1.0/note"
        secret: str = ""

    assert "hush" not in repr(Custom(secret="hush"))


def test_round_trip_keeps_every_field_and_decorator() -> None:
    msg = BasicMessage(content="hé", thread=Thread(thid="t-1", pthid="p-1"),
                       timing=Timing(out_time="2030-01-01T00:00:00Z"))
    data = msg.to_dict()
    assert data["@type"] == "https://didcomm.org/basicmessage/1.0/message"
    assert data["~thread"] == {"thid": "t-1", "pthid": "p-1"}
    back = parse_message(data)
    assert isinstance(back, BasicMessage)
    assert back == msg
    assert back.thid == "t-1" and back.pthid == "p-1"


def test_a_message_without_thread_starts_its_own() -> None:
    msg = BasicMessage(content="x")
    assert msg.thid == msg.id and msg.pthid is None
    assert "~thread" not in msg.to_dict()


def test_legacy_prefix_is_accepted_and_normalised() -> None:
    data = BasicMessage(content="x").to_dict()
    data["@type"] = LEGACY_PREFIX + "basicmessage/1.0/message"
    assert parse_message(data).message_type.startswith("https://didcomm.org/")


@pytest.mark.parametrize("message_type", ["https://didcomm.org/basicmessage/1.3/message",
                                          "https://didcomm.org/basicmessage/1.00/message",
                                          LEGACY_PREFIX + "basicmessage/1.1/message"])
def test_another_minor_version_is_the_same_message(message_type: str) -> None:
    """RFC 0003 semver: a newer agent's 1.x message is processed (unknown fields ignored), and we
    answer in our own version; another major version or another message name is not ours."""
    data = BasicMessage(content="x").to_dict()
    data["@type"] = message_type
    data["a_field_from_the_future"] = {"ignored": True}
    parsed = parse_message(data)
    assert isinstance(parsed, BasicMessage) and parsed.content == "x"
    assert parsed.to_dict()["@type"] == "https://didcomm.org/basicmessage/1.0/message"


@pytest.mark.parametrize("message_type", ["https://didcomm.org/basicmessage/2.0/message",
                                          "https://didcomm.org/basicmessage/1.0/other",
                                          "https://didcomm.org/basicmessage/1/message",
                                          "https://didcomm.org/basicmessage2/1.0/message"])
def test_another_major_version_or_name_is_refused(message_type: str) -> None:
    data = BasicMessage(content="x").to_dict()
    data["@type"] = message_type
    with pytest.raises(UnknownMessageTypeError):
        parse_message(data)
    with pytest.raises(ProtocolError, match="'@type'"):
        BasicMessage.from_dict(data)


def test_minor_versions_of_a_major_version_zero_protocol_are_not_the_same_message(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 0003 ties minor versions together only for major version >= 1: under 0.x (initial
    development) any minor version may change anything, so 0.2 is not processed as 0.1."""
    from dataclasses import dataclass
    from typing import ClassVar

    from zerocomm_spark.protocols import message
    from zerocomm_spark.protocols.message import AgentMessage, register

    message_types()  # the core protocols loaded first: the copies below are the registry this test adds to
    monkeypatch.setattr(message, "_REGISTRY", dict(message._REGISTRY))  # noqa: SLF001
    monkeypatch.setattr(message, "_BY_MAJOR", dict(message._BY_MAJOR))  # noqa: SLF001

    @register
    @dataclass(kw_only=True)
    class Draft(AgentMessage):
        message_type: ClassVar[str] = "https://didcomm.org/zerocomm-test-draft/0.1/note"

    assert isinstance(parse_message(Draft().to_dict()), Draft)
    for other in ("https://didcomm.org/zerocomm-test-draft/0.2/note", "https://didcomm.org/zerocomm-test-draft/0.0/note"):
        data = {**Draft().to_dict(), "@type": other}
        with pytest.raises(UnknownMessageTypeError):
            parse_message(data)
        with pytest.raises(ProtocolError, match="'@type'"):
            Draft.from_dict(data)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("@id"), "'@id'"),
        (lambda d: d.update({"@id": 5}), "'@id'"),
        (lambda d: d.update({"@id": ""}), "'@id'"),
        (lambda d: d.pop("content"), "'content'"),
        (lambda d: d.update({"content": ["not", "text"]}), "'content'"),
        (lambda d: d.update({"sent_time": None}), "'sent_time'"),
        (lambda d: d.update({"~thread": "t"}), "'~thread'"),
        (lambda d: d.update({"~thread": {"thid": 7}}), "'thid'"),
        (lambda d: d.update({"~timing": {"expires_time": "tomorrow"}}), "'~timing.expires_time'"),
    ],
)
def test_validation_names_the_bad_field(mutate, field: str) -> None:
    data = BasicMessage(content="secret payload").to_dict()
    mutate(data)
    with pytest.raises(ProtocolError) as info:
        parse_message(data)
    assert field in str(info.value)
    assert "secret payload" not in str(info.value)


def test_unknown_and_missing_types() -> None:
    with pytest.raises(UnknownMessageTypeError):
        parse_message({"@type": "https://didcomm.org/nope/1.0/thing", "@id": "1"})
    with pytest.raises(ProtocolError, match="'@type'"):
        parse_message({"@id": "1"})
    with pytest.raises(ProtocolError, match="JSON object"):
        parse_message(["not", "an", "object"])
    with pytest.raises(ProtocolError, match="'@type'"):
        BasicMessage.from_dict({"@type": "https://didcomm.org/trust_ping/1.0/ping", "@id": "1"})


def test_timing_expiry() -> None:
    past = (datetime.now(timezone.utc) - timedelta(seconds=5)).isoformat()
    future = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    assert Timing(expires_time=past).expired()
    assert not Timing(expires_time=future).expired()
    assert not Timing().expired()


def test_registry_covers_every_disclosed_protocol() -> None:
    protocols = {t.rsplit("/", 1)[0] for t in message_types()}
    assert {p.pid for p in SUPPORTED_PROTOCOLS} == protocols


@pytest.mark.parametrize("data", [b"", b"\x00", b"\xff\xfe\xfd", b"hello world!", bytes(range(256))])
def test_b64url_round_trip_padded_or_not(data: bytes) -> None:
    text = b64url_encode(data)
    assert "=" not in text and "+" not in text and "/" not in text
    assert b64url_decode(text) == data
    assert b64url_decode(text + "=" * (-len(text) % 4)) == data


def test_b64url_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        b64url_decode("not base64 !!")
