"""Topic names: exact wire forms, so prefix matching can never leak one queue's traffic to another."""

from __future__ import annotations

import time

import pytest
import zmq

from zerocomm_spark.errors import InvalidGroupNameError
from zerocomm_spark.group import topics


def test_wire_forms_end_with_nul() -> None:
    assert topics.data_topic("g") == b"urn:didcomm-queue:g:data\0"
    assert topics.state_topic("g") == b"urn:didcomm-queue:g:state\0"
    assert topics.pair_topic("g", "did:x:alice", "did:x:bob") == b"urn:didcomm-queue:g:data:did:x:alice:did:x:bob\0"
    assert topics.data_topic("caf\u00e9") == "urn:didcomm-queue:caf\u00e9:data".encode() + b"\0"


def test_no_topic_is_a_prefix_of_another() -> None:
    names = [
        topics.data_topic("g"), topics.data_topic("g2"), topics.state_topic("g"), topics.state_topic("g2"),
        topics.pair_topic("g", "did:x:alice", "did:x:bob"), topics.pair_topic("g", "did:x:alice", "did:x:bob2"),
        topics.pair_topic("g2", "did:x:alice", "did:x:bob"),
    ]
    for a in names:
        for b in names:
            if a != b:
                assert not b.startswith(a), (a, b)


def test_is_topic_requires_the_whole_frame() -> None:
    t = topics.pair_topic("g", "did:x:alice", "did:x:bob")
    assert topics.is_topic(t, t)
    assert topics.is_topic(memoryview(t), t)
    assert not topics.is_topic(t[:-1], t)
    assert not topics.is_topic(topics.pair_topic("g", "did:x:alice", "did:x:bob2"), t)


def test_topic_name_round_trip() -> None:
    assert topics.topic_name(topics.state_topic("g")) == "urn:didcomm-queue:g:state"
    with pytest.raises(ValueError):
        topics.topic_name(b"urn:didcomm-queue:g:state")


@pytest.mark.parametrize("bad", ["", "a:b", "nul\0", "tab\t", "x" * 201, 5])
def test_bad_group_names_are_refused_with_a_hint(bad: object) -> None:
    with pytest.raises(InvalidGroupNameError) as err:
        topics.data_topic(bad)  # type: ignore[arg-type]
    assert "':'" in str(err.value) or "characters" in str(err.value) or "string" in str(err.value)


def test_bad_dids_are_refused() -> None:
    with pytest.raises(InvalidGroupNameError):
        topics.pair_topic("g", "did:x:a\0", "did:x:b")
    with pytest.raises(InvalidGroupNameError):
        topics.pair_topic("g", "did:x:a", "")


def test_zeromq_sub_of_bob_never_receives_bob2() -> None:
    """Real ZeroMQ prefix filtering with our wire forms: bob's subscription does not match bob2's queue."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sub = ctx.socket(zmq.SUB)
    try:
        pub.bind("inproc://topics-test")
        sub.connect("inproc://topics-test")
        bob = topics.pair_topic("g", "did:x:alice", "did:x:bob")
        bob2 = topics.pair_topic("g", "did:x:alice", "did:x:bob2")
        sub.setsockopt(zmq.SUBSCRIBE, bob)
        time.sleep(0.05)
        for _ in range(3):
            pub.send_multipart([bob2, b"for bob2"])
            pub.send_multipart([topics.data_topic("g"), b"common"])
        pub.send_multipart([bob, b"for bob"])
        sub.setsockopt(zmq.RCVTIMEO, 2000)
        assert sub.recv_multipart() == [bob, b"for bob"]
        sub.setsockopt(zmq.RCVTIMEO, 100)
        with pytest.raises(zmq.Again):
            sub.recv_multipart()
    finally:
        sub.close(0)
        pub.close(0)
        ctx.term()
