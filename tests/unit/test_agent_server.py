"""The local API server on real sockets (in this process, with a small call registry): bad input of
every kind gets a clear error reply and the server keeps serving; the socket directory is private;
TCP admits only listed CURVE keys."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import zmq

from zerocomm_spark.agent.server import ApiServer, CallRegistry, Param, Request, positive
from zerocomm_spark.client import Client, ipc_to_table, table_to_ipc
from zerocomm_spark.errors import (
    AgentBusyError,
    ApiPermissionError,
    ApiTimeoutError,
    BadRequestError,
    ConfigurationError,
    GroupNotFoundError,
    RequestTooLargeError,
    UnknownCallError,
)

LIMIT = 64 * 1024


def _registry(gate: threading.Event) -> CallRegistry:
    r = CallRegistry()

    def echo(req: Request, text: str, times: int) -> dict[str, Any]:
        return {"echo": text * times}

    def rows(req: Request) -> tuple[dict[str, Any], bytes]:
        assert req.bulk is not None
        table = ipc_to_table(req.bulk)
        return {"rows": table.num_rows}, table_to_ipc(table)

    def fail(req: Request) -> None:
        raise GroupNotFoundError("this member is in no group named 'x'")

    def crash(req: Request) -> None:
        raise RuntimeError("a bug with a secret inside")

    def slow(req: Request) -> dict[str, Any]:
        for i in range(3):
            req.progress(phase="working", done=i, total=3, final=True)
        gate.wait(10)
        return {"done": True}

    r.add("echo", echo, {"text": Param(str, required=True), "times": Param(int, default=1, check=positive)})
    r.add("rows", rows, bulk="required")
    r.add("fail", fail)
    r.add("crash", crash)
    r.add("slow", slow)
    r.add("status", lambda req: {"label": "test", "max_request_bytes": LIMIT})
    return r


@pytest.fixture()
def served(tmp_path: Path):
    gate = threading.Event()
    server = ApiServer(_registry(gate), tmp_path / "run", max_request_bytes=LIMIT, workers=2, max_pending=1).start()
    yield server, gate
    gate.set()
    server.close()


def _raw(server: ApiServer) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(server.ipc_endpoint)
    return sock


def _ask(sock: zmq.Socket, *frames: bytes) -> dict[str, Any]:
    sock.send_multipart(list(frames))
    return json.loads(sock.recv_multipart()[0])


def test_socket_dir_is_private(served: tuple[ApiServer, threading.Event]) -> None:
    server, _ = served
    assert stat.S_IMODE(server.socket_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((server.socket_dir / "api.sock").stat().st_mode) == 0o600


def test_bad_input_gets_clear_errors_and_the_server_keeps_serving(served: tuple[ApiServer, threading.Event]) -> None:
    server, _ = served
    sock = _raw(server)
    cases = [
        ([b"not json"], "BadRequestError", "not a JSON object"),
        ([b"[1, 2]"], "BadRequestError", "not an object"),
        ([json.dumps({"call": "echo", "args": {"text": "a"}}).encode()], "BadRequestError", "'id'"),
        ([json.dumps({"id": 1, "call": "nope"}).encode()], "UnknownCallError", "unknown call 'nope'"),
        ([json.dumps({"id": 2, "call": "echo", "args": {"text": 5}}).encode()], "BadRequestError",
         "'text' must be a string, not an integer"),
        ([json.dumps({"id": 3, "call": "echo", "args": {"text": "a", "times": 0}}).encode()], "BadRequestError",
         "'times' must be > 0"),
        ([json.dumps({"id": 4, "call": "echo", "args": {}}).encode()], "BadRequestError", "'text' is required"),
        ([json.dumps({"id": 5, "call": "echo", "args": {"text": "a", "colour": 1}}).encode()], "BadRequestError",
         "unknown argument(s) 'colour'"),
        ([json.dumps({"id": 6, "call": "echo", "args": [1]}).encode()], "BadRequestError", "'args' must be an object"),
        ([json.dumps({"id": 7, "call": "rows"}).encode()], "BadRequestError", "needs an Arrow IPC frame"),
        ([json.dumps({"id": 8, "call": "rows"}).encode(), b"garbage"], "BadRequestError", "not an Arrow IPC stream"),
        ([json.dumps({"id": 9, "call": "echo", "args": {"text": "a"}}).encode(), b"x"], "BadRequestError",
         "takes no bulk frame"),
        ([json.dumps({"id": 10, "call": "echo", "args": {"text": "a"}}).encode(), b"", b""], "BadRequestError",
         "1 or 2 frames"),
        ([json.dumps({"id": 11, "call": "echo", "args": {"text": "a"}, "timeout": -1}).encode()], "BadRequestError",
         "'timeout'"),
        ([json.dumps({"id": 12, "call": "echo", "v": 99, "args": {"text": "a"}}).encode()], "BadRequestError",
         "protocol version 99"),
        ([json.dumps({"id": 13, "call": "echo", "args": {"text": "a"}}).encode(), b"\0" * (LIMIT + 1)],
         "RequestTooLargeError", f"at most {LIMIT}"),
        ([json.dumps({"id": 14, "call": "fail"}).encode()], "GroupNotFoundError", "no group named 'x'"),
        ([json.dumps({"id": 15, "call": "crash"}).encode()], "ApiError", "failed while handling"),
        ([b"[" * 5000], "BadRequestError", "nests too deeply"),  # json.loads' RecursionError
        (['{"id": 18, "call": "echo", "args": {"text": '.encode() + b"[" * 5000 + b"]" * 5000 + b"}}"],
         "BadRequestError", "nests too deeply"),
    ]
    for frames, error, text in cases:
        reply = _ask(sock, *frames)
        assert reply["ok"] is False, frames
        assert reply["error"]["type"] == error, (frames, reply)
        assert text in reply["error"]["message"], (text, reply)
        assert reply["error"]["hint"], reply  # every error says what to do
        assert "secret" not in json.dumps(reply)
    # A frame far past the hard limit is dropped unread; the server still answers afterwards.
    sock.send_multipart([json.dumps({"id": 16, "call": "status"}).encode(), b"\0" * (LIMIT * 8)])
    reply = _ask(sock, json.dumps({"id": 17, "call": "echo", "args": {"text": "ok", "times": 2}}).encode())
    if reply["id"] == 16:  # the big one was small enough to be refused with a reply: read on
        reply = json.loads(sock.recv_multipart()[0])
    assert reply == {"v": 1, "id": 17, "ok": True, "result": {"echo": "okok"}}
    assert server.stats["refused"] >= 15
    sock.close()


def test_a_request_that_breaks_the_reading_thread_fails_alone(served: tuple[ApiServer, threading.Event],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An input nothing foresaw (here: parsing raises an unexpected error) gets an ApiError reply; the
    thread that reads every client's requests keeps serving."""
    server, _ = served
    sock = _raw(server)
    real = server.registry.parse

    def parse(header, bulk):  # type: ignore[no-untyped-def]
        if header.get("call") == "status":
            raise KeyError("unforeseen")
        return real(header, bulk)

    monkeypatch.setattr(server.registry, "parse", parse)
    reply = _ask(sock, json.dumps({"id": 1, "call": "status"}).encode())
    assert reply["ok"] is False and reply["error"]["type"] == "ApiError" and reply["error"]["hint"]
    assert _ask(sock, json.dumps({"id": 2, "call": "echo", "args": {"text": "ok"}}).encode())["result"] == {"echo": "ok"}
    sock.close()


def test_client_maps_errors_and_checks_sizes_before_sending(served: tuple[ApiServer, threading.Event]) -> None:
    server, _ = served
    client = Client.connect(server.socket_dir, timeout=5)
    assert client.max_request_bytes == LIMIT
    assert client.call("echo", text="ab", times=3) == {"echo": "ababab"}
    with pytest.raises(UnknownCallError, match="this agent serves: crash, echo, fail, rows, slow, status"):
        client.call("publish")
    with pytest.raises(BadRequestError, match="must be a string"):
        client.call("echo", text=["x"])
    with pytest.raises(GroupNotFoundError) as info:
        client.call("fail")
    assert info.value.hint == GroupNotFoundError.hint
    with pytest.raises(RequestTooLargeError, match="at most"):
        client.call("rows", bulk=b"\0" * (LIMIT + 10))
    table = pa.table({"payload": [b"a", b"b"]})
    result, back = client.call("rows", bulk=table_to_ipc(table))
    assert result == {"rows": 2} and back.equals(table)
    client.close()


def test_progress_busy_and_deadlines(served: tuple[ApiServer, threading.Event]) -> None:
    server, gate = served
    client = Client.connect(server.socket_dir, timeout=5)
    seen: list[dict[str, Any]] = []
    # Two workers and one pending slot: the fourth concurrent slow call is refused as busy.
    others = [Client.connect(server.socket_dir, timeout=5) for _ in range(3)]
    results: list[Any] = []
    threads = [threading.Thread(target=lambda c=c: results.append(c.call("slow", timeout=10))) for c in others]
    for t in threads:
        t.start()
    time.sleep(0.5)
    with pytest.raises(AgentBusyError):
        client.call("slow", timeout=5)
    gate.set()
    for t in threads:
        t.join(10)
    assert results == [{"done": True}] * 3
    assert client.call("slow", timeout=5, progress=seen.append) == {"done": True}
    assert seen and seen[0]["phase"] == "working"
    gate.clear()
    with pytest.raises(ApiTimeoutError, match="did not answer slow within 0.5s"):
        client.call("slow", timeout=0.5)
    gate.set()
    assert client.call("echo", text="after") == {"echo": "after"}  # the late reply is not mistaken for this one
    for c in others:
        c.close()
    client.close()


def test_tcp_with_curve_admits_only_listed_keys(tmp_path: Path) -> None:
    gate = threading.Event()
    server_public, server_secret = zmq.curve_keypair()
    good_public, good_secret = zmq.curve_keypair()
    bad_public, bad_secret = zmq.curve_keypair()
    server = ApiServer(_registry(gate), tmp_path / "run", tcp_endpoint="tcp://127.0.0.1:*", curve_secret=server_secret,
                       allowed_clients=[good_public.decode()]).start()
    try:
        assert server.public_key == server_public.decode()
        good = Client.connect(server.tcp_endpoint, timeout=5, server_key=server.public_key, public_key=good_public,
                              secret_key=good_secret)
        assert good.call("echo", text="tcp") == {"echo": "tcp"}
        good.close()
        with pytest.raises(ApiPermissionError, match="refused this client's CURVE key"):
            Client.connect(server.tcp_endpoint, timeout=3, server_key=server.public_key, public_key=bad_public,
                           secret_key=bad_secret)
    finally:
        server.close()


def test_refused_curve_keys_cannot_flood_the_log(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone who reaches api.tcp_endpoint may try keys that are not listed, as fast as they can
    connect: each refusal wrote a warning, so an unauthenticated peer filled the agent's disk with
    log lines. Now one warning per interval says how many were refused since the last one."""
    import logging

    from zerocomm_spark.agent import server as server_module

    now = [1000.0]
    monkeypatch.setattr(server_module.time, "monotonic", lambda: now[0])
    allowed = server_module._Allowed({zmq.curve_keypair()[0]})  # noqa: SLF001
    caplog.set_level(logging.WARNING, logger="zerocomm_spark.agent.server")
    for _ in range(1000):
        assert allowed.callback("zerocomm-api", zmq.curve_keypair()[0]) is False
    refusals = [r for r in caplog.records if "refused a TCP API client" in r.getMessage()]
    assert len(refusals) == 1
    now[0] += 60
    assert allowed.callback("zerocomm-api", zmq.curve_keypair()[0]) is False
    refusals = [r for r in caplog.records if "refused a TCP API client" in r.getMessage()]
    assert len(refusals) == 2 and refusals[1].fields["refused_since_last_warning"] == 999


def test_a_directory_the_client_cannot_enter_fails_clearly(served: tuple[ApiServer, threading.Event],
                                                          tmp_path: Path) -> None:
    server, _ = served
    if os.getuid() == 0:
        pytest.skip("root enters any directory; the integration test runs the client as another user")
    os.chmod(server.socket_dir, 0o000)
    try:
        with pytest.raises(ApiPermissionError, match="may not open the agent's socket directory"):
            Client.connect(server.socket_dir, timeout=2)
    finally:
        os.chmod(server.socket_dir, 0o700)


@pytest.mark.parametrize("how", ["directory others may write", "socket of another user"])
def test_the_client_refuses_a_socket_another_user_could_have_planted(served: tuple[ApiServer, threading.Event],
                                                                    how: str) -> None:
    """The client checked that the socket directory was its user's, but not that others could not
    write it, nor whose the socket was: in a group- or world-writable directory (api.socket_dir in a
    shared place, before an agent tightened it) another user's listener at api.sock got every
    publish's payloads and answered reads with rows of its choosing."""
    server, _ = served
    sock = server.socket_dir / "api.sock"
    if how == "directory others may write":
        os.chmod(server.socket_dir, 0o777)
    elif os.getuid() != 0:
        pytest.skip("making a socket of another user needs root")
    else:
        os.chown(sock, 65534, 65534)
    try:
        with pytest.raises(ApiPermissionError, match="other users could|belongs to uid 65534"):
            Client.connect(server.socket_dir, timeout=2)
    finally:
        os.chmod(server.socket_dir, 0o700)
        if how == "socket of another user":
            os.chown(sock, os.getuid(), os.getgid())
    Client.connect(server.socket_dir, timeout=2).close()  # its own, private again: served


def test_close_lets_running_calls_answer_and_refuses_new_ones(served: tuple[ApiServer, threading.Event]) -> None:
    """An agent stopping mid-call (SIGTERM during a publish) answers that call if it finishes within
    the stop timeout, instead of leaving the client with "outcome unknown"."""
    server, gate = served
    results: list[Any] = []
    client = Client.connect(server.socket_dir, timeout=5)
    caller = threading.Thread(target=lambda: results.append(client.call("slow", timeout=10)))
    caller.start()
    deadline = time.monotonic() + 5
    # in flight once connect's status call is done and counted: then the one in flight is "slow"
    while not (server.stats["calls"] >= 1 and server._in_flight == 1) and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    closer = threading.Thread(target=server.close, kwargs={"timeout": 10})
    closer.start()
    while not server._draining:  # noqa: SLF001
        time.sleep(0.01)
    sock = _raw(server)
    refused = _ask(sock, json.dumps({"id": 1, "call": "echo", "args": {"text": "late"}}).encode())
    assert refused["error"]["type"] == "AgentNotRunningError" and "stopping" in refused["error"]["message"]
    sock.close()
    gate.set()
    caller.join(10)
    closer.join(10)
    assert results == [{"done": True}] and not closer.is_alive()
    client.close()


def test_a_large_reply_finished_while_closing_reaches_the_client(tmp_path: Path) -> None:
    """The reading thread's last flush only queues replies in ZeroMQ: its sockets closed with no
    linger threw away a large one (lost about half the time at 30 MB)."""
    gate, entered = threading.Event(), threading.Event()
    big = os.urandom(1 << 20) * 24
    bulk = table_to_ipc(pa.table({"blob": pa.array([big], pa.large_binary())}))
    registry = CallRegistry()
    registry.add("status", lambda req: {"label": "big"})
    registry.add("big", lambda req: (entered.set(), gate.wait(10), ({"size": len(big)}, bulk))[2])
    for attempt in range(3):
        gate.clear()
        entered.clear()
        server = ApiServer(registry, tmp_path / f"run{attempt}", workers=2).start()
        client = Client.connect(server.socket_dir, timeout=5)
        got: list[Any] = []
        caller = threading.Thread(target=lambda: got.append(client.call_bulk("big", timeout=20)))
        caller.start()
        assert entered.wait(10)  # the call runs (connect's own status call may still be counted in flight)
        closer = threading.Thread(target=server.close, kwargs={"timeout": 10})
        closer.start()
        while not server._draining:  # noqa: SLF001
            time.sleep(0.01)
        gate.set()
        caller.join(20)
        closer.join(20)
        client.close()
        assert got and got[0][0] == {"size": len(big)}, attempt
        assert got[0][1].column("blob")[0].as_py() == big, attempt


def test_a_call_waiting_for_another_threads_call_keeps_its_own_deadline(
        served: tuple[ApiServer, threading.Event]) -> None:
    """One Client shared by threads (a notebook, a Spark executor) runs one call at a time; a call
    queued behind a long one (a read with wait=) must still give up at its own deadline."""
    server, gate = served
    client = Client.connect(server.socket_dir, timeout=5)
    slow = threading.Thread(target=lambda: client.call("slow", timeout=20), daemon=True)
    slow.start()
    deadline = time.monotonic() + 5
    while server._in_flight < 1 and time.monotonic() < deadline:  # noqa: SLF001 - the slow call runs
        time.sleep(0.01)
    started = time.monotonic()
    with pytest.raises(ApiTimeoutError, match="another call on this client"):
        client.call("echo", text="quick", timeout=0.5)
    assert time.monotonic() - started < 2.0
    gate.set()
    slow.join(10)
    assert client.call("echo", text="after") == {"echo": "after"}
    client.close()


def test_a_start_that_fails_leaves_no_socket_or_thread_behind(tmp_path: Path) -> None:
    """A taken api.tcp_endpoint failed the start after the Unix socket was bound: its file stayed
    (a stale socket for clients to trip on) and the ZAP thread and context kept running."""
    import socket as pysocket

    taken = pysocket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    _, server_secret = zmq.curve_keypair()
    client_public, _ = zmq.curve_keypair()
    before = set(threading.enumerate())
    server = ApiServer(_registry(threading.Event()), tmp_path / "run", tcp_endpoint=f"tcp://127.0.0.1:{port}",
                       curve_secret=server_secret, allowed_clients=[client_public.decode()])
    try:
        with pytest.raises(ConfigurationError, match="cannot bind api.tcp_endpoint"):
            server.start()
        assert not (tmp_path / "run" / "api.sock").exists()
        deadline = time.monotonic() + 5
        while [t for t in threading.enumerate() if t not in before and t.is_alive()] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]
        assert server._ctx.closed  # noqa: SLF001
    finally:
        taken.close()


def test_a_shared_directory_is_not_taken_over_as_the_socket_directory(tmp_path: Path) -> None:
    """api.socket_dir=/tmp (an agent run as root owns /tmp) was chmod-ed to 700: every other user of
    the machine lost /tmp. A sticky directory is refused, untouched, with what to use instead."""
    from zerocomm_spark.agent.server import prepare_socket_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigurationError, match="shared directory") as info:
        prepare_socket_dir(shared)
    assert str(shared / "zerocomm") in info.value.hint
    with pytest.raises(ConfigurationError, match="shared directory"):
        ApiServer(CallRegistry(), shared).start()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777 and not list(shared.iterdir())
    prepare_socket_dir(shared / "zerocomm")  # its own directory inside: fine, and private
    assert stat.S_IMODE((shared / "zerocomm").stat().st_mode) == 0o700


def test_a_malformed_allowed_client_key_is_refused_at_start(tmp_path: Path) -> None:
    """A typo (or a non-ASCII character) in api.allowed_clients started an agent that refused every
    TCP client with "refused this client's CURVE key", or failed with a UnicodeEncodeError traceback."""
    _, server_secret = zmq.curve_keypair()
    good_public, _ = zmq.curve_keypair()
    for bad in ("notakey", good_public.decode()[:-1] + "~", "é" * 40):
        server = ApiServer(CallRegistry(), tmp_path / "run", tcp_endpoint="tcp://127.0.0.1:*",
                           curve_secret=server_secret, allowed_clients=[good_public.decode(), bad])
        with pytest.raises(ConfigurationError, match="is not a CURVE public key") as info:
            server.start()
        assert "zerocomm keygen" in info.value.hint
        assert bad[:8] in str(info.value) and (len(bad) <= 8 or bad not in str(info.value))  # a key is not echoed
        assert not (tmp_path / "run" / "api.sock").exists()  # nothing left half-started


def test_a_client_that_does_not_read_its_replies_cannot_make_the_agent_hold_them(tmp_path: Path) -> None:
    """A client that sent calls faster than it read the replies had up to 10,000 of them (SNDHWM) held
    by the agent for it, each as large as a read's page (api.max_read_bytes): a real agent grew by
    1.2 GB for 300 unread reads of 4 MB. The agent now keeps only a few replies queued for a client;
    one that does not read loses the rest, not the agent its memory."""
    server = ApiServer(_registry(threading.Event()), tmp_path / "run", max_request_bytes=LIMIT, workers=2,
                       max_pending=4096).start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 1)  # it reads nothing: its side takes one reply, the kernel a few
        sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(server.ipc_endpoint)
        count = 1500
        for i in range(count):  # each reply is 64 KB: 96 MB in all
            sock.send_multipart([json.dumps({"id": i, "call": "echo", "args": {"text": "x" * 1024,
                                                                                 "times": 64}}).encode()])
        deadline = time.monotonic() + 60
        while server.stats["calls"] < count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats["calls"] == count
        time.sleep(0.5)  # the last replies flushed to the socket
        received = 0
        while sock.poll(1000, zmq.POLLIN):
            sock.recv_multipart()
            received += 1
        assert 0 < received <= 100, received
        assert Client.connect(server.socket_dir, timeout=5).call("echo", text="still") == {"echo": "still"}
    finally:
        sock.close(linger=0)
        server.close()


def test_long_polls_do_not_hold_the_workers_other_calls_need(tmp_path: Path) -> None:
    """As many long polls as workers (a read with wait: 16 `zerocomm tail`-style followers of a quiet
    group on a real agent) parked every worker: status, publish and commit queued behind them and
    timed out until a poll ended. Calls that park run on workers of their own."""
    gate = threading.Event()
    r = CallRegistry()

    def poll(req: Request, wait: float | None) -> dict[str, Any]:
        gate.wait(wait or 0)
        return {"rows": 0}

    r.add("read", poll, {"wait": Param(float)}, parks=lambda args: bool(args.get("wait")))
    r.add("status", lambda req: {"label": "test", "max_request_bytes": LIMIT})
    server = ApiServer(r, tmp_path / "run", max_request_bytes=LIMIT, workers=2, max_pending=8).start()
    pollers = [Client.connect(server.socket_dir, timeout=5) for _ in range(4)]
    threads = [threading.Thread(target=c.call, args=("read",), kwargs={"wait": 20.0, "timeout": 30}) for c in pollers]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)  # every poll parked
        client = Client.connect(server.socket_dir, timeout=5)
        started = time.monotonic()
        assert client.call("status", timeout=3)["label"] == "test"
        assert time.monotonic() - started < 2
        assert client.call("read", timeout=3) == {"rows": 0}  # a read that does not wait is not parked either
        client.close()
    finally:
        gate.set()
        for t in threads:
            t.join(10)
        for c in pollers:
            c.close()
        server.close()


def test_a_requests_repr_shows_no_argument_or_bulk_content() -> None:
    """A Request holds send's message text and publish's Arrow frame (payloads in clear); its dataclass
    repr printed both, so one %r of a request in a log line or an error would have carried them."""
    from zerocomm_spark.agent.server import Request

    req = Request(id="7", call="send", args={"peer": "bob", "message": "PLAINTEXT-NOTE"}, bulk=b"PLAINTEXT-ROWS",
                  timeout=5.0)
    shown = f"{req!r} {req}"
    assert "PLAINTEXT" not in shown and "send" in shown and "'7'" in shown
