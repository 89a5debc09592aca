"""The zerocomm command: run an agent and drive it (connections, groups, messages, the journal).

Every command except `init`, `agent start`, `keygen` and `config` talks to a running agent through
its local API (zerocomm_spark.client), so the CLI, a notebook and a Spark task see the same member.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import hashlib
import io
import os
import select
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from zerocomm_spark import errors
from zerocomm_spark.agent import config as config_mod
from zerocomm_spark.agent.config import Config
from zerocomm_spark.agent.output import (
    Progress,
    emit_json,
    format_payload,
    format_time,
    json_headers,
    json_payload,
    printable,
    render_pairs,
    render_table,
    short_did,
)
from zerocomm_spark.client import Client, error_header
from zerocomm_spark.deadlines import check_timeout
from zerocomm_spark.errors import ZeroCommError
from zerocomm_spark.group.topics import check_group
from zerocomm_spark.paths import make_dirs, not_a_directory, what_is
from zerocomm_spark.text import is_utf8_text

__all__ = ["main", "exit_code_for", "EXIT_CODES"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3
EXIT_TIMEOUT = 4
EXIT_ALREADY_RUNNING = 5
EXIT_NOT_FOUND = 6
EXIT_PERMISSION = 7
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_ERROR: "an error (the message says what failed and what to do)",
    EXIT_USAGE: "bad usage or configuration (unknown option, malformed setting, wrong argument)",
    EXIT_NOT_RUNNING: "no agent is running for this configuration (start one: zerocomm agent start --detach)",
    EXIT_TIMEOUT: "a deadline passed (the agent or a peer did not answer in time; retry with --timeout)",
    EXIT_ALREADY_RUNNING: "an agent already runs for this identity (agent start)",
    EXIT_NOT_FOUND: "no such connection, group or member",
    EXIT_PERMISSION: "permission denied (socket directory of another user, key not allowed)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for an error (see ``zerocomm --help``)."""
    if isinstance(exc, errors.AgentAlreadyRunningError):
        return EXIT_ALREADY_RUNNING
    if isinstance(exc, errors.AgentNotRunningError):
        return EXIT_NOT_RUNNING
    if isinstance(exc, (errors.ApiPermissionError, errors.InsecurePermissionsError)):
        return EXIT_PERMISSION
    if isinstance(exc, (TimeoutError, errors.PeerTimeoutError)):
        return EXIT_TIMEOUT
    not_found = tuple(getattr(errors, name) for name in ("ConnectionNotFoundError", "GroupNotOpenError",
                                                         "NotAMemberError", "GroupNotFoundError")
                      if hasattr(errors, name))
    if isinstance(exc, not_found):
        return EXIT_NOT_FOUND
    if isinstance(exc, (errors.ConfigurationError, errors.BadRequestError, errors.InvalidGroupNameError)):
        return EXIT_USAGE
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_ERROR


# --- the parser --------------------------------------------------------------------------------

_EPILOG = "exit codes:\n" + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_CODES.items()) + """

configuration: conf/zerocomm.toml lists every setting. Later wins: defaults, the file (--config,
$ZEROCOMM_CONFIG, ~/.zerocomm/zerocomm.toml), environment ZEROCOMM_<SECTION>_<KEY>, flags
(--set section.key=value and the shortcuts under common options).

examples:
  zerocomm init --label alice                  create an identity and a config file
  zerocomm agent start --detach                run the agent in the background
  zerocomm invite                              print an invitation URL for another member
  zerocomm connect 'https://...?oob=...'       accept one (DID exchange)
  zerocomm group create sensors
  zerocomm group join sensors --via alice      join through a member you are connected to
  zerocomm send sensors 'hello'                publish; returns once every member has it
  zerocomm send sensors 'hello' --sign         ... with an origin proof signed by this member
  zerocomm send sensors - < readings.txt       each line a message (an error says how to send the rest)
  zerocomm tail sensors                        follow the group's messages, like tail -F
"""


def _common() -> argparse.ArgumentParser:
    """Options accepted before or after the command (defaults applied later, so both places work)."""
    p = argparse.ArgumentParser(add_help=False)
    s = argparse.SUPPRESS
    g = p.add_argument_group("common options")
    g.add_argument("--config", metavar="PATH", default=s, help="configuration file (TOML)")
    g.add_argument("--identity-dir", metavar="DIR", default=s, help="the member's identity directory (identity.dir)")
    g.add_argument("--label", metavar="NAME", default=s, help="how peers see this member (identity.label)")
    g.add_argument("--socket-dir", metavar="DIR", default=s, help="the local API socket directory (api.socket_dir)")
    g.add_argument("--endpoint", metavar="URL", default=s, help="the peer transport endpoint (peer.endpoint)")
    g.add_argument("--log-level", metavar="LEVEL", default=s, help="debug, info, warning or error (log.level)")
    g.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=s, dest="settings",
                   help="override any setting (repeatable)")
    g.add_argument("--json", action="store_true", default=s, help="print JSON for scripts instead of tables")
    g.add_argument("--timeout", type=float, metavar="SECONDS", default=s,
                   help="deadline of the command's calls (default 30; agent start --detach and agent stop: "
                        "agent.start_timeout, agent.stop_timeout)")
    g.add_argument("--spawn", action="store_true", default=s,
                   help="start an agent in the background if none is running")
    return p


class _SubCommands(argparse._SubParsersAction):  # noqa: SLF001 - argparse's own subcommand action
    """Subcommands whose ``--set`` adds to the ones given before the command name. argparse parses a
    subcommand's options into a namespace of its own and copies it over, so `zerocomm --set a=1
    config --set b=2` dropped a=1 without a word."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, "settings", None)
        super().__call__(parser, namespace, values, option_string)
        after = getattr(namespace, "settings", None)
        if before and after is not None and after is not before:
            namespace.settings = [*before, *after]


class _Parser(argparse.ArgumentParser):
    """The top-level parser: `history GROUP` keeps meaning `history show GROUP` (see _with_history_action)."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(_with_history_action(argv), namespace)


def build_parser() -> argparse.ArgumentParser:
    common = _common()
    parser = _Parser(
        prog="zerocomm", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
        description="End-to-end encrypted DIDComm group messaging: run a member agent and drive it.",
        epilog=_EPILOG)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser,
                                action=_SubCommands)
    sub.required = True

    def add(parent: Any, name: str, help_text: str, func: Callable[..., int]) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_text, description=help_text, parents=[common],
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG.split("\n\n")[0])
        p.set_defaults(func=func)
        return p

    p = add(sub, "init", "create this member's identity (sealed keystore, journal key) and a config file", cmd_init)
    p.add_argument("--force", action="store_true", help="overwrite an existing config file")

    # (parents=[common]: the options go between `agent` and its action too, as the README says)
    agent = sub.add_parser("agent", help="start, stop or inspect the agent process", parents=[common])
    agent_sub = agent.add_subparsers(dest="agent_command", metavar="ACTION", action=_SubCommands)
    agent_sub.required = True
    p = add(agent_sub, "start", "run the agent (foreground; --detach for the background)", cmd_agent_start)
    p.add_argument("--detach", action="store_true", help="run in the background and return once it serves")
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-lock-fd", type=int, help=argparse.SUPPRESS)  # the run lock a detached start passes down
    # A start on demand (Client.connect(spawn=True), the connector): for an existing identity only.
    p.add_argument("--existing-identity", action="store_true", help=argparse.SUPPRESS)
    p = add(agent_sub, "stop", "stop the agent gracefully (SIGTERM, then wait)", cmd_agent_stop)
    p.add_argument("--force", action="store_true", help="kill it if it does not stop within the deadline")
    add(agent_sub, "status", "is the agent running, and how is it (exit 3 if not running)", cmd_agent_status)

    p = add(sub, "invite", "print an invitation URL another member accepts with `zerocomm connect`", cmd_invite)
    p.add_argument("--multi-use", action="store_true", help="let several members accept it")
    p.add_argument("--group", metavar="GROUP", help="an invitation to join GROUP (for the invitation joiner policy)")
    p.add_argument("--invite-label", metavar="TEXT", help="a label shown to whoever accepts it")
    p = add(sub, "connect", "accept an invitation URL: connect to the member that made it", cmd_connect)
    p.add_argument("url", metavar="URL", help="the invitation URL, or - to read it from stdin (an invitation is a "
                   "bearer token, and arguments are visible to other local users in ps)")
    add(sub, "connections", "list this member's connections", cmd_connections)
    p = add(sub, "message", "send a private DIDComm basic message to one connection", cmd_message)
    p.add_argument("peer", metavar="PEER", type=_named, help="connection id, label or DID")
    p.add_argument("text", metavar="TEXT", help="the text, or - to read it from stdin (arguments are visible to "
                   "other local users in ps)")
    p = add(sub, "inbox", "basic messages received since the agent started", cmd_inbox)
    p.add_argument("--peer", metavar="PEER")

    group = sub.add_parser("group", help="create, join, leave and inspect groups", parents=[common])
    group_sub = group.add_subparsers(dest="group_command", metavar="ACTION", action=_SubCommands)
    group_sub.required = True
    p = add(group_sub, "create", "create a group with this member in it", cmd_group_create)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("--mode", choices=("single", "multi", "shared"),
                   help="how data is encrypted and fanned out (default shared)")
    p.add_argument("--ordered", action=argparse.BooleanOptionalAction, default=None,
                   help="deliver each publisher's messages in seq order, holding early ones back (default on)")
    p.add_argument("--consistent-join", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse joiners whose members disagree on the view (default on)")
    p.add_argument("--role", choices=("read_write", "read_only"), help="default read_write")
    p = add(group_sub, "join", "join a group through a member you are connected to", cmd_group_join)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("--via", required=True, metavar="PEER", type=_named,
                   help="a member of the group: connection id, label or DID")
    p.add_argument("--role", choices=("read_write", "read_only"), help="default read_write")
    p = add(group_sub, "leave", "leave a group", cmd_group_leave)
    p.add_argument("group", metavar="GROUP", type=_named)
    p = add(group_sub, "info", "a group's settings and this member's place in it", cmd_group_info)
    p.add_argument("group", metavar="GROUP", type=_named)
    p = add(group_sub, "members", "a group's members with their roles and status", cmd_group_members)
    p.add_argument("group", metavar="GROUP", type=_named)
    add(group_sub, "list", "the groups this member is in", cmd_group_list)
    p = add(group_sub, "role", "switch this member's role in a group without leaving", cmd_group_role)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("role", choices=("read_write", "read_only"))

    p = add(sub, "send", "publish a message to a group; returns once every member acknowledged it", cmd_send)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("message", metavar="MESSAGE", help="the text, or - to publish each line of stdin (in chunks, "
                                                      "each sent once stdin pauses 0.2 s or after 1 s; see --id-prefix)")
    p.add_argument("--id", dest="message_id", metavar="ID", help="the message id (re-sending the same id is safe)")
    p.add_argument("--id-prefix", metavar="PREFIX", type=_id_prefix,
                   help="with -: line N of stdin gets the message id PREFIX-N-HASH (HASH of the group and the "
                        "line's text), so the same input sent again with the same prefix delivers no line twice. "
                        "Default: a fresh prefix each run (the same input sent twice is sent twice); a send that "
                        "stops part way names its prefix and the --skip that send the rest")
    p.add_argument("--skip", type=_count, default=0, metavar="N",
                   help="with -: do not send the first N lines of stdin (acknowledged before); ids still count them")
    p.add_argument("--sign", action="store_true",
                   help="have the agent sign each message with this member's key (an origin proof, header "
                        "zc-origin), so history can prove later who published it")
    p = add(sub, "tail", "print a group's messages as they arrive (from the journal), like tail -F (across agent "
                         "restarts)", cmd_tail)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("-n", "--lines", type=_count, default=10, metavar="N", help="show the last N first (default 10)")
    p.add_argument("--no-follow", action="store_true", help="print the last N and stop")
    _add_history(sub, add, common)
    add(sub, "metrics", "messages in and out, bytes, lag per publisher, peers alive, API calls, peer transport "
                        "counters", cmd_metrics)
    add(sub, "keygen", "make a CURVE key pair for a remote API client (api.allowed_clients)", cmd_keygen)
    add(sub, "config", "show the configuration in force and where each setting comes from", cmd_config)
    return parser


_ID_PREFIX_MAX = 64
_ID_PREFIX_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._")


def _id_prefix(text: str) -> str:
    """A `send -` id prefix: letters, digits, '.', '_' (it goes into a command line the error prints)."""
    if not text or len(text) > _ID_PREFIX_MAX or not set(text) <= _ID_PREFIX_CHARS:
        raise argparse.ArgumentTypeError(f"an id prefix is 1 to {_ID_PREFIX_MAX} letters, digits, '.' or '_', "
                                         f"not {text[:80]!r}")
    return text


def _named(text: str) -> str:
    """A group or peer name: empty (an unset shell variable) is a usage error here, said as such,
    not the API's refusal with advice about a Client method's signature."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset shell variable?); give the name")
    return text


def _count(text: str) -> int:
    """A count of messages or rows: a negative one is a typo, not a request (it read as 0 or 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


HISTORY_ACTIONS = ("show", "ingest", "replay", "compact", "vacuum")
_VALUE_OPTIONS = {"--config", "--identity-dir", "--label", "--socket-dir", "--endpoint", "--log-level", "--set",
                  "--timeout"}


def _add_history(sub: Any, add: Callable[..., argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    """`zerocomm history GROUP` (the journal) and `zerocomm history ingest|replay|compact|vacuum` (Delta)."""
    history = sub.add_parser(
        "history", help="a group's journaled messages (history GROUP), or its Delta history table",
        description="`zerocomm history GROUP` lists the member's journal; the actions below keep a group's "
                    "history in a Delta table with Spark (zerocomm_spark.pipelines).", parents=[common])
    actions = history.add_subparsers(dest="history_command", metavar="ACTION", action=_SubCommands)
    actions.required = True
    p = add(actions, "show", "a group's journaled messages, oldest first (the default action)", cmd_history)
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("--limit", type=_count, default=100, metavar="N", help="the last N messages (default 100, 0: all)")
    p.add_argument("--all", action="store_true", help="every retained message")
    key_help = "file holding the 32-byte group history key (raw or 64 hex digits, mode 600)"
    p = add(actions, "ingest", "persist groups into a Delta history table (a Spark streaming query)",
            _history("ingest"))
    p.add_argument("groups", metavar="GROUP", nargs="+", type=_named)
    p.add_argument("--table", required=True, metavar="PATH", help="the Delta history table")
    p.add_argument("--checkpoint", metavar="PATH", help="the query's checkpoint (default: PATH/_checkpoints/ingest)")
    p.add_argument("--starting-offsets", default="earliest", metavar="WHERE",
                   help="earliest (default), latest or per-publisher JSON, for a new checkpoint")
    p.add_argument("--trigger", metavar="INTERVAL", help="micro-batch interval (default 1 second)")
    p.add_argument("--available-now", action="store_true", help="ingest what is there now, then stop")
    p.add_argument("--delta-txn", action="store_true",
                   help="also use Delta's txnAppId/txnVersion on every batch (guards against two live runs of one "
                        "checkpoint; a state rebuild per batch)")
    p.add_argument("--max-per-trigger", type=int, metavar="N", help="at most N messages per micro-batch")
    p.add_argument("--history-key-file", metavar="FILE", help=key_help + ": store payloads sealed")
    p = add(actions, "replay", "print a group's history from Delta in causal order", _history("replay"))
    p.add_argument("group", metavar="GROUP", type=_named)
    p.add_argument("--table", required=True, metavar="PATH", help="the Delta history table")
    since = p.add_mutually_exclusive_group()
    since.add_argument("--since-version", type=int, metavar="V", help="rows committed at Delta version V or later")
    since.add_argument("--since-time", metavar="ISO", help="rows sent at or after this time (ISO 8601, UTC default)")
    since.add_argument("--since-lamport", type=int, metavar="N", help="rows with Lamport time >= N")
    p.add_argument("--as-of", metavar="V|ISO", help="time travel: the table at this version or time")
    p.add_argument("--limit", type=_count, default=100, metavar="N", help="at most N rows (default 100, 0: all)")
    p.add_argument("--verify", action="store_true", help="check every row's origin proof (adds a column)")
    p.add_argument("--history-key-file", metavar="FILE", help=key_help + ": open sealed payloads")
    p = add(actions, "compact", "OPTIMIZE the history table (merge small files)", _history("compact"))
    p.add_argument("--table", required=True, metavar="PATH", help="the Delta history table")
    p.add_argument("--group", metavar="GROUP", help="only this group's partitions")
    p = add(actions, "vacuum", "VACUUM the history table (delete files no retained version needs)",
            _history("vacuum"))
    p.add_argument("--table", required=True, metavar="PATH", help="the Delta history table")
    p.add_argument("--retain-hours", type=float, metavar="H",
                   help="keep files needed by versions of the last H hours (default: the table's 7 days)")
    p.add_argument("--dry-run", action="store_true", help="only count what would be deleted")


def _history(action: str) -> Callable[["Ctx"], int]:
    def run(ctx: "Ctx") -> int:
        # Spark and Delta load only for these actions; the job itself lives with the pipelines.
        from zerocomm_spark.pipelines import commands

        return commands.run(action, ctx)

    return run


def _with_history_action(argv: list[str]) -> list[str]:
    """`history GROUP ...` is `history show GROUP ...`: insert the default action when none is named."""
    i, command = 0, None
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv
        if token.startswith("-"):
            i += 2 if token in _VALUE_OPTIONS else 1
            continue
        if command is None:
            if token != "history":
                return argv
            command = i
            i += 1
            continue
        if token not in HISTORY_ACTIONS:
            return argv[:command + 1] + ["show"] + argv[command + 1:]
        return argv
    return argv


# --- plumbing ----------------------------------------------------------------------------------


class Ctx:
    """What every command needs: parsed options, the configuration, output mode, a client on demand."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.json: bool = bool(getattr(args, "json", False))
        # Finite is not enough: 1e308 seconds overflows the client's lock and poll waits.
        self.timeout: float = check_timeout(getattr(args, "timeout", 30.0), "--timeout")
        flags = list(getattr(args, "settings", None) or [])
        for option, name in (("identity_dir", "identity.dir"), ("label", "identity.label"),
                             ("socket_dir", "api.socket_dir"), ("endpoint", "peer.endpoint"),
                             ("log_level", "log.level")):
            value = getattr(args, option, None)
            if value is not None:
                if option in ("identity_dir", "socket_dir"):
                    value = str(Path(value).expanduser().absolute())
                flags.append(f"{name}={value}")
        self.config_path = getattr(args, "config", None)
        missing_ok = getattr(args, "command", None) == "init"
        self.config: Config = config_mod.load(self.config_path, flags=flags, missing_ok=missing_ok)
        if not (getattr(args, "agent_command", None) == "start" and not getattr(args, "detach", False)):
            for warning in self.config.warnings:  # a foreground agent logs them itself
                sys.stderr.write(f"zerocomm: warning: {warning}\n")
        self._client: Client | None = None

    def command(self, words: str) -> str:
        """``zerocomm <words>`` for this same agent: the --config file and the flags given, quoted to paste."""
        again = "".join(f" {option} {shlex.quote(value)}" for option, value in
                        ([("--config", str(self.config_path))] if self.config_path else [])
                        + [("--set", o) for o in self.config.overrides()])
        return f"zerocomm{again} {words}"

    def start_hint(self, hint: str | None = None) -> str:
        """What to run when no agent answers for this configuration: ``hint`` (by default "Start it with
        `zerocomm agent start --detach`") with that command spelt for this agent where it differs."""
        plain = "zerocomm agent start --detach"
        exact = self.command("agent start --detach")
        hint = hint or f"Start it with `{plain}`"
        if exact == plain or f"`{plain}`" not in hint:
            return hint
        return hint.replace(f"`{plain}`", f"`{plain}` (for this agent: `{exact}`)", 1)

    def client(self) -> Client:
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _connect(self) -> Client:
        """A client of this configuration's agent; with --spawn, started if none runs.

        An agent that holds the run directory but does not answer (hung, overloaded, starting or
        stopping) is not "no agent": starting one would be refused. And an agent another command
        is starting right now (it won the race to the identity) is waited for, not reported missing.
        """
        from zerocomm_spark.agent.runfiles import held_by, identity_in_use

        cfg = self.config
        began = time.monotonic()
        connect_timeout = min(self.timeout, 10.0)
        try:
            return Client.connect(cfg.socket_dir, timeout=connect_timeout, call_timeout=self.timeout)
        except errors.AgentNotRunningError:
            pass
        deadline = began + connect_timeout
        if held_by(cfg.socket_dir) is None:
            if not getattr(self.args, "spawn", False):
                from zerocomm_spark.agent.daemon import has_identity

                if not has_identity(cfg.identity_dir):  # --spawn starts only an existing member: init first
                    raise errors.AgentNotRunningError(
                        f"no agent is running for {cfg.identity_dir}, and it holds no identity yet",
                        hint="Create one with `zerocomm init --label NAME` (with this command's --config or "
                             "--identity-dir if you gave one), then "
                             + self.start_hint("start it with `zerocomm agent start --detach`"))
                raise errors.AgentNotRunningError(
                    f"no agent is running for {cfg.identity_dir}",
                    hint=f"{self.start_hint()}, or add --spawn")
            from zerocomm_spark.agent.daemon import start_detached

            try:
                start_detached(cfg, existing_identity=True)  # --spawn never creates a member
            except errors.AgentAlreadyRunningError:
                pass  # another command is starting it at this moment: wait for that one below
            deadline = time.monotonic() + cfg.get("agent", "start_timeout")
        while True:
            left = deadline - time.monotonic()
            try:
                return Client.connect(cfg.socket_dir, timeout=max(min(connect_timeout, left), 0.05),
                                      call_timeout=self.timeout)
            except errors.AgentNotRunningError:
                pass
            holder = held_by(cfg.socket_dir)
            if time.monotonic() >= deadline or (holder is None and not identity_in_use(cfg.identity_dir)):
                break
            time.sleep(0.1)
        return self._not_answering(holder)

    def _not_answering(self, holder: int | None) -> Client:
        from zerocomm_spark.agent.daemon import log_file_of
        from zerocomm_spark.agent.runfiles import read_health

        cfg = self.config
        if holder is None:  # whoever was starting it gave up or failed
            raise errors.AgentNotRunningError(
                f"no agent is running for {cfg.identity_dir}",
                hint=f"{self.start_hint()}; if that fails, its log is {log_file_of(cfg)}")
        who = f"pid {holder}" if holder > 0 else "pid unknown"
        if (read_health(cfg.socket_dir) or {}).get("state") == "stopping":
            raise errors.AgentNotRunningError(
                f"the agent for {cfg.identity_dir} ({who}) is stopping",
                hint="Wait until `zerocomm agent status` says no agent is running, then start it again")
        raise errors.ApiTimeoutError(
            f"an agent ({who}) runs for {cfg.identity_dir} but did not answer within {min(self.timeout, 10.0):g}s",
            hint=f"It may be hung or overloaded: `zerocomm agent status` shows its last heartbeat, its log is "
                 f"{log_file_of(cfg)}. Retry with a longer --timeout, or restart it (`zerocomm agent stop --force`, "
                 "then `zerocomm agent start --detach`)")

    def out(self, value: Any, human: str | Callable[[], str]) -> None:
        if self.json:
            emit_json(value)
        else:
            text = human() if callable(human) else human
            if text:
                print(text, flush=True)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


# --- commands: identity and agent --------------------------------------------------------------


def _running_identity(ctx: Ctx) -> dict[str, Any] | None:
    """The label and endpoint of the agent running on this identity (its status), or None if it does
    not answer or runs on another identity."""
    try:
        status = ctx.client().status(timeout=min(ctx.timeout, 10.0))
    except errors.ZeroCommError:
        return None
    named = status.get("identity_dir")
    if not isinstance(named, str) or not named or not _same_dir(Path(named), ctx.config.identity_dir):
        return None
    return {"label": status.get("label"), "endpoint": (status.get("endpoints") or {}).get("peer")}


def cmd_init(ctx: Ctx) -> int:
    from zerocomm_spark.journal import journal_key
    from zerocomm_spark.member import Agent

    cfg = ctx.config
    target = Path(ctx.config_path).expanduser() if ctx.config_path else config_mod.user_config_file()
    writing = not target.exists() or getattr(ctx.args, "force", False)
    if writing:  # a file that cannot be written must fail before the identity exists, not after
        _init_toml(cfg, str(cfg.label or cfg.identity_dir.name))
        blocker = not_a_directory(target.parent)
        if blocker is not None:
            raise errors.ConfigurationError(
                f"the configuration file {target} cannot be written: {blocker} {what_is(blocker)}",
                hint="Give --config (or ZEROCOMM_CONFIG) a path in a directory, or one whose directories do not "
                     "exist yet (they are created); nothing was created")
    else:  # the kept file must name this identity, or every command after (and the printed one) runs another
        # What the file names, every other setting as in force (so a bad value in it that a variable or
        # flag overrides is no error here either, as it was none for ctx.config).
        kept = config_mod.load(str(target), env={k: v for k, v in os.environ.items() if k != "ZEROCOMM_IDENTITY_DIR"},
                               flags=[f for f in cfg.overrides() if not f.startswith("identity.dir=")]).identity_dir
        if cfg.source.get("identity.dir") == "flag" and not _same_dir(kept, cfg.identity_dir):
            raise errors.ConfigurationError(
                f"the configuration file {target} belongs to the identity in {kept}, not {cfg.identity_dir}; "
                "init kept it, so `zerocomm agent start` would start that other member",
                hint=f"Give this member a file of its own: zerocomm --config PATH init --identity-dir "
                     f"{shlex.quote(str(cfg.identity_dir))} (then --config PATH on its commands), or --force "
                     f"to point {target} at it")
    existing = (cfg.identity_dir / "keystore.sealed").exists()
    running = False
    if existing:
        # Only the keystore: opening the member would rejoin its groups, and messages delivered
        # (and acknowledged) now would never reach the journal, which only the agent process keeps.
        from zerocomm_spark.keys.keystore import Keystore
        from zerocomm_spark.member import SETTINGS_ID, SETTINGS_KIND

        try:
            with Keystore.open(cfg.identity_dir, cfg.passphrase()) as keystore:
                journal_key(keystore)
                settings = keystore.get_record(SETTINGS_KIND, SETTINGS_ID) or {}
        except errors.AgentAlreadyRunningError:
            # Its agent runs (and holds the keystore): the identity and its journal key exist; what
            # init reports comes from the agent, not a refusal to "stop the other agent".
            settings = _running_identity(ctx)
            if settings is None:
                raise
            Keystore.check_passphrase(cfg.identity_dir, cfg.passphrase())  # as open() would have
            running = True
        label = str(settings.get("label") or cfg.label or cfg.identity_dir.name)
        if cfg.label and cfg.label != label and cfg.source.get("identity.label") == "flag":
            # A second `init --label bob` found alice's identity and said "found the identity 'alice'",
            # exit 0: no new member, and the label asked for was dropped.
            raise errors.ConfigurationError(
                f"{cfg.identity_dir} already holds the identity {label!r}; init makes no second member "
                f"{cfg.label!r} in it",
                hint=f"For another member, give it its own directory and file: zerocomm --config PATH init "
                     f"--identity-dir DIR --label {shlex.quote(cfg.label)} (then --config PATH on its commands); "
                     f"to rename this one, set identity.label in {target}")
        endpoint = str(settings.get("advertise") or settings.get("endpoint") or "")
    else:
        agent = Agent.open(cfg.identity_dir, label=cfg.label, endpoint=cfg.get("peer", "endpoint"),
                           passphrase=cfg.passphrase(), advertise=cfg.get("peer", "advertise") or None)
        try:
            keystore = agent.keystore
            journal_key(keystore)
            label, endpoint = agent.label, agent.endpoint
        finally:
            agent.close()
    wrote = False
    if writing:
        data = _init_toml(cfg, label)
        try:
            make_dirs(target.parent)
            # Private from its creation (a write then a chmod left it readable by others meanwhile), and
            # never through a link someone planted in its place.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_TRUNC
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        except OSError as exc:
            raise errors.ConfigurationError(
                f"the identity in {cfg.identity_dir} is ready, but the configuration file {target} cannot be written: "
                f"{exc.strerror or exc}",
                hint="Run init again with a --config PATH this user can write (the identity is kept)") from None
        wrote = True
    result = {"label": label, "identity_dir": str(cfg.identity_dir), "created": not existing,
              "peer_endpoint": endpoint, "config_file": str(target), "config_written": wrote,
              "socket_dir": str(cfg.socket_dir), "agent_running": running}
    command = f"zerocomm{'' if not ctx.config_path else ' --config ' + shlex.quote(str(target))}"
    ctx.out(result, lambda: "\n".join([
        f"{'created' if not existing else 'found'} the identity {label!r} in {cfg.identity_dir}",
        f"{'wrote' if wrote else 'kept the existing'} configuration {target}"
        + ("" if wrote else " (--force to overwrite)"),
        f"its agent is running ({command} agent status)" if running else f"next: {command} agent start --detach",
    ]))
    return EXIT_OK


def _same_dir(a: Path, b: Path) -> bool:
    """Whether two absolute paths name one directory: written differently (``d/../d``, a symlink, a
    bind mount) they are still the same identity, which init must not refuse as another member's."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare what they resolve to
        return a.resolve() == b.resolve()


def _init_toml(cfg: Config, label: str) -> bytes:
    """The configuration file init writes, as UTF-8 (TOML is UTF-8): a path or label with undecodable
    bytes cannot go in it, which is said before the identity is created, naming the setting."""
    values = {s: dict(v) for s, v in cfg.values.items()}
    values["identity"]["dir"] = str(cfg.identity_dir)
    values["identity"]["label"] = label
    for section, key in config_mod._PATH_SETTINGS:  # noqa: SLF001 - meant from here, relative to the file once written
        value = values[section][key]
        if value and not os.path.isabs(os.path.expanduser(value)):
            values[section][key] = str(Path(value).absolute())
    for section, settings in values.items():
        for key, value in settings.items():
            if isinstance(value, str) and not is_utf8_text(value):
                raise errors.ConfigurationError(
                    f"{section}.{key} is {value!r}, which is not UTF-8 text and cannot be written to the TOML "
                    "configuration file", hint=f"Give {section}.{key} a path or name in UTF-8 (nothing was created)")
    return config_mod.render_toml(values).encode("utf-8")


def cmd_agent_start(ctx: Ctx) -> int:
    from zerocomm_spark.agent.daemon import run_foreground, start_detached

    if getattr(ctx.args, "detach", False):
        # The same file and flags (--identity-dir, --socket-dir...: the agent they name), quoted to paste as is.
        stop = ctx.command("agent stop")
        health = start_detached(ctx.config, timeout=getattr(ctx.args, "timeout", None),
                                existing_identity=ctx.args.existing_identity)
        ctx.out(health, lambda: f"agent {health.get('label')!r} running in the background (pid {health.get('pid')})\n"
                                f"  API  {health.get('endpoints', {}).get('api')}\n"
                                f"  log  {health.get('log_file')}\n"
                                f"stop it with: {stop}")
        return EXIT_OK

    def ready(health: dict[str, Any]) -> None:
        if ctx.json:
            emit_json(health)
        elif sys.stderr.isatty():
            sys.stderr.write(f"agent {health.get('label')!r} running (pid {health.get('pid')}), API "
                             f"{health.get('endpoints', {}).get('api')}; Ctrl-C to stop\n")

    try:
        code = run_foreground(ctx.config, ready_fd=ctx.args.ready_fd, run_lock_fd=ctx.args.run_lock_fd,
                              on_ready=ready)
    except ZeroCommError as exc:
        code = _report_error(exc, ctx.json)
    # Everything durable is closed by now. Exit at once: the interpreter would otherwise join
    # worker threads still parked in network waits (pings, resumes) for seconds.
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def cmd_agent_stop(ctx: Ctx) -> int:
    from zerocomm_spark.agent.daemon import stop_agent

    result = stop_agent(ctx.config, timeout=getattr(ctx.args, "timeout", None), force=ctx.args.force)
    ctx.out(result, f"stopped the agent (pid {result['pid']}) in {result['seconds']:.1f}s"
                    + (" by killing it" if result["forced"] else ""))
    return EXIT_OK


def cmd_agent_status(ctx: Ctx) -> int:
    from zerocomm_spark.agent.daemon import agent_status

    try:
        status = agent_status(ctx.config, timeout=min(ctx.timeout, 5.0))
    except errors.AgentNotRunningError as exc:
        # (status's own advice, a failure to fix first or an identity to create, with the command spelt out)
        raise errors.AgentNotRunningError(exc.message, hint=ctx.start_hint(exc.hint)) from None
    endpoints = status.get("endpoints") or {}
    journal = status.get("journal") or {}

    def human() -> str:
        pairs = [("state", status.get("state", "running") if status.get("responding") else "not responding"),
                 ("label", status.get("label")), ("pid", status.get("pid")),
                 ("uptime", f"{status['uptime_s']:.0f}s" if "uptime_s" in status else None),
                 ("identity", status.get("identity_dir")), ("api", endpoints.get("api")),
                 ("api tcp", endpoints.get("api_tcp")), ("api key", endpoints.get("api_public_key")),
                 ("peer", endpoints.get("peer")), ("group", endpoints.get("group")),
                 ("groups", ", ".join(status.get("groups") or []) or "(none)"),
                 ("journal", f"offsets {journal.get('earliest_offset')}..{journal.get('next_offset')}, "
                             f"committed {journal.get('committed_offset')}" if journal else None),
                 ("heartbeat", f"{status.get('heartbeat_age_s', 0):.1f}s ago"), ("log", status.get("log_file"))]
        fds = status.get("fds") or {}
        if fds.get("open") is not None:
            pairs.insert(-2, ("descriptors", f"{fds['open']} open of {fds.get('limit') or 'unlimited'}"))
        if status.get("problem"):
            pairs.append(("problem", status["problem"]))
        return render_pairs((k, v) for k, v in pairs if v is not None)

    ctx.out(status, human)
    return EXIT_OK if status.get("responding") else EXIT_ERROR


# --- commands: connections ---------------------------------------------------------------------


def cmd_invite(ctx: Ctx) -> int:
    url = ctx.client().invite(label=ctx.args.invite_label, multi_use=ctx.args.multi_use, group=ctx.args.group)
    ctx.out({"url": url}, url)
    return EXIT_OK


def _read_stdin(what: str, *, first_line: bool) -> str:
    """``what`` from stdin, for an argument given as ``-``: all of it less one final newline (``\n``
    or ``\r\n``), or its first line that is not blank (``first_line``). Refused if empty or not UTF-8."""
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")  # a bad byte is then told below, not as a codec error
    data = sys.stdin.read(_MAX_STDIN_TEXT + 1)
    if len(data) > _MAX_STDIN_TEXT:
        raise errors.BadRequestError(f"stdin holds more than {_MAX_STDIN_TEXT} characters for the {what}",
                                     hint="Send a shorter text (a basic message is for short notes); large data "
                                          "goes to a group (`zerocomm send GROUP TEXT`)")
    text = next((line.strip() for line in data.splitlines() if line.strip()), "") if first_line \
        else data.removesuffix("\n").removesuffix("\r")
    if not text:
        raise errors.ConfigurationError(f"stdin holds no {what}", hint=f"Pipe the {what} in, or give it in place of -")
    if not is_utf8_text(text):
        raise errors.BadRequestError(f"the {what} read from stdin is not UTF-8 text",
                                     hint="Send text; encode binary data first (for example with base64)")
    return text


#: `message PEER -` and `connect -` read at most this much of stdin (a DIDComm basic message is small).
_MAX_STDIN_TEXT = 1 << 20


def cmd_connect(ctx: Ctx) -> int:
    url = _read_stdin("invitation URL", first_line=True) if ctx.args.url == "-" else ctx.args.url
    if not url.strip():  # `zerocomm connect "$URL"` with the variable unset: said as such, before any agent
        raise errors.ConfigurationError(
            "the invitation URL is empty",
            hint="Give the URL `zerocomm invite` printed on the inviting member (quoted), or - to read it from stdin")
    with Progress("connecting", enabled=None if not ctx.json else False):
        connection = ctx.client().accept(url, timeout=ctx.timeout)
    ctx.out(connection, f"connected to {connection.get('label')!r} (connection {connection.get('id')})")
    return EXIT_OK


def cmd_connections(ctx: Ctx) -> int:
    rows = ctx.client().connections(include_incomplete=True)
    ctx.out(rows, lambda: render_table(rows, [("id", "ID"), ("label", "LABEL"), ("state", "STATE"), ("role", "ROLE"),
                                              ("endpoint", "ENDPOINT"), ("created_at", "CREATED")]))
    return EXIT_OK


def cmd_message(ctx: Ctx) -> int:
    text = _read_stdin("message text", first_line=False) if ctx.args.text == "-" else ctx.args.text
    message_id = ctx.client().send(ctx.args.peer, text)
    ctx.out({"message_id": message_id}, f"delivered {message_id}")
    return EXIT_OK


def cmd_inbox(ctx: Ctx) -> int:
    rows = ctx.client().messages(ctx.args.peer)
    ctx.out(rows, lambda: render_table(rows, [("received_time", "RECEIVED"), ("label", "FROM"), ("content", "MESSAGE")]))
    return EXIT_OK


# --- commands: groups --------------------------------------------------------------------------


def cmd_group_create(ctx: Ctx) -> int:
    a = ctx.args
    info = ctx.client().create(a.group, mode=a.mode, ordered=a.ordered, consistent_join=a.consistent_join, role=a.role)
    ctx.out(info, f"created group {a.group!r}")
    return EXIT_OK


def cmd_group_join(ctx: Ctx) -> int:
    a = ctx.args
    with Progress(f"joining {a.group}", enabled=None if not ctx.json else False) as progress:
        info = ctx.client().join(a.group, via=a.via, role=a.role, timeout=ctx.timeout, progress=progress.update)
    members = info.get("members") if isinstance(info, dict) else None
    count = f" ({len(members)} members)" if isinstance(members, list) else ""
    ctx.out(info, f"joined group {a.group!r}{count}")
    return EXIT_OK


def cmd_group_leave(ctx: Ctx) -> int:
    result = ctx.client().leave(ctx.args.group)
    ctx.out(result, f"left group {ctx.args.group!r}")
    return EXIT_OK


def _member_rows(members: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for m in members:
        row = dict(m)
        row["did_short"] = short_did(m.get("did"), 40)
        row["you"] = "(you)" if m.get("is_self") else ""
        rows.append(row)
    return rows


def cmd_group_info(ctx: Ctx) -> int:
    info = ctx.client().info(ctx.args.group)

    def human() -> str:
        simple = [(k, v) for k, v in info.items() if not isinstance(v, (list, dict))]
        text = render_pairs(simple)
        members = info.get("members")
        if isinstance(members, list):
            text += "\n\n" + _members_table(members)
        return text

    ctx.out(info, human)
    return EXIT_OK


def _members_table(members: list[dict[str, Any]]) -> str:
    return render_table(_member_rows(members), [("label", "LABEL"), ("role", "ROLE"), ("status", "STATUS"),
                                                ("you", ""), ("did_short", "DID")])


def cmd_group_members(ctx: Ctx) -> int:
    members = ctx.client().members(ctx.args.group)
    ctx.out(members, lambda: _members_table(members))
    return EXIT_OK


def cmd_group_list(ctx: Ctx) -> int:
    rows = ctx.client().groups()
    ctx.out(rows, lambda: render_table(rows, [("group", "GROUP"), ("mode", "MODE"), ("role", "ROLE"),
                                              ("member_count", "MEMBERS")]))
    return EXIT_OK


def cmd_group_role(ctx: Ctx) -> int:
    result = ctx.client().switch_role(ctx.args.group, ctx.args.role)
    ctx.out(result, f"now {ctx.args.role} in group {ctx.args.group!r}")
    return EXIT_OK


# --- commands: messages and the journal --------------------------------------------------------


#: `send -` publishes stdin in calls of at most this many lines or bytes: a large file fits no single
#: request (api.max_request_bytes), and memory holds one chunk, not the file.
_SEND_CHUNK_LINES = 10_000
_SEND_CHUNK_BYTES = 1 << 20
#: ...and sooner when stdin is slow (a producer writing now and then: a log, a sensor): lines read go
#: out once no more came for _SEND_PAUSE_S, or _SEND_MAX_WAIT_S after the first of them, so a line is
#: not held until thousands more come or stdin ends (and an `agent stop` meanwhile then lost track of it).
_SEND_PAUSE_S = 0.2
_SEND_MAX_WAIT_S = 1.0
_IDLE = object()  # from _stdin_lines: the lines read so far should go out now


def _stdin_lines(pause: float = _SEND_PAUSE_S, max_wait: float = _SEND_MAX_WAIT_S) -> Iterator[Any]:
    """The lines of stdin as ``for line in sys.stdin`` gives them (decoded as it would, with
    surrogateescape, ending at ``\n`` only), and ``_IDLE`` once lines were given and stdin has had no
    complete line for ``pause`` seconds, or ``max_wait`` seconds passed since the first of them.

    Read from the descriptor with select(2), not through sys.stdin, whose read-ahead hides whether more
    is ready. A stdin that is no file (replaced in-process) is iterated as it is, without ``_IDLE``."""
    stream = sys.stdin
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a StringIO
        yield from stream
        return
    decoder = codecs.getincrementaldecoder(getattr(stream, "encoding", None) or "utf-8")(errors="surrogateescape")
    partial: list[str] = []  # the line being read, in pieces (a long line is not re-scanned per read)
    first_at: float | None = None  # when the first line given since the last _IDLE was given
    while True:
        if first_at is not None:  # lines given: wait for more only as long as they may wait
            timeout = max(0.0, min(pause, first_at + max_wait - time.monotonic()))
            if timeout == 0.0 or not select.select([fd], [], [], timeout)[0]:
                first_at = None
                yield _IDLE
                continue
        # Nothing waiting to go out: a plain blocking read, as long as stdin takes (Ctrl-C ends it).
        data = os.read(fd, 1 << 16)
        text = decoder.decode(data, final=not data)
        pieces = text.split("\n")
        for i, piece in enumerate(pieces[:-1]):
            line = ("".join(partial) + piece if i == 0 and partial else piece) + "\n"
            if i == 0:
                partial = []
            if first_at is None:
                first_at = time.monotonic()
            yield line
        if len(pieces) > 1:
            partial = [pieces[-1]] if pieces[-1] else []
        elif pieces[0]:
            partial.append(pieces[0])
        if not data:
            if partial:
                yield "".join(partial)
            return


def line_id(prefix: str, group: str, number: int, text: str) -> str:
    """The message id `send -` gives line ``number`` (from 1) of stdin: the same for the same prefix,
    group, line number and text, so sending the same input again with the same prefix is a duplicate
    (dropped) line for line; a line whose text changed is a new message. The group is hashed in: the
    journal's id rule spans groups, and the same file sent to two groups must reach both."""
    digest = hashlib.sha256(group.encode("utf-8") + b"\0" + text.encode("utf-8")).hexdigest()[:16]
    return f"{prefix}-{number}-{digest}"


def _bad_line(exc: ZeroCommError, number: int) -> ZeroCommError:
    """``exc`` marked as about line ``number`` of stdin, which cannot be sent as it is: sending the
    same input again would stop at it again, so the resume a `send -` names is on an edited input."""
    exc.stdin_line = number  # type: ignore[attr-defined]
    return exc


def _too_large(number: int, size: int, limit: int) -> errors.FrameTooLargeError:
    return errors.FrameTooLargeError(
        f"line {number} of stdin is {size} bytes, more than the agent publishes as one message "
        f"(max_message_bytes={limit})",
        hint=f"Split line {number} into lines of at most {limit} bytes, or remove it")


def _line_text(line: str) -> str:
    """A line of stdin less its line ending, ``\n`` or ``\r\n`` (a file written on Windows): the
    text sent and hashed into its id, the same in every run. Only the final ``\r`` before the ``\n``
    is an ending; a ``\r`` elsewhere is the line's own."""
    if line.endswith("\n"):
        line = line[:-1]
        if line.endswith("\r"):
            line = line[:-1]
    return line


def _stdin_chunks(request_bytes: Callable[[], int], group: str, prefix: str, skip: int,
                  message_bytes: Callable[[], int | None] = lambda: None) -> Iterator[tuple[list[str], list[str]]]:
    """Lines of stdin and their message ids (see line_id), in chunks of at most half the agent's
    request limit (in UTF-8 bytes, as sent), asked for at the first line; the first ``skip`` lines
    are read past. A line larger than ``message_bytes()`` (the agent's largest message) ends the
    lines: those before it are yielded first, so they go out, then the error names it (the agent
    refused a whole chunk for one line, naming none). A line that is not text is refused with its chunk."""
    chunk: list[str] = []
    ids: list[str] = []
    size = 0
    limit = None
    largest: int | None = None
    # Decoded leniently whatever the locale (strict under en_US.UTF-8 and the like): a line that is not
    # UTF-8 is then told by its number below, as a ZeroCommError (it says how many lines went out).
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="surrogateescape")
    number = 0
    for line in _stdin_lines():
        if line is _IDLE:  # stdin paused: what was read goes out now, not when more comes
            if chunk:
                yield chunk, ids
                chunk, ids, size = [], [], 0
            continue
        number += 1
        if number <= skip:
            continue
        if limit is None:
            limit = min(_SEND_CHUNK_BYTES, max(request_bytes() // 2, 1))
            largest = message_bytes()
        text = _line_text(line)
        if not is_utf8_text(text):  # stdin decodes with surrogateescape: binary input would fail mid-send
            # (Refused with its chunk, as before: binary input is most often binary from its first chunk.)
            held = (f" (nor were lines {number - len(chunk)}..{number - 1}, read with it and not sent)"
                    if len(chunk) > 1 else f" (nor was line {number - 1}, read with it and not sent)" if chunk else "")
            raise _bad_line(errors.BadRequestError(
                f"line {number} of stdin is not UTF-8 text{held}",
                hint=f"Encode binary data first (for example with base64), or remove line {number}"), number)
        encoded = len(text.encode("utf-8", "surrogateescape"))
        if largest is not None and encoded > largest:
            if chunk:
                yield chunk, ids
                chunk, ids, size = [], [], 0
            raise _bad_line(_too_large(number, encoded, largest), number)
        mid = line_id(prefix, group, number, text)
        cost = encoded + len(mid) + 32
        if chunk and size + cost > limit:
            yield chunk, ids
            chunk, ids, size = [], [], 0
        chunk.append(text)
        ids.append(mid)
        size += cost
        if len(chunk) >= _SEND_CHUNK_LINES:
            yield chunk, ids
            chunk, ids, size = [], [], 0
    if chunk:
        yield chunk, ids


#: Errors of a publish call that sent nothing of its chunk: refusals before the group had it. Not
#: AgentNotRunningError (also "the agent stopped before it answered": the outcome is unknown) nor
#: GroupError as such (a group or data plane closed before every member acked, retention dropping
#: messages some members lacked): raised once the chunk was out to some members, perhaps.
_SENT_NOTHING = (errors.BadRequestError, errors.AgentBusyError, errors.ApiPermissionError, errors.ConfigurationError,
                 errors.ClientClosedError, errors.BackpressureError, errors.GroupNotFoundError,
                 errors.GroupNotOpenError, errors.NotAMemberError, errors.ReadOnlyMemberError,
                 errors.InvalidGroupNameError, errors.FrameTooLargeError)


def _say_how_to_send_the_rest(exc: ZeroCommError, a: argparse.Namespace, prefix: str, *, acked: int,
                              in_flight: int) -> None:
    """Make ``exc`` (a `send -` that stopped part way) say how far it got and the command that sends
    the rest exactly once: the same input, the same id prefix, the acknowledged lines skipped. The
    lines in flight (perhaps out, kept for members that did not acknowledge them) are sent again
    under their ids, which members drop if they have them; skipping only what was acknowledged keeps
    that re-send within the ids the agent and the journals remember (a large input's first lines
    may be out of their window)."""
    # A refusal sent nothing of the chunk it refused (a busy agent, backpressure, a bad line or group):
    # with nothing acknowledged before, the same command as it was is right, and the error says why.
    maybe_out = in_flight and not isinstance(exc, _SENT_NOTHING)
    if not (acked or maybe_out):
        return
    done = a.skip + acked  # lines of stdin acknowledged, by earlier runs (--skip) and this one
    text = exc.message
    if acked:  # earlier chunks went out: say how far, so the rest can be sent again
        text += f" (the first {done} line(s) of stdin were sent and acknowledged"
        text += f", {acked} by this run)" if a.skip else ")"
    if maybe_out:
        lines = f"line {done + 1}" if in_flight == 1 else f"lines {done + 1}..{done + in_flight}"
        text += (f"; {lines} may be out, kept for the members that did not acknowledge them"
                 if isinstance(exc, errors.PeerTimeoutError) else f"; {lines} may be out (the outcome is unknown)")
    options = f"--id-prefix {prefix}" + (f" --skip {done}" if done else "")
    given = " (in place of yours)" if a.id_prefix or a.skip else ""
    # What --json's error document carries besides the text (as an interrupted send's does): a script
    # resumes from these fields, not by parsing the hint.
    exc.json_facts = {
        "group": a.group, "id_prefix": prefix, "acknowledged_lines": done, "acknowledged_by_this_run": acked,
        "in_flight_lines": [done + 1, done + in_flight] if maybe_out else None,
        "resume_options": ["--id-prefix", prefix] + (["--skip", str(done)] if done else [])}
    bad = getattr(exc, "stdin_line", None)
    if bad is not None:  # the same input would stop at the same line: the rest goes from an edited input
        hint = (f"{exc.hint}; then, to send the rest exactly once, run the same command on the edited input with "
                f"{options}{given}: the first {done} line(s) are read past, and line {done + 1} and those after "
                "it were not sent")
        exc.hint = hint
        exc.args = (f"{text}. {hint}",)
        return
    resume = (f"To send the rest exactly once, run the same command on the same input with {options}{given}: "
              f"line N has the id {prefix}-N-HASH (HASH of the group and the line's text) in every run with this "
              "prefix, so a line a member has already is dropped, not delivered twice")
    if isinstance(exc, errors.PeerTimeoutError):
        resume += (f"; `zerocomm group members {shlex.quote(a.group)}` shows who did not acknowledge (inactive), "
                   "and the command waits for them again")
    hint = f"{exc.hint}. {resume}" if exc.hint and not isinstance(exc, (errors.PeerTimeoutError,
                                                                         errors.ApiTimeoutError)) else resume
    exc.hint = hint
    exc.args = (f"{text}. {hint}",)


def _max_message_bytes(client: Client) -> int | None:
    """The largest payload the agent publishes as one message, as it said when the client connected."""
    value = (getattr(client, "agent", None) or {}).get("max_message_bytes")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _name_the_large_line(exc: errors.FrameTooLargeError, lines: list[str], first: int) -> None:
    """For a chunk the agent refused whole for a payload too large (a limit its status did not give,
    such as the room an origin proof takes): name the largest line of the chunk, which is the one."""
    sizes = [len(line.encode("utf-8", "surrogateescape")) for line in lines]
    index = max(range(len(sizes)), key=sizes.__getitem__)
    number = first + index
    span = f"lines {first}..{first + len(lines) - 1}" if len(lines) > 1 else f"line {first}"
    text = (f"{exc.message} (line {number} of stdin, {sizes[index]} bytes, the largest of {span}; the agent "
            "refused them whole, so none of them was sent)")
    exc.hint = f"Split line {number} into smaller lines, or remove it"
    exc.args = (f"{text}. {exc.hint}",)
    _bad_line(exc, number)


def _say_interrupted(ctx: Ctx, prefix: str, *, message_ids: list[str], seqs: list[int], in_flight: int) -> None:
    """For a `send -` stopped by Ctrl-C: how far it got and the options that send the rest exactly
    once, as a send that failed part way says them (a long send is often interrupted). On stderr; with
    --json also as a JSON document on stdout (the error shape, exit code 130, and the same facts)."""
    a = ctx.args
    acked = len(message_ids)
    said = errors.ZeroCommError("interrupted (Ctrl-C)")
    _say_how_to_send_the_rest(said, a, prefix, acked=acked, in_flight=in_flight)
    hint = said.hint or ("No line of stdin was sent: the same command sends them all" if not a.skip else
                         f"No line of stdin was sent by this run: the same command (--skip {a.skip}) sends the rest")
    done = a.skip + acked
    resume = ["--id-prefix", prefix] + (["--skip", str(done)] if done else [])
    _say_interrupted_send(ctx, said.message, hint, {
        "group": a.group, "id_prefix": prefix, "message_ids": message_ids, "seqs": seqs,
        # lines of stdin acknowledged (by earlier runs, --skip, and this one): what a resume skips
        "acknowledged_lines": done, "acknowledged_by_this_run": acked,
        # lines sent but not acknowledged when interrupted: they may be out (the outcome is unknown)
        "in_flight_lines": [done + 1, done + in_flight] if in_flight else None,
        "resume_options": resume})


def _say_single_interrupted(ctx: Ctx, message_id: str, *, called: bool, seq: int | None) -> None:
    """For a `send GROUP TEXT` stopped by Ctrl-C: its message id, whether it went out (unknown once the
    publish call was made and not answered), and how to send it exactly once: with --id, whose id a
    member drops if it has it already. On stderr; with --json also a JSON document on stdout."""
    a = ctx.args
    again = (f"run the same command{'' if a.message_id else f' with --id {shlex.quote(message_id)}'}: a member "
             "drops an id it already has, so nothing arrives twice")
    if seq is not None:
        outcome = "acknowledged"
        message = (f"interrupted (Ctrl-C) after message id {message_id} was sent to {a.group!r} (seq {seq}) and every "
                   "member acknowledged it")
        hint = "Nothing to send again; to be sure, " + again
    elif called:
        outcome = "unknown"
        message = (f"interrupted (Ctrl-C) while sending message id {message_id} to {a.group!r}: its outcome is "
                   "unknown (some or every member may have it, or none)")
        hint = f"To send it exactly once, {again}"
    else:
        outcome = "not sent"
        message = f"interrupted (Ctrl-C) before message id {message_id} was sent to {a.group!r}: nothing was sent"
        hint = f"To send it, {again}"
    _say_interrupted_send(ctx, message, hint, {
        "group": a.group, "message_id": message_id, "outcome": outcome, "seq": seq,
        "resume_options": ["--id", message_id]})


def _say_interrupted_send(ctx: Ctx, message: str, hint: str, facts: dict[str, Any]) -> None:
    """What an interrupted send says: on stderr always (a person at the terminal), and under --json as
    an error document on stdout with ``facts`` (a script gets something to parse: what went out, how to
    resume). The command then exits 130, as any interrupted command."""
    if ctx.json:
        emit_json({"ok": False, "error": {"type": "KeyboardInterrupt", "message": message, "hint": hint},
                   "exit_code": EXIT_INTERRUPTED, **facts})
    sys.stderr.write(f"zerocomm: {printable(message, keep=chr(10))}\n"
                     f"  what to do: {printable(hint, keep=chr(10))}\n")
    sys.stderr.flush()


def cmd_send(ctx: Ctx) -> int:
    a = ctx.args
    prefix = None
    if a.message == "-":
        if a.message_id:  # one id for many lines would publish the first and drop the rest as its duplicates
            raise errors.ConfigurationError("--id names one message; it cannot go with - (lines from stdin)",
                                            hint="Give --id-prefix PREFIX instead (line N then gets the id "
                                                 "PREFIX-N-HASH), or leave --id out")
        # Every line's id is made here, from one prefix, so that a send that stops part way (a member
        # not acknowledging in time) can say how to send the rest: the same input again with the same
        # prefix gives the same ids (what went out is dropped as duplicates), from the line it names.
        prefix = a.id_prefix or uuid.uuid4().hex[:16]
        chunks: Iterator[tuple[list[str], list[str]]] = _stdin_chunks(
            lambda: ctx.client().max_request_bytes, a.group, prefix, a.skip,
            lambda: _max_message_bytes(ctx.client()))
    else:
        if a.id_prefix or a.skip:
            raise errors.ConfigurationError("--id-prefix and --skip go with - (lines from stdin)",
                                            hint="Give one message's id with --id")
        # The id is made here, not by the agent, so that a send that times out can say which id to
        # send again with: without it a retry was a second message.
        single_id = a.message_id or uuid.uuid4().hex
        chunks = iter([([a.message], [single_id])])
    message_ids: list[str] = []
    seqs: list[int] = []
    sending: list[str] = []  # the lines of the chunk in flight
    duplicates = signed = unknown = 0
    journaled = True
    in_flight = 0
    calling = False  # the publish call was made (its outcome may be unknown), not only the connect
    interrupted = False
    with Progress(f"sending to {a.group}", enabled=None if not ctx.json and a.message == "-" else False) as progress:
        try:  # reading stdin fails too (a line that is not text): both say how far the sending got
            for lines, ids in chunks:
                in_flight, sending = len(lines), lines
                client = ctx.client()
                calling = True
                result = client.publish(a.group, lines, message_ids=ids, timeout=ctx.timeout, sign=a.sign)
                in_flight = 0
                message_ids += result.message_ids
                seqs += result.seqs
                duplicates += result.duplicates
                signed += result.signed
                unknown += result.signed_unknown
                journaled = journaled and bool(result.journaled)
                progress.update({"phase": f"{len(message_ids)} line(s) acknowledged"})
        except ZeroCommError as exc:
            if prefix is not None:
                if isinstance(exc, errors.FrameTooLargeError) and in_flight and getattr(exc, "stdin_line", None) is None:
                    _name_the_large_line(exc, sending, a.skip + len(message_ids) + 1)
                _say_how_to_send_the_rest(exc, a, prefix, acked=len(message_ids), in_flight=in_flight)
            elif not isinstance(exc, _SENT_NOTHING) and (calling or not isinstance(exc, errors.AgentNotRunningError)):
                # (No agent found by the connect sent nothing either: said plainly. One that stopped
                # during the call, before it answered, may have sent it.)
                # Members down (not acked in time), the agent slow or gone before it answered, the group
                # closed before every member acked (the outcome unknown): the message may be out, kept
                # for whoever did not ack it. The hint said stats()['lag'] (Python) and "wait again",
                # which a command cannot; its id makes the retry safe. (A refusal such as a
                # BackpressureError sent nothing: sending it again as it was is right.)
                mid = single_id
                text = f"{exc.message} (message id {mid})"
                again = (f"send it with --id {shlex.quote(mid)}: a member drops an id it already has, so nothing "
                         "arrives twice")
                if isinstance(exc, errors.PeerTimeoutError):
                    exc.hint = (f"It stays buffered for the members that did not acknowledge it (`zerocomm group "
                                f"members {shlex.quote(a.group)}` shows who is inactive); to wait for them again, "
                                f"{again}")
                elif isinstance(exc, errors.ApiTimeoutError):
                    exc.hint = f"The agent may still publish it; to find out, or to publish it if it did not, {again}"
                else:
                    exc.hint = (f"{exc.hint + '. ' if exc.hint else ''}Some members may have it; to publish it to "
                                f"the rest, {again}")
                exc.args = (f"{text}. {exc.hint}",)
            raise
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:  # said once the progress line is cleared
        if prefix is not None:
            _say_interrupted(ctx, prefix, message_ids=message_ids, seqs=seqs, in_flight=in_flight if calling else 0)
        else:
            _say_single_interrupted(ctx, single_id, called=calling and in_flight > 0,
                                    seq=seqs[0] if message_ids and seqs else None)
        raise KeyboardInterrupt  # exit 130, as any command interrupted
    if not message_ids and a.skip:
        raise errors.ConfigurationError(f"stdin had no lines after the first {a.skip} (--skip {a.skip}); nothing "
                                        "was sent",
                                        hint="--skip is the number of lines acknowledged before (a send that "
                                             "stopped part way names it): check it and the input")
    if not message_ids:
        raise errors.ConfigurationError("stdin had no lines to send",
                                        hint="Pipe the lines into `zerocomm send GROUP -`, or give the text in place of -")
    # "signed": every message, as the group keeps it, has the proof; a duplicate keeps how it went out
    # the first time, which the agent knows only for what it published since it last started.
    value = {"group": a.group, "message_ids": message_ids, "seqs": seqs, "duplicates": duplicates,
             "journaled": journaled, "signed": signed == len(message_ids), "signed_count": signed,
             "signed_unknown": unknown}
    if prefix is not None:
        value["id_prefix"] = prefix
    proof = ", signed" if signed == len(message_ids) else ""
    without = len(message_ids) - signed - unknown
    why = ("the group had them already: sent before the agent last started, or by another member" if journaled else
           "this member's journal has not taken them yet")
    if len(message_ids) == 1:
        human = f"sent {message_ids[0]} (seq {seqs[0]}) to {a.group!r}{proof}; every member has it"
        if duplicates:
            human += " (already sent before" + (" the agent last started, or by another member: whether with a proof "
                                                "is not known)"
                                                if a.sign and unknown else ", without a proof)"
                                                if a.sign and not signed else ")")
        elif a.sign and unknown:
            human += f" (whether with a proof is not known: {why.replace('them', 'it')})"
    else:
        human = f"sent {len(message_ids)} messages (seqs {seqs[0]}..{seqs[-1]}) to {a.group!r}{proof}"
        if a.sign and without:
            human += (f"; {without} of them were sent before without a proof "
                      "and were not sent again (a proof needs new message ids)")
        if a.sign and unknown:
            human += f"; whether {unknown} of them have a proof is not known ({why})"
    if a.sign and unknown:
        human += (f". `zerocomm history {shlex.quote(a.group)} --json` shows each message's headers: a proof "
                  "is a zc-origin header")
    ctx.out(value, human)
    return EXIT_OK


class _Labels:
    """Publisher DIDs to member labels, refreshed when an unknown DID shows up."""

    def __init__(self, client: Client, group: str) -> None:
        self.client = client
        self.group = group
        self.names: dict[str, str] = {}
        self._refreshed = 0.0

    def __call__(self, did: str) -> str:
        if did not in self.names and time.monotonic() - self._refreshed > 2.0:
            self._refreshed = time.monotonic()
            try:
                for m in self.client.members(self.group, include_left=True, timeout=5.0):  # a leaver's rows too
                    if m.get("did") and m.get("label"):
                        self.names[m["did"]] = m["label"]
            except ZeroCommError:
                pass
        return self.names.get(did) or short_did(did)


def _rows(table: Any) -> list[dict[str, Any]]:
    return table.to_pylist() if table is not None else []


def _print_rows(ctx: Ctx, rows: list[dict[str, Any]], labels: _Labels, *, stream: bool) -> None:
    if ctx.json:
        for row in rows:
            emit_json({"offset": row["offset"], "group": row["group"], "message_id": row["message_id"],
                       "publisher_did": row["publisher_did"], "publisher_label": labels(row["publisher_did"]),
                       "seq": row["seq"], "lamport_ts": row["lamport_ts"], "sent_at": row["sent_at"],
                       "received_at": row["received_at"], "headers": json_headers(row.get("headers")),
                       **json_payload(row["payload"])})
        return
    shaped = [{"offset": r["offset"], "time": format_time(r["sent_at"]), "from": labels(r["publisher_did"]),
               "seq": r["seq"], "message": format_payload(r["payload"], 200)} for r in rows]
    if stream:
        for r in shaped:
            print(f"{r['time']}  {printable(r['from'])}  #{r['seq']}  {r['message']}", flush=True)
    else:
        print(render_table(shaped, [("offset", "OFFSET"), ("time", "SENT"), ("from", "FROM"), ("seq", "SEQ"),
                                    ("message", "MESSAGE")], empty="(no messages)"))


def _unknown_group(client: Client, group: str) -> errors.GroupNotFoundError | None:
    """For a read that found nothing: the error if this member is not in ``group`` either (a misspelt
    name printed nothing and exited 0). A group it left keeps its journaled history: no error then."""
    names = sorted(g.get("group", "") for g in client.groups())
    if group in names or client.latest(group).get("publishers"):  # a group it left: known to its journal,
        return None  # which keeps listing publishers whose rows retention deleted (or a scan cut short)
    return errors.GroupNotFoundError(
        f"this member's journal holds no messages of group {group!r}, and it is in no group of that name",
        hint="Check the name; the groups it is in: " + (", ".join(repr(n) for n in names) or "none") +
             " (`zerocomm group info GROUP`)")


def cmd_history(ctx: Ctx) -> int:
    check_group(ctx.args.group)  # a name no group can have: say so, not an empty history
    client = ctx.client()
    labels = _Labels(client, ctx.args.group)
    rows: list[dict[str, Any]] = []
    found = 0
    if ctx.args.all or ctx.args.limit == 0:  # --limit 0: all, as for history replay
        offset = None
        while True:
            page = client.fetch(group=ctx.args.group, start=offset)
            found += page.table.num_rows
            if ctx.json:  # one JSON line per row, page by page: a long history is never all in memory
                _print_rows(ctx, _rows(page.table), labels, stream=True)
            else:  # an aligned table needs every row's width first
                rows += _rows(page.table)
            if page.next_offset >= page.end_offset or offset == page.next_offset:
                break
            offset = page.next_offset
    else:
        rows = _rows(client.fetch(group=ctx.args.group, last=ctx.args.limit).table)
        found = len(rows)
    if not found:
        unknown = _unknown_group(client, ctx.args.group)
        if unknown is not None:
            raise unknown
    if ctx.json:
        _print_rows(ctx, rows, labels, stream=True)
    else:
        _print_rows(ctx, rows, labels, stream=False)
    return EXIT_OK


def cmd_tail(ctx: Ctx) -> int:
    check_group(ctx.args.group)  # following a name no group can have would wait forever
    client = ctx.client()
    unknown = _unknown_group(client, ctx.args.group)  # so would a misspelt one (and --no-follow printed nothing,
    if unknown is not None:                           # exit 0); a group it left keeps its history: tail that
        raise unknown
    labels = _Labels(client, ctx.args.group)
    page = client.fetch(group=ctx.args.group, last=ctx.args.lines) if ctx.args.lines > 0 else None
    if page is not None:
        _print_rows(ctx, _rows(page.table), labels, stream=True)
        offset = page.next_offset
    else:
        offset = int(client.latest()["next_offset"])
    if ctx.args.no_follow:
        return EXIT_OK
    while True:
        try:
            page = client.fetch(group=ctx.args.group, start=offset, wait=10.0)
        except (errors.AgentNotRunningError, errors.ApiTimeoutError):
            # The journal keeps its offsets: go on from the same one, labels looked up through the new client.
            client = labels.client = _wait_for_restart(ctx, client)
            continue
        _print_rows(ctx, _rows(page.table), labels, stream=True)
        offset = page.next_offset


def _wait_for_restart(ctx: Ctx, old: Client) -> Client:
    """tail -F, not tail -f: an agent that stops (a restart, an upgrade) is waited for, as long as a
    stop and a start may take, then followed again; past that the error says no agent runs."""
    from zerocomm_spark.agent.runfiles import held_by

    old.close()
    ctx._client = None  # noqa: SLF001 - the context's cached client is the stale one
    cfg = ctx.config
    deadline = time.monotonic() + cfg.get("agent", "stop_timeout") + cfg.get("agent", "start_timeout")
    sys.stderr.write(f"zerocomm: the agent for {cfg.identity_dir} is not answering; waiting for it to come back "
                     "(Ctrl-C to stop)\n")
    sys.stderr.flush()
    while True:
        try:
            ctx._client = Client.connect(  # noqa: SLF001 - so that the context closes this one at exit
                cfg.socket_dir, timeout=max(0.1, min(5.0, deadline - time.monotonic())), call_timeout=ctx.timeout)
            return ctx._client  # noqa: SLF001
        except (errors.AgentNotRunningError, errors.ApiTimeoutError):
            if time.monotonic() >= deadline:
                if held_by(cfg.socket_dir) is not None:
                    raise errors.ApiTimeoutError(
                        f"the agent for {cfg.identity_dir} stopped answering", hint="`zerocomm agent status` "
                        "shows its last heartbeat; restart it (`zerocomm agent stop --force`, then start)") from None
                raise errors.AgentNotRunningError(
                    f"the agent for {cfg.identity_dir} stopped and did not come back",
                    hint="Start it (`zerocomm agent start --detach`) and run tail again") from None
            time.sleep(0.5)


def cmd_metrics(ctx: Ctx) -> int:
    metrics = ctx.client().metrics()

    def human() -> str:
        simple = [(k, v) for k, v in metrics.items() if not isinstance(v, (dict, list))]
        # The peer transport's counters (timeouts, drops) under their own prefix: its frames_in is not
        # the group's messages_in.
        simple += [(f"transport.{k}", v) for k, v in (metrics.get("transport") or {}).items()]
        text = render_pairs(simple)
        lag_rows = [{"group": g, "publisher": short_did(p, 40), "lag": n}
                    for g, pubs in (metrics.get("lag") or {}).items() for p, n in pubs.items()]
        if lag_rows:
            text += "\n\n" + render_table(lag_rows, [("group", "GROUP"), ("publisher", "PUBLISHER"), ("lag", "LAG")])
        alive = metrics.get("peers_alive") or {}
        if alive:
            text += "\n\n" + render_table([{"peer": short_did(p, 40), "alive": a} for p, a in alive.items()],
                                          [("peer", "PEER"), ("alive", "ALIVE")])
        calls = metrics.get("api_calls") or {}
        if calls:
            text += "\n\n" + render_table(
                [{"call": c, "count": int(v["count"]), "errors": int(v["errors"]),
                  "avg_ms": f"{1000 * v['seconds'] / max(v['count'], 1):.1f}"} for c, v in sorted(calls.items())],
                [("call", "CALL"), ("count", "COUNT"), ("errors", "ERRORS"), ("avg_ms", "AVG MS")])
        return text

    ctx.out(metrics, human)
    return EXIT_OK


def cmd_keygen(ctx: Ctx) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    value = {"public_key": public.decode("ascii"), "secret_key": secret.decode("ascii")}
    ctx.out(value, f"public_key  {value['public_key']}   (list it in the agent's api.allowed_clients)\n"
                   f"secret_key  {value['secret_key']}   (keep it with the client; never share it)")
    return EXIT_OK


def cmd_config(ctx: Ctx) -> int:
    cfg = ctx.config
    rows = [{"setting": f"{s}.{k}", "value": config_mod._flag_text(v), "source": cfg.source[f"{s}.{k}"]}
            for s, keys in cfg.values.items() for k, v in keys.items()]
    value = {"file": str(cfg.file) if cfg.file else None, "values": cfg.values, "source": cfg.source,
             "identity_dir": str(cfg.identity_dir), "socket_dir": str(cfg.socket_dir),
             "journal_dir": str(cfg.journal_dir), "warnings": list(cfg.warnings)}
    ctx.out(value, lambda: f"file: {cfg.file or '(none: defaults)'}\n\n"
                           + render_table(rows, [("setting", "SETTING"), ("value", "VALUE"), ("source", "SOURCE")]))
    return EXIT_OK


# --- entry point -------------------------------------------------------------------------------


def _report_error(exc: BaseException, as_json: bool, code: int | None = None) -> int:
    code = exit_code_for(exc) if code is None else code
    if as_json:
        facts = getattr(exc, "json_facts", None)  # (a `send -` that stopped part way: how to resume)
        emit_json({"ok": False, "error": error_header(None, exc)["error"], "exit_code": code,
                   **(facts if isinstance(facts, dict) else {})})
    else:
        if isinstance(exc, ZeroCommError):
            message, hint = exc.message, exc.hint
            sys.stderr.write(f"zerocomm: error: {printable(message, keep=chr(10))}\n")  # may quote a peer
            if hint:
                sys.stderr.write(f"  what to do: {printable(hint, keep=chr(10))}\n")
        else:
            sys.stderr.write(f"zerocomm: error: {type(exc).__name__}: {printable(str(exc), keep=chr(10))}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: parse, run one command, map errors to the documented exit codes."""
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    if "--json" in raw:  # a script asked for JSON: a usage error is JSON on stdout too (and text on stderr)
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                args = parser.parse_args(raw)
        except SystemExit as exc:
            sys.stderr.write(said.getvalue())
            if exc.code == 0:  # --help
                raise
            lines = [line for line in said.getvalue().splitlines() if line.strip()]
            message = lines[-1].split("error: ", 1)[-1] if lines else "the command line is not valid"
            return _report_error(errors.ConfigurationError(message, hint="See `zerocomm --help`"), True)
        sys.stderr.write(said.getvalue())
    else:
        args = parser.parse_args(raw)
    as_json = bool(getattr(args, "json", False))
    ctx: Ctx | None = None
    try:
        ctx = Ctx(args)
        return int(args.func(ctx))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `zerocomm tail g | head`: the reader left; not an error
        try:
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - silence the flush at exit
        except OSError:
            pass
        return EXIT_OK
    except ZeroCommError as exc:
        return _report_error(exc, as_json)
    except (TypeError, ValueError) as exc:  # a bad argument caught by the client before sending
        return _report_error(errors.ConfigurationError(str(exc)), as_json)
    except OSError as exc:  # a local file or device failed: said like any error (JSON under --json), no traceback
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        # The documented code of what happened: a timeout is 4, a permission refused 7, the rest 1.
        code = EXIT_PERMISSION if isinstance(exc, PermissionError) else exit_code_for(exc)
        return _report_error(errors.ZeroCommError(
            f"{type(exc).__name__}: {exc.strerror or exc}{where}",
            hint="Check that path and its permissions; the settings in force are shown by `zerocomm config`"),
            as_json, code)
    finally:
        if ctx is not None:
            ctx.close()


if __name__ == "__main__":
    sys.exit(main())
