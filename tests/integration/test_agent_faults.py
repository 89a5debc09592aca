"""Resource faults under a real, running agent: a full disk under its journal, its journal directory
removed, its pid file changed in place, and what publishers, `agent stop`/`status` and a restart make of them. The promise under test: nothing acknowledged is lost, and
nothing is duplicated after the restart (publishers re-send what was not acknowledged, by message id).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_cli_support import ZEROCOMM, Member, in_group, start_all, wait_for
from zerocomm_spark.client import Client
from zerocomm_spark.errors import ZeroCommError

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

BATCH = 20


def _batch(n: int) -> tuple[list[bytes], list[str]]:
    ids = [f"b{n:03d}-{i:02d}" for i in range(BATCH)]
    return [f"payload {mid}".encode() for mid in ids], ids


def _journal_ids(member: Member) -> Counter:
    with Client.connect(member.config, timeout=20) as client:
        ids: Counter = Counter()
        offset = None
        while True:
            page = client.fetch(group="g", start=offset)
            ids.update(page.table.column("message_id").to_pylist())
            if page.next_offset >= page.end_offset:
                return ids
            offset = page.next_offset


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[Member, Member]]:
    with in_group(tmp_path) as members:
        yield members


def test_a_receiver_whose_journal_directory_was_removed_acknowledges_nothing_more(
        pair: tuple[Member, Member]) -> None:
    """Before: bob went on journaling into the unlinked segment and acknowledging, `agent status` said
    all was well, and after a restart every message acknowledged since the removal was gone (the
    publisher had no reason to re-send them). Now the first delivery after the removal stops bob
    without acknowledging it, and a restart plus the publisher's re-send gets every one exactly once."""
    alice, bob = pair
    acked: list[int] = []
    with Client.connect(alice.config, timeout=20) as client:
        for n in range(3):
            payloads, ids = _batch(n)
            client.publish("g", payloads, message_ids=ids, timeout=20)
        pid = bob.pid()
        assert pid is not None
        shutil.rmtree(bob.identity / "journal")  # a tmp cleaner, a cleanup script
        for n in range(3, 6):
            payloads, ids = _batch(n)
            try:
                client.publish("g", payloads, message_ids=ids, timeout=4)
                acked.append(n)
            except ZeroCommError:
                break  # not acknowledged: it and the batches after it are re-sent below
    assert acked == [], f"batches {acked} were acknowledged by a member whose journal directory is gone"
    bob.wait_gone(pid, timeout=20)  # it stopped rather than run on half-dead
    log = bob.log()
    assert "was removed while the journal was open" in log
    assert "payload b0" not in log  # the log names the fault, never a payload

    assert bob.start()["pid"] != pid  # a restart opens a new journal where the old one was
    with Client.connect(alice.config, timeout=20) as client:
        for n in range(3, 6):  # the publisher's recovery: what was not acknowledged, again, same ids
            payloads, ids = _batch(n)
            client.publish("g", payloads, message_ids=ids, timeout=40)
    expected = {mid for n in range(3, 6) for mid in _batch(n)[1]}

    def holds_them() -> Counter | None:
        found = _journal_ids(bob)
        return found if expected <= set(found) else None

    ids = wait_for(holds_them, 30, "bob's new journal to hold the re-sent batches")
    assert [mid for mid, count in ids.items() if count > 1] == []  # nothing twice


def test_an_idle_agent_whose_journal_directory_was_removed_stops_so_it_can_be_started_again(tmp_path: Path) -> None:
    """With no message coming (a quiet group) no append fails: the agent ran on over a journal that was
    gone, serving reads of deleted files, and `agent status` said all was well. It stops (exit 75, as
    after any journal failure: a service manager restarts it), and starts again with a new journal."""
    fg = Member(tmp_path, "quiet", "agent.heartbeat_interval=0.2")
    fg.init()
    proc = subprocess.Popen([*ZEROCOMM, "--config", str(fg.config), "--json", "agent", "start"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["pid"] == proc.pid
        fg.ok("group", "create", "g")
        shutil.rmtree(fg.identity / "journal")
        assert proc.wait(15) == 75
        _, err = proc.communicate(timeout=5)
        assert "journal's files were removed" in err
        restarted = fg.start()
        assert restarted["pid"] != proc.pid and fg.ok("agent", "status")["journal"]["next_offset"] == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
        fg.stop()


def _write_in_place(path: Path, text: str) -> None:
    """Change a file's text keeping its inode (an editor's save-in-place, `echo N > file`)."""
    with open(path, "r+") as f:
        f.truncate(0)
        f.write(text)


def test_agent_stop_never_signals_a_stranger_named_by_a_pid_file_changed_in_place(tmp_path: Path) -> None:
    """The pid file is locked by the agent, so `agent stop` trusted its text: changed in place to the pid of
    another live process, stop SIGTERMed that process, then said the agent "did not stop" and advised
    --force (a SIGKILL of the stranger). Now stop signals the process the kernel says serves the API socket."""
    m = Member(tmp_path, "solo", "agent.heartbeat_interval=60")  # no heartbeat repairs the file meanwhile
    m.init()
    pid = m.start()["pid"]
    stranger = subprocess.Popen(["sleep", "120"])
    try:
        _write_in_place(m.run_dir / "agent.pid", f"{stranger.pid}\n")
        stopped = m.run("agent", "stop", "--timeout", "15", timeout=40)
        assert stopped.code == 0, stopped
        assert stopped.json["pid"] == pid
        assert stranger.poll() is None, "agent stop signalled a process that is not the agent"
        m.wait_gone(pid)
    finally:
        stranger.kill()
        stranger.wait(10)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_agent_names_itself_again_in_a_pid_file_changed_in_place(tmp_path: Path) -> None:
    m = Member(tmp_path, "solo", "agent.heartbeat_interval=0.2")
    m.init()
    pid = m.start()["pid"]
    try:
        _write_in_place(m.run_dir / "agent.pid", "garbage\n")
        wait_for(lambda: m.pid() == pid, 10, "the agent to name itself in its pid file again")
        assert "no longer named this agent" in m.log()
        assert m.ok("agent", "status")["pid"] == pid
    finally:
        m.stop()


def test_a_full_disk_stops_the_receiver_unacknowledged_status_says_why_and_a_restart_loses_nothing(
        tmp_path: Path) -> None:
    """A disk that fills while a group publishes to bob (RLIMIT_FSIZE: the journal's writes get EFBIG).
    Bob must not acknowledge what it could not journal: it exits (75), the publisher's publish fails,
    and once there is room a restart plus the publisher's re-send of what failed gets every message
    exactly once. Before, `agent status` then said bob "crashed or was killed", with "start it" as the
    advice: restarted on the full disk, it failed again; now it says the journal failed and why."""
    alice, bob = Member(tmp_path, "alice"), Member(tmp_path, "bob")

    def small_files() -> None:  # in the starter, inherited by the agent it launches
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (150_000, resource.RLIM_INFINITY))

    try:
        start_all([alice])
        bob.init()
        started = subprocess.run([*ZEROCOMM, "--config", str(bob.config), "--json", "agent", "start", "--detach"],
                                 capture_output=True, text=True, timeout=60, preexec_fn=small_files)
        assert started.returncode == 0, started
        alice.ok("group", "create", "g")
        bob.ok("connect", alice.ok("invite")["url"])
        bob.ok("group", "join", "g", "--via", "alice")
        pid = bob.pid()
        assert pid is not None
        padding = b"." * 2000
        acked: list[int] = []
        with Client.connect(alice.config, timeout=20) as client:
            for n in range(40):  # 40 KB a batch: the journal's segment reaches 150 kB in a few
                payloads, ids = _batch(n)
                try:
                    client.publish("g", [p + padding for p in payloads], message_ids=ids, timeout=5)
                    acked.append(n)
                except ZeroCommError:
                    break
        assert 0 < len(acked) < 40, acked
        bob.wait_gone(pid, timeout=20)
        status = bob.run("agent", "status", json_out=False)
        assert status.code == 3, status
        assert "journal failed" in status.stderr and "File too large" in status.stderr, status.stderr
        assert "crashed or was killed" not in status.stderr
        assert "payload b0" not in bob.log()

        bob.start()  # room again: this agent has no file size limit
        unacked = [n for n in range(40) if n not in acked]
        with Client.connect(alice.config, timeout=20) as client:
            for n in unacked:
                payloads, ids = _batch(n)
                client.publish("g", [p + padding for p in payloads], message_ids=ids, timeout=40)
        ids = _journal_ids(bob)
        assert [mid for mid, count in ids.items() if count > 1] == []  # nothing twice
        assert set(ids) == {mid for n in range(40) for mid in _batch(n)[1]}  # nothing acknowledged lost
    finally:
        for m in (alice, bob):
            m.stop()


# A real agent process (AgentProcess, as `agent start` runs it) whose journal rolls a segment every
# delivery; once it serves, its open-file limit is lowered and every descriptor left is taken, then
# deliveries (as the data plane hands them over) go in until a roll needs one more.
OUT_OF_FDS_AGENT = """
import os, resource, sys, time
from types import SimpleNamespace
from zerocomm_spark.agent import config as cfgmod
from zerocomm_spark.agent.process import AgentProcess

cfg = cfgmod.load(None, env={}, flags=[f"identity.dir={sys.argv[1]}", "journal.segment_bytes=1024"])
proc = AgentProcess(cfg).start()

def delivery(seq):
    return SimpleNamespace(group="g", message_id=f"m{seq}", publisher_did="did:peer:2.Ez6LSpub", seq=seq,
                           lamport_ts=seq, sent_at=time.time(), received_at=time.time(), headers=None,
                           payload=b"x" * 400)

proc.ingest.on_messages([delivery(1), delivery(2)])
highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 8, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
for seq in range(3, 100):
    proc.ingest.on_messages([delivery(seq)])  # the agent exits (75) in here once a roll fails
print("no roll failed", flush=True)
"""


def test_a_journal_roll_out_of_descriptors_stops_the_agent_and_status_says_to_raise_the_limit(
        tmp_path: Path) -> None:
    """A segment roll that failed with EMFILE stopped the agent (75, rightly: nothing unjournaled is
    acknowledged), but the health file could not be written (no descriptor left for it either), so
    `agent status` said it "crashed or was killed"; and had it been written, the advice was "free
    space, permissions". The agent now keeps a few descriptors in reserve for that write, and status
    says what the errno means: raise the open-file limit."""
    import sys

    identity = tmp_path / "id"
    agent = subprocess.run([sys.executable, "-c", OUT_OF_FDS_AGENT, str(identity)], capture_output=True,
                           text=True, timeout=120)
    assert agent.stdout.split() == ["full"], agent
    assert agent.returncode == 75, agent
    assert "Too many open files" in agent.stderr, agent.stderr  # its log: the failure, and the advice
    assert "raise its open-file limit" in agent.stderr and "reopen the journal" not in agent.stderr, agent.stderr
    status = subprocess.run([*ZEROCOMM, "--identity-dir", str(identity), "agent", "status"], capture_output=True,
                            text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                        if not k.startswith("ZEROCOMM_")})
    said = status.stderr
    assert status.returncode == 3, status
    assert "its journal" in said and "Too many open files" in said, said
    assert "ran out of file descriptors" in said and "ulimit -n" in said and "LimitNOFILE" in said, said
    assert "crashed or was killed" not in said and "free space" not in said, said
    assert "Once that is fixed, start it" in said, said  # not a bare "Start it", which would only fail again
    health = json.loads((identity / "run" / "health.json").read_text())
    assert health["state"] == "failed" and "ulimit -n" in health["fix"], health


def test_send_from_a_slow_stdin_publishes_each_line_soon_and_stops_clearly_with_the_agent(tmp_path: Path) -> None:
    """`producer | zerocomm send g -` with a producer that writes now and then (a log, a sensor): lines
    were held until 10,000 of them or 1 MiB had come, or stdin ended, so nothing was published for as
    long as the producer ran, and an `agent stop` meanwhile ended the send with every line "may be out".
    Now a line that waits past a short pause goes out; a stop then leaves the lines already acknowledged
    out, and the error names the --skip that sends the rest."""
    m = Member(tmp_path, "solo")
    m.init()
    m.start()
    send: subprocess.Popen[str] | None = None
    try:
        m.ok("group", "create", "g")
        send = subprocess.Popen([*ZEROCOMM, "--config", str(m.config), "--json", "send", "g", "-",
                                 "--id-prefix", "slow"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert send.stdin is not None
        send.stdin.write("first\nsecond\n")
        send.stdin.flush()
        wait_for(lambda: sum(_journal_ids(m).values()) == 2, 20, "the two lines written to be published")
        m.ok("agent", "stop")
        out, err = send.communicate("third\n", timeout=60)
        assert send.returncode != 0
        assert "--skip 2" in out, (out, err)  # the two published lines are acknowledged; the rest from line 3
    finally:
        if send is not None and send.poll() is None:
            send.kill()
            send.communicate(timeout=10)
        m.stop()
