"""The agent's configuration: TOML, then environment, then flags; defaults that work on a laptop.

Why layered this way: a service manager sets environment variables, a person types flags, and a
shared file under ``conf/`` (or ``~/.zerocomm/zerocomm.toml``) holds the rest. Every setting has one
name, ``section.key``, spelled ``ZEROCOMM_<SECTION>_<KEY>`` in the environment and
``--set section.key=value`` on the command line, so nothing needs a special case. Unknown names in
a file or a flag are errors, because a misspelt setting that is silently ignored is worse than none;
an unknown ``ZEROCOMM_*`` variable is a warning (the environment is shared with other tools). Only
the value in force is validated: a bad one that a variable or a flag overrides is not an error.

``conf/zerocomm.toml`` documents the same defaults as :data:`DEFAULTS`; a test keeps them equal.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from zerocomm_spark.client import DEFAULT_IDENTITY_DIR, USER_CONFIG_FILE, default_socket_dir, find_config_file
from zerocomm_spark.errors import ConfigurationError
from zerocomm_spark.text import is_utf8_text

__all__ = ["Config", "DEFAULTS", "ENV_PREFIX", "load", "parse_duration", "render_toml"]

ENV_PREFIX = "ZEROCOMM_"
# ZEROCOMM_* variables that are not agent settings: the config file path, the Spark helper's jar cache.
_NOT_SETTINGS = frozenset({"ZEROCOMM_CONFIG", "ZEROCOMM_JARS"})

#: Every setting and its default. Types are taken from the defaults: str, int, float, bool, list of str.
DEFAULTS: dict[str, dict[str, Any]] = {
    "identity": {
        "dir": DEFAULT_IDENTITY_DIR,
        "label": "",
        "passphrase_env": "",
    },
    "peer": {
        "endpoint": "tcp://127.0.0.1:*",
        "advertise": "",
        "max_frame_bytes": 16 * 1024 * 1024,
        "workers": 4,
    },
    "groups": {
        "publish_endpoint": "",
        "joiner_policy": "open",
        "allow": [],
        "publish_timeout": 30.0,
    },
    "api": {
        "socket_dir": "",
        "tcp_endpoint": "",
        "allowed_clients": [],
        "max_request_bytes": 64 * 1024 * 1024,
        "workers": 16,
        "max_pending": 256,
        "max_read_rows": 100_000,
        "max_read_bytes": 64 * 1024 * 1024,
    },
    "journal": {
        "dir": "",
        "fsync": "interval",
        "fsync_interval_ms": 200,
        "segment_bytes": 64 * 1024 * 1024,
        "retention_bytes": 0,
        "retention_age": "7d",
        "consumer_expiry": "7d",
        "dedup_window": 100_000,
    },
    "agent": {
        "heartbeat_interval": 2.0,
        "start_timeout": 30.0,
        "stop_timeout": 20.0,
    },
    "log": {
        "level": "info",
        "format": "json",
        "file": "",
    },
}

_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("journal", "fsync"): ("always", "interval", "never"),
    ("log", "level"): ("debug", "info", "warning", "error"),
    ("log", "format"): ("json", "kv"),
    ("groups", "joiner_policy"): ("open", "allow-list", "invitation"),
}
_POSITIVE = {("peer", "max_frame_bytes"), ("peer", "workers"), ("api", "max_request_bytes"), ("api", "workers"),
             ("api", "max_pending"), ("api", "max_read_rows"), ("api", "max_read_bytes"), ("journal", "fsync_interval_ms"),
             ("journal", "segment_bytes"), ("agent", "heartbeat_interval"), ("agent", "start_timeout"),
             ("agent", "stop_timeout"), ("groups", "publish_timeout")}
# Past this, sizes and counts overflow what ZeroMQ and the journal take (int64, some multiplied).
_MAX_INT = 2**53
# Settings that are waits: past these, threading's waits overflow (OverflowError: the agent's close
# skipped its API server and its journal, the journal's background thread died) and none is useful.
_DAY = 86_400
_AT_MOST: dict[tuple[str, str], tuple[float, str]] = {
    ("agent", "heartbeat_interval"): (_DAY, "seconds (a day)"),
    ("agent", "start_timeout"): (_DAY, "seconds (a day)"),
    ("agent", "stop_timeout"): (_DAY, "seconds (a day)"),
    ("groups", "publish_timeout"): (_DAY, "seconds (a day, the longest API call)"),
    ("journal", "fsync_interval_ms"): (_DAY * 1000, "ms (a day)"),
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, None: 1.0}


#: The shortest journal.consumer_expiry: a few of the Spark source's keep-alive commits (one a minute).
MIN_CONSUMER_EXPIRY_S = 300


def parse_duration(text: str, what: str = "duration") -> float | None:
    """Seconds from ``"7d"``, ``"12h"``, ``"90s"``, ``"250ms"`` or a bare number; "" or "0" means none."""
    if text.strip() in ("", "0"):
        return None
    match = _DURATION.match(text)
    if match is None:
        raise ConfigurationError(f"{what} must be a duration like 7d, 12h, 30m, 90s or 250ms, not {text!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds * 1000 > _MAX_INT:
        raise ConfigurationError(f"{what} is too long: {text!r}")
    return seconds


@dataclass(frozen=True)
class Config:
    """Resolved settings, plus where each came from (for `zerocomm agent status --json`, and errors)."""

    values: Mapping[str, Mapping[str, Any]]
    source: Mapping[str, str]  # "section.key" -> "default" | file path | "env ZEROCOMM_..." | "flag"
    file: Path | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def get(self, section: str, key: str) -> Any:
        return self.values[section][key]

    # --- derived paths: one place decides where things live ------------------------------------

    @property
    def identity_dir(self) -> Path:
        return Path(self.get("identity", "dir") or DEFAULT_IDENTITY_DIR).expanduser().absolute()

    @property
    def socket_dir(self) -> Path:
        configured = self.get("api", "socket_dir")
        return Path(configured).expanduser().absolute() if configured else default_socket_dir(self.identity_dir)

    @property
    def journal_dir(self) -> Path:
        configured = self.get("journal", "dir")
        return Path(configured).expanduser().absolute() if configured else self.identity_dir / "journal"

    @property
    def log_file(self) -> Path | None:
        configured = self.get("log", "file")
        return Path(configured).expanduser().absolute() if configured else None

    @property
    def label(self) -> str | None:
        return self.get("identity", "label") or None

    @property
    def retention_ms(self) -> int | None:
        seconds = parse_duration(self.get("journal", "retention_age"), "journal.retention_age")
        return None if seconds is None else int(seconds * 1000)

    @property
    def consumer_expiry_ms(self) -> int | None:
        seconds = parse_duration(self.get("journal", "consumer_expiry"), "journal.consumer_expiry")
        return None if not seconds else max(1, int(seconds * 1000))  # "0s" is "0": never, not at once

    def passphrase(self) -> str | None:
        """The keystore passphrase from the environment variable the config names (never from the file)."""
        name = self.get("identity", "passphrase_env")
        if not name:
            return None
        value = os.environ.get(name)
        if not value:
            raise ConfigurationError(f"identity.passphrase_env names {name}, which is not set",
                                     hint=f"Export {name} with the keystore passphrase, or clear identity.passphrase_env")
        return value

    def overrides(self) -> list[str]:
        """``--set`` arguments reproducing the flags given (a detached child inherits file and environment)."""
        out = []
        for section, keys in self.values.items():
            for key, value in keys.items():
                if self.source.get(f"{section}.{key}") == "flag":
                    out.append(f"{section}.{key}={_flag_text(value)}")
        return out


def _flag_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(value)
    return str(value)


def _unknown(kind: str, name: str, known: Sequence[str], where: str = "") -> ConfigurationError:
    close = get_close_matches(name, list(known), n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigurationError(f"unknown {kind} {name!r}{where}{suggestion}",
                              hint=f"Known {kind}s: {', '.join(known)}; see conf/zerocomm.toml")


_PASSPHRASE_SETTING = ("identity", "passphrase_env")
#: What a variable's name may be (POSIX's portable names): a passphrase seldom is one.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PASSPHRASE_NAME_RULE = ("it holds the NAME of the environment variable that holds the keystore passphrase (letters, "
                         "digits and _, not starting with a digit), never the passphrase; the value given is not shown")


def _passphrase_name_hint(name: str) -> str:
    return (f"Export the passphrase in a variable (export ZC_PASSPHRASE=...) and set {name} to its name "
            f"(--set {name}=ZC_PASSPHRASE); if a passphrase was given here, it may be in your shell's history")


def _coerce(section: str, key: str, value: Any, origin: str, *, typed: bool = False) -> Any:
    """``value`` as the type of the default, parsing strings from env and flags (``typed``: a TOML
    value, whose type is its own). ``origin`` names where it came from, the file's path included:
    an agent started by a service manager may read a file its user did not know it read."""
    default = DEFAULTS[section][key]
    name = f"{section}.{key}"
    text = isinstance(value, str) and not typed
    try:
        if isinstance(default, bool):
            if text:
                lowered = value.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                    raise ValueError
                value = lowered in ("true", "1", "yes", "on")
            if not isinstance(value, bool):
                raise ValueError
        elif isinstance(default, int):
            if text:
                value = int(value.strip().replace("_", ""))
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError
        elif isinstance(default, float):
            if text:
                value = float(value.strip())
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError
            value = float(value)
        elif isinstance(default, list):
            if text:
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError
        else:
            if not isinstance(value, str):
                raise ValueError
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number", list: "a list of strings"}.get(
            type(default), "a string")
        if (section, key) == _PASSPHRASE_SETTING:  # a passphrase given in its place (a TOML number): not shown
            raise ConfigurationError(f"{name} (from {origin}) must be a string: {_PASSPHRASE_NAME_RULE}",
                                     hint=_passphrase_name_hint(name)) from None
        raise ConfigurationError(f"{name} (from {origin}) must be {kind}, not {value!r}") from None
    if (section, key) == _PASSPHRASE_SETTING and value and not _ENV_NAME.fullmatch(value):
        # Checked before anything quotes the value: the passphrase itself, given where its variable's name
        # goes, was printed, written to the agent's log and passed on in a detached agent's argv.
        raise ConfigurationError(f"{name} (from {origin}) is not an environment variable's name: "
                                 f"{_PASSPHRASE_NAME_RULE}", hint=_passphrase_name_hint(name))
    # Flags and variables are decoded with surrogateescape: undecodable bytes have no place in a label
    # peers see or a setting sent on (they failed half-way there). Paths are bytes on Linux and take
    # them; init refuses one it cannot write into the TOML file before it creates anything.
    if (section, key) not in _PATH_SETTINGS and any(
            not is_utf8_text(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)):
        raise ConfigurationError(f"{name} (from {origin}) is not UTF-8 text: {value!r}",
                                 hint=f"Give {name} in UTF-8 (check the terminal's or the script's encoding)")
    choices = _CHOICES.get((section, key))
    if choices is not None:
        value = value.lower() if isinstance(value, str) else value
        if value not in choices:
            raise ConfigurationError(f"{name} (from {origin}) must be one of {', '.join(choices)}, not {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # an endless timeout: a wait without a deadline
        raise ConfigurationError(f"{name} (from {origin}) must be a finite number, not {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value > _MAX_INT:
        raise ConfigurationError(f"{name} (from {origin}) must be at most {_MAX_INT}, not {value!r}")
    most = _AT_MOST.get((section, key))
    if most is not None and value > most[0]:
        raise ConfigurationError(f"{name} (from {origin}) must be at most {most[0]:g} {most[1]}, not {value!r}",
                                 hint=f"Give {name} a shorter wait; every wait has a deadline")
    if (section, key) in _POSITIVE and not value > 0:
        raise ConfigurationError(f"{name} (from {origin}) must be positive, not {value!r}")
    if (section, key) in (("journal", "retention_age"), ("journal", "consumer_expiry")):
        seconds = parse_duration(value, name)
        if key == "consumer_expiry" and seconds and seconds < MIN_CONSUMER_EXPIRY_S:  # ("0s" is "0": never)
            # A running Spark query with nothing to read says it is alive once a minute: an expiry near
            # that would forget live queries (their next batch then fails as data loss).
            raise ConfigurationError(
                f"{name} (from {origin}) is {value!r}; it must be at least {MIN_CONSUMER_EXPIRY_S // 60} minutes "
                "(a running Spark query commits its place once a minute while idle)",
                hint="Keep the default 7d, give a longer duration, or 0 to never forget consumers")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise ConfigurationError(f"{name} (from {origin}) must not be negative")
    if ((section, key) in _ENDPOINT_SETTINGS and isinstance(value, str) and value.startswith("ipc://")
            and not value[6:].startswith(("/", "@"))):
        # ZeroMQ resolves it from the current directory: a detached agent's is /, and every peer it is
        # announced to resolves it from its own.
        raise ConfigurationError(f"{name} (from {origin}) is the relative ipc endpoint {value!r}",
                                 hint=f"Give an absolute path: ipc://{os.path.abspath(value[6:])}")
    return value


#: Settings that name a peer-facing ZeroMQ endpoint.
_ENDPOINT_SETTINGS = frozenset({("peer", "endpoint"), ("peer", "advertise"), ("groups", "publish_endpoint")})


def _split_name(name: str, origin: str) -> tuple[str, str]:
    section, _, key = name.partition(".")
    if section not in DEFAULTS:
        raise _unknown("section", section, list(DEFAULTS))
    if key not in DEFAULTS[section]:
        raise _unknown(f"{section} setting", key, list(DEFAULTS[section]))
    return section, key


#: Settings that name a path: a relative one in a file is relative to that file (in the environment
#: or a flag, to the current directory).
_PATH_SETTINGS = frozenset({("identity", "dir"), ("api", "socket_dir"), ("journal", "dir"), ("log", "file")})


def load(config: str | os.PathLike[str] | None = None, *, env: Mapping[str, str] | None = None,
         flags: Mapping[str, str] | Sequence[str] = (), missing_ok: bool = False) -> Config:
    """Resolve the configuration: defaults < file < ZEROCOMM_* environment < flags.

    A relative path in the file is relative to the file's directory, so an agent finds the same
    identity whatever directory it is started from.

    ``flags`` are ``section.key=value`` strings (the ``--set`` option) or a mapping of them.
    ``missing_ok``: a file named by ``config`` or $ZEROCOMM_CONFIG that does not exist yet counts as
    empty (`zerocomm init` writes it).
    """
    env = os.environ if env is None else env
    values = {section: dict(keys) for section, keys in DEFAULTS.items()}
    source = {f"{s}.{k}": "default" for s, keys in DEFAULTS.items() for k in keys}
    warnings: list[str] = []
    named = config if config is not None else env.get("ZEROCOMM_CONFIG") or None
    if missing_ok and named is not None and not Path(named).expanduser().exists():
        path = None  # (--config or $ZEROCOMM_CONFIG: both name the file init is to write)
    else:
        path = find_config_file(config, env)
    # Names first, values after: only the value in force is checked, so a bad one in the file (or the
    # environment) that a variable or a flag overrides does not fail the command, which is how a user
    # gets past it. A misspelt name still fails wherever it is: it overrides nothing.
    # (section, key) -> the value in force so far: (value, origin for errors, source, typed TOML value)
    layers: dict[tuple[str, str], tuple[Any, str, str, bool]] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"cannot read the configuration file {path}: {exc.strerror}") from None
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"the configuration file {path} is not valid TOML: {exc}") from None
        for section, keys in data.items():
            if section not in DEFAULTS:
                raise _unknown("section", section, list(DEFAULTS), where=f" in {path}")
            if not isinstance(keys, dict):
                raise ConfigurationError(f"[{section}] in {path} must be a table of settings")
            for key, value in keys.items():
                if key not in DEFAULTS[section]:
                    raise _unknown(f"{section} setting", key, list(DEFAULTS[section]), where=f" in {path}")
                layers[(section, key)] = (value, f"file {path}", str(path), True)
    items = [(_split_name(name, "flag"), value)
             for name, value in (list(flags.items()) if isinstance(flags, Mapping) else [_split_flag(f) for f in flags])]
    file_passphrase_env = layers.get(("identity", "passphrase_env"), ("",))[0]
    passphrase_vars = {file_passphrase_env if isinstance(file_passphrase_env, str) else "",
                       env.get(ENV_PREFIX + "IDENTITY_PASSPHRASE_ENV"),
                       *(value for name, value in items if name == ("identity", "passphrase_env"))}
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _NOT_SETTINGS or name in passphrase_vars:
            continue  # (the variable identity.passphrase_env names holds the passphrase: not a setting either)
        rest = name[len(ENV_PREFIX):].lower()
        section, _, key = rest.partition("_")
        if section not in DEFAULTS or key not in DEFAULTS[section]:
            warnings.append(f"ignored the environment variable {name}: it names no setting")
            continue
        layers[(section, key)] = (value, f"env {name}", f"env {name}", False)
    for (section, key), value in items:
        layers[(section, key)] = (value, f"flag {section}.{key}", "flag", False)
    for (section, key), (value, origin, where, typed) in layers.items():  # the file's first, in its order
        value = _coerce(section, key, value, origin, typed=typed)
        if typed and path is not None and (section, key) in _PATH_SETTINGS and value \
                and not os.path.isabs(os.path.expanduser(value)):
            value = str(path.parent.absolute() / value)  # the file's own directory, not wherever it is run from
        values[section][key] = value
        source[f"{section}.{key}"] = where
    return Config(values=values, source=source, file=path, warnings=tuple(warnings))


def _split_flag(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or "." not in name:
        raise ConfigurationError(f"--set takes section.key=value, not {text!r}",
                                 hint="For example --set journal.fsync=always or --set log.level=debug")
    return name.strip(), value


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def render_toml(values: Mapping[str, Mapping[str, Any]]) -> str:
    """A TOML file holding ``values`` (what `zerocomm init` writes)."""
    lines = ["# zerocomm agent configuration (written by `zerocomm init`; see conf/zerocomm.toml for every",
             "# setting). Override any setting with ZEROCOMM_<SECTION>_<KEY> or --set section.key=value.", ""]
    for section, keys in values.items():
        lines.append(f"[{section}]")
        for key, value in keys.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def user_config_file(env: Mapping[str, str] | None = None) -> Path:
    """The file `zerocomm init` writes without --config: the one $ZEROCOMM_CONFIG names (what every
    later command then reads), else ~/.zerocomm/zerocomm.toml."""
    named = (os.environ if env is None else env).get("ZEROCOMM_CONFIG")
    return Path(named or USER_CONFIG_FILE).expanduser()
