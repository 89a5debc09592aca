"""The client's pieces that need no agent: batches for publish, error mapping, pickling, finding the agent."""

from __future__ import annotations

import fcntl
import os
import pickle
import socket
import time
from pathlib import Path

import pyarrow as pa
import pytest

from zerocomm_spark import errors
from zerocomm_spark.client import (
    Client,
    check_socket_dir,
    error_header,
    ipc_to_table,
    ipc_endpoint,
    publish_table,
    raise_for_error,
    table_to_ipc,
)


def test_publish_table_from_lists_and_tables() -> None:
    table = publish_table([b"a", "b\u00e9"], message_ids=["1", None], headers=[{"k": "v"}, None])
    assert table.column("payload").to_pylist() == [b"a", "b\u00e9".encode()]
    assert table.column("message_id").to_pylist() == ["1", None]
    assert table.column("headers").to_pylist() == [[("k", "v")], None]
    given = pa.table({"payload": pa.array(["x"], pa.string())})
    assert publish_table(given) is given
    assert publish_table(given.to_batches()[0]).num_rows == 1
    with pytest.raises(TypeError, match="wrap a single one"):
        publish_table(b"single")
    with pytest.raises(TypeError, match="message 1 is a int"):
        publish_table([b"a", 3])
    with pytest.raises(ValueError, match="needs a 'payload' column"):
        publish_table(pa.table({"value": [b"a"]}))
    with pytest.raises(ValueError, match="2 message ids for 1 messages"):
        publish_table([b"a"], message_ids=["1", "2"])


def test_arrow_round_trip_and_garbage() -> None:
    table = pa.table({"payload": [b"\x00" * 10, b"z"], "n": [1, 2]})
    assert ipc_to_table(table_to_ipc(table)).equals(table)
    with pytest.raises(errors.BadRequestError, match="not an Arrow IPC stream"):
        ipc_to_table(b"\xff" * 20)


def test_errors_travel_by_class_with_their_hint() -> None:
    for exc in (errors.GroupNotFoundError("no group 'x'"), errors.BackpressureError("slow"),
                errors.OffsetOutOfRangeError("beyond"), errors.ConnectionNotFoundError("nobody")):
        header = error_header("r1", exc)
        assert header["error"]["hint"] == exc.hint
        with pytest.raises(type(exc)) as info:
            raise_for_error(header["error"])
        assert str(info.value) == str(exc)
    header = error_header("r2", RuntimeError("internal detail"))
    assert "internal detail" not in str(header)
    with pytest.raises(errors.ApiError):
        raise_for_error(header["error"])
    with pytest.raises(errors.ApiError):
        raise_for_error({"type": "SystemExit", "message": "not ours"})  # only ZeroComm errors are raised by name


def test_a_bad_row_travels_as_a_bad_row() -> None:
    """The Spark sink turns only BadRowError (a row's data) into SinkRowError: it must arrive as such,
    and still as a BadRequestError for callers that catch that."""
    exc = errors.BadRowError("publish: headers of row 1 have a null value (for 'k')")
    with pytest.raises(errors.BadRowError) as info:
        raise_for_error(error_header("r1", exc)["error"])
    assert isinstance(info.value, errors.BadRequestError) and str(info.value) == str(exc)
    with pytest.raises(errors.BadRequestError) as plain:
        raise_for_error(error_header("r2", errors.BadRequestError("publish: unknown argument(s) 'sign'"))["error"])
    assert not isinstance(plain.value, errors.BadRowError)


def test_client_pickles_without_its_socket(tmp_path: Path) -> None:
    client = Client(ipc_endpoint(tmp_path), socket_dir=tmp_path, timeout=3)
    client._socket()  # noqa: SLF001 - a live socket must not travel
    copy = pickle.loads(pickle.dumps(client))
    assert copy.endpoint == client.endpoint and copy._sock is None  # noqa: SLF001
    with pytest.raises(errors.AgentNotRunningError):  # it reconnects lazily (nobody there: said at once)
        copy.call("status", timeout=0.2)
    client.close()
    with pytest.raises(errors.ClientClosedError):
        client.call("status")


def test_finding_no_agent_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(errors.AgentNotRunningError, match="no agent socket directory"):
        check_socket_dir(tmp_path / "missing")
    with pytest.raises(errors.AgentNotRunningError, match="no agent socket at"):
        check_socket_dir(tmp_path)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "api.sock"))
    stale.close()  # the file stays, nobody listens: what a kill -9 leaves
    with pytest.raises(errors.AgentNotRunningError, match="stale socket"):
        check_socket_dir(tmp_path)
    with pytest.raises(errors.AgentNotRunningError):
        Client.connect(tmp_path, timeout=1)
    with pytest.raises(errors.ConfigurationError, match="shorter directory"):
        ipc_endpoint(tmp_path / ("x" * 120))
    with pytest.raises(errors.ConfigurationError, match="CURVE keys"):
        Client("tcp://127.0.0.1:1")


def test_an_agent_holding_its_run_lock_but_not_listening_yet_is_waited_for(tmp_path: Path) -> None:
    """A client that came while an agent was starting (its run lock taken, its socket not listening
    yet: one a Spark connector had just spawned) was told at once that no agent runs there. It now
    waits for it until its deadline; without a holder of the lock, a stale socket is still said at once."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    _stale_socket(run / "api.sock")
    (run / "agent.pid").write_text("12345\n")
    started = time.monotonic()
    with pytest.raises(errors.AgentNotRunningError, match="stale socket"):  # nobody holds the lock
        Client.connect(run, timeout=3)
    assert time.monotonic() - started < 1.5
    holder = os.open(run / "agent.pid", os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # what a starting agent holds before it listens
        started = time.monotonic()
        with pytest.raises(errors.AgentNotRunningError, match="starting or stopping") as info:
            Client.connect(run, timeout=1.0)
        assert time.monotonic() - started >= 0.9  # waited out its deadline, not told at once
        assert "agent status" in str(info.value)
        os.unlink(run / "api.sock")  # not even a socket yet: the same
        with pytest.raises(errors.AgentNotRunningError, match="starting or stopping"):
            Client.connect(run, timeout=0.3)
    finally:
        os.close(holder)


def test_an_agent_holding_its_run_lock_that_does_not_answer_is_named_not_sent_to_start(tmp_path: Path) -> None:
    """An agent that holds its run directory and listens but does not answer (hung, SIGSTOPped,
    overloaded) made Client.connect say "no agent answered ... Start one with `zerocomm agent start
    --detach`", a start that is refused as already running, after a single call's wait. It is now
    waited for until the deadline and named like one that does not listen yet."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "agent.pid").write_text("12345\n")
    listener = _listening_socket(run / "api.sock")  # connects, never answers
    try:
        with pytest.raises(errors.AgentNotRunningError, match="no agent answered"):  # nobody holds the lock
            Client.connect(run, timeout=0.5)
        holder = os.open(run / "agent.pid", os.O_RDONLY)
        try:
            fcntl.flock(holder, fcntl.LOCK_EX)
            started = time.monotonic()
            with pytest.raises(errors.AgentNotRunningError, match="an agent holds .* or hung") as info:
                Client.connect(run, timeout=1.0)
            assert time.monotonic() - started >= 0.9
            assert "agent start" not in str(info.value) and "agent stop --force" in str(info.value)
        finally:
            os.close(holder)
    finally:
        listener.close()


def test_a_loose_socket_directory_without_an_agent_is_no_agent(tmp_path: Path) -> None:
    """A socket directory of ours that group or others may write (umask 002 makes it 775) with no
    agent in it was refused as a permission problem before the socket was looked for, so spawn=True
    and --spawn started no agent (which would have made it private). Nobody listening is no agent;
    only a socket someone listens on there is refused."""
    loose = tmp_path / "run"
    loose.mkdir()
    os.chmod(loose, 0o775)
    with pytest.raises(errors.AgentNotRunningError, match="no agent socket at"):
        check_socket_dir(loose)
    with pytest.raises(errors.AgentNotRunningError):
        Client.connect(loose, timeout=1)
    _stale_socket(loose / "api.sock")
    with pytest.raises(errors.AgentNotRunningError, match="stale socket"):
        check_socket_dir(loose)
    (loose / "api.sock").unlink()
    listener = _listening_socket(loose / "api.sock")
    try:
        with pytest.raises(errors.ApiPermissionError, match="other users could"):
            check_socket_dir(loose)
        with pytest.raises(errors.ApiPermissionError, match="other users could"):
            Client.connect(loose, timeout=1)
        os.chmod(loose, 0o700)
        check_socket_dir(loose)  # private again: whoever listens is taken for our agent
    finally:
        listener.close()


def _listening_socket(path: Path) -> socket.socket:
    """A socket file someone listens on (the caller closes it)."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(4)
    return listener


def _stale_socket(path: Path) -> None:
    """A socket file nobody listens on (an agent that crashed left it)."""
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()


def test_a_socket_of_another_user_is_refused_only_when_it_listens(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("making a socket of another user needs root")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    _stale_socket(run / "api.sock")
    os.chown(run / "api.sock", 65534, 65534)
    with pytest.raises(errors.AgentNotRunningError, match="stale socket"):  # an agent started replaces it
        check_socket_dir(run)
    (run / "api.sock").unlink()
    listener = _listening_socket(run / "api.sock")
    try:
        os.chown(run / "api.sock", 65534, 65534)
        with pytest.raises(errors.ApiPermissionError, match="belongs to uid 65534"):
            check_socket_dir(run)
    finally:
        listener.close()


def test_an_endless_timeout_is_refused_naming_the_timeout(tmp_path: Path) -> None:
    """A deadline is a finite number of seconds: inf would be sent as invalid JSON ("the arguments
    are not JSON-serializable") or, clamped nowhere, wait forever."""
    with pytest.raises(errors.ConfigurationError, match="timeout must be a positive number"):
        Client(ipc_endpoint(tmp_path), socket_dir=tmp_path, timeout=float("inf"))
    client = Client(ipc_endpoint(tmp_path), socket_dir=tmp_path, timeout=3)
    with pytest.raises(errors.ConfigurationError, match="timeout must be a positive number"):
        client.call("status", timeout=float("inf"))
    client.close()


def test_publish_signed_from_an_agent_that_does_not_count_them(tmp_path: Path, monkeypatch) -> None:
    """An agent from before the signed count (a detached agent still running after an upgrade) answers
    publish(sign=True) without "signed": PublishResult.signed read that as 0, so `send --sign` said the
    rows it had just signed "were sent before without a proof". The rows the answer says went out
    new were signed by it; only its duplicates are unknown."""
    client = Client(ipc_endpoint(tmp_path), socket_dir=tmp_path, timeout=3)
    old = {"group": "g", "message_ids": ["a", "b", "c"], "seqs": [1, 2, 3], "duplicates": 1, "journaled": True}
    monkeypatch.setattr(client, "call", lambda *a, **k: dict(old))
    assert client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"], sign=True).signed == 2
    assert client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"]).signed == 0
    monkeypatch.setattr(client, "call", lambda *a, **k: {**old, "signed": 3})  # a counting agent is believed
    assert client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"], sign=True).signed == 3
    # Its duplicate is "unknown", not "without a proof"; an agent that says so is believed too.
    assert client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"], sign=True).signed_unknown == 0
    monkeypatch.setattr(client, "call", lambda *a, **k: dict(old))
    assert client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"], sign=True).signed_unknown == 1
    monkeypatch.setattr(client, "call", lambda *a, **k: {**old, "signed": 0, "signed_unknown": 1})
    result = client.publish("g", [b"1", b"2", b"3"], message_ids=["a", "b", "c"], sign=True)
    assert (result.signed, result.signed_unknown) == (0, 1)
    client.close()
