"""The agent's configuration: the shipped file equals the defaults, and file < env < flags."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

from zerocomm_spark.agent import config as cfgmod
from zerocomm_spark.client import resolve_socket_dir
from zerocomm_spark.errors import ConfigurationError

CONF = Path(__file__).resolve().parents[2] / "conf" / "zerocomm.toml"


def test_shipped_file_is_exactly_the_defaults() -> None:
    shipped = tomllib.loads(CONF.read_text())
    assert shipped == cfgmod.DEFAULTS
    # == takes 30 for 30.0: the file a user copies must show each setting's type as DEFAULTS has it
    # (a TOML integer where a float is expected reads, but misleads about what the setting takes).
    assert {(s, k): type(v) for s, keys in shipped.items() for k, v in keys.items()} == \
        {(s, k): type(v) for s, keys in cfgmod.DEFAULTS.items() for k, v in keys.items()}


def test_defaults_work_without_any_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = cfgmod.load(None, env={})
    assert cfg.file is None
    assert cfg.identity_dir == tmp_path / ".zerocomm" / "member"
    assert cfg.socket_dir == cfg.identity_dir / "run"
    assert cfg.journal_dir == cfg.identity_dir / "journal"
    assert cfg.retention_ms == 7 * 86400 * 1000
    assert cfg.consumer_expiry_ms == 7 * 86400 * 1000
    assert all(source == "default" for source in cfg.source.values())


def test_file_then_env_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "z.toml"
    path.write_text('[log]\nlevel = "warning"\nformat = "kv"\n[journal]\nfsync = "never"\n'
                    '[api]\nallowed_clients = ["a"]\nworkers = 3\n')
    env = {"ZEROCOMM_LOG_LEVEL": "debug", "ZEROCOMM_API_WORKERS": "5", "ZEROCOMM_API_ALLOWED_CLIENTS": "x, y"}
    cfg = cfgmod.load(path, env=env, flags=["api.workers=7"])
    assert cfg.get("log", "format") == "kv"  # file
    assert cfg.get("journal", "fsync") == "never"  # file
    assert cfg.get("log", "level") == "debug"  # env beats file
    assert cfg.get("api", "allowed_clients") == ["x", "y"]  # env list, comma-separated
    assert cfg.get("api", "workers") == 7  # flag beats env
    assert cfg.source["api.workers"] == "flag"
    assert cfg.source["log.level"] == "env ZEROCOMM_LOG_LEVEL"
    assert cfg.source["journal.fsync"] == str(path)
    assert cfg.overrides() == ["api.workers=7"]


def test_relative_paths_in_a_file_are_relative_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent started from another directory must find the same identity (and socket, journal,
    log); in the environment or a flag a relative path is the current directory's."""
    home = tmp_path / "conf"
    home.mkdir()
    path = home / "z.toml"
    path.write_text('[identity]\ndir = "member"\n[api]\nsocket_dir = "run/api"\n[journal]\ndir = "../j"\n'
                    '[log]\nfile = "agent.log"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = cfgmod.load(path, env={})
    assert cfg.identity_dir == home / "member"
    assert cfg.socket_dir == home / "run" / "api"
    assert cfg.journal_dir.resolve() == tmp_path / "j"
    assert cfg.log_file == home / "agent.log"
    cfg = cfgmod.load(path, env={"ZEROCOMM_IDENTITY_DIR": "mine"}, flags=["journal.dir=jj"])
    assert cfg.identity_dir == elsewhere / "mine"
    assert cfg.journal_dir == elsewhere / "jj"


def test_zerocomm_config_env_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "z.toml"
    path.write_text('[identity]\ndir = "/tmp/somewhere"\n')
    cfg = cfgmod.load(None, env={"ZEROCOMM_CONFIG": str(path)})
    assert cfg.identity_dir == Path("/tmp/somewhere")
    with pytest.raises(ConfigurationError, match="ZEROCOMM_CONFIG"):
        cfgmod.load(None, env={"ZEROCOMM_CONFIG": str(tmp_path / "missing.toml")})
    # init's load: the file ZEROCOMM_CONFIG names is the one it is to write, as for --config
    assert cfgmod.load(None, env={"ZEROCOMM_CONFIG": str(tmp_path / "missing.toml")}, missing_ok=True).file is None
    assert cfgmod.user_config_file({"ZEROCOMM_CONFIG": str(tmp_path / "missing.toml")}) == tmp_path / "missing.toml"


@pytest.mark.parametrize(("text", "match"), [
    ('[journal]\nfsynk = "always"\n', "did you mean 'fsync'"),
    ('[jornal]\nfsync = "always"\n', "did you mean 'journal'"),
    ('[journal]\nfsync = "sometimes"\n', "journal.fsync .* must be one of always, interval, never"),
    ('[api]\nworkers = "many"\n', "api.workers .* must be an integer"),
    ('[api]\nworkers = 0\n', "must be positive"),
    ('[journal]\nretention_age = "a week"\n', "duration"),
    ('[journal]\nconsumer_expiry = "a week"\n', "journal.consumer_expiry must be a duration"),
    ('[journal]\nconsumer_expiry = "90s"\n', "must be at least 5 minutes"),
    ("[api\n", "not valid TOML"),
])
def test_bad_files_are_refused_naming_the_setting(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "z.toml"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=match):
        cfgmod.load(path, env={})


def test_bad_env_and_flags_name_their_source() -> None:
    with pytest.raises(ConfigurationError, match="ZEROCOMM_AGENT_HEARTBEAT_INTERVAL"):
        cfgmod.load(None, env={"ZEROCOMM_AGENT_HEARTBEAT_INTERVAL": "soon"})
    with pytest.raises(ConfigurationError, match="section.key=value"):
        cfgmod.load(None, env={}, flags=["loglevel"])
    with pytest.raises(ConfigurationError, match="unknown log setting 'levle'"):
        cfgmod.load(None, env={}, flags=["log.levle=debug"])
    cfg = cfgmod.load(None, env={"ZEROCOMM_NOPE_THING": "1"})
    assert any("ZEROCOMM_NOPE_THING" in w for w in cfg.warnings)


def test_booleans_and_durations() -> None:
    assert cfgmod.parse_duration("250ms") == 0.25
    assert cfgmod.parse_duration("2w") == 14 * 86400
    assert cfgmod.parse_duration("") is None and cfgmod.parse_duration("0") is None
    cfg = cfgmod.load(None, env={"ZEROCOMM_JOURNAL_RETENTION_AGE": "0"})
    assert cfg.retention_ms is None
    cfg = cfgmod.load(None, env={"ZEROCOMM_JOURNAL_CONSUMER_EXPIRY": "0"}, flags=[])
    assert cfg.consumer_expiry_ms is None
    assert cfgmod.load(None, env={}, flags=["journal.consumer_expiry=90m"]).consumer_expiry_ms == 90 * 60 * 1000


def test_client_finds_the_socket_dir_the_agent_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "z.toml"
    path.write_text(f'[identity]\ndir = "{tmp_path / "id"}"\n')
    cases = [
        (None, {}),
        (path, {}),
        (path, {"ZEROCOMM_IDENTITY_DIR": str(tmp_path / "other")}),
        (path, {"ZEROCOMM_API_SOCKET_DIR": str(tmp_path / "sock")}),
        (None, {"ZEROCOMM_CONFIG": str(path)}),
    ]
    (tmp_path / "conf").mkdir()
    relative = tmp_path / "conf" / "rel.toml"  # relative to the file, whatever the current directory
    relative.write_text('[identity]\ndir = "member"\n')
    cases += [(relative, {}), (relative, {"ZEROCOMM_API_SOCKET_DIR": "sock"})]
    relative_sock = tmp_path / "conf" / "sock.toml"
    relative_sock.write_text('[api]\nsocket_dir = "../run"\n')
    cases += [(relative_sock, {}), (relative_sock, {"ZEROCOMM_IDENTITY_DIR": "elsewhere"})]
    for config, env in cases:
        assert resolve_socket_dir(config, env) == cfgmod.load(config, env=env).socket_dir, (config, env)


def test_client_checks_only_the_socket_setting_in_force(tmp_path: Path) -> None:
    """A bad file value the environment overrides is no error for the client either (as for the agent)."""
    path = tmp_path / "z.toml"
    path.write_text('[api]\nsocket_dir = 5\n[identity]\ndir = ["x"]\n')
    env = {"ZEROCOMM_API_SOCKET_DIR": str(tmp_path / "sock"), "ZEROCOMM_IDENTITY_DIR": str(tmp_path / "id")}
    assert resolve_socket_dir(path, env) == cfgmod.load(path, env=env).socket_dir == tmp_path / "sock"
    with pytest.raises(ConfigurationError, match=r"identity\.dir in .*z\.toml must be a string"):
        resolve_socket_dir(path, {"ZEROCOMM_API_SOCKET_DIR": str(tmp_path / "sock")})
    with pytest.raises(ConfigurationError, match=r"api\.socket_dir in .*z\.toml must be a string"):
        resolve_socket_dir(path, {"ZEROCOMM_IDENTITY_DIR": str(tmp_path / "id")})


def test_render_toml_round_trips(tmp_path: Path) -> None:
    values = {s: dict(v) for s, v in cfgmod.DEFAULTS.items()}
    values["identity"]["label"] = 'quote " and \\ backslash'
    values["api"]["allowed_clients"] = ["k1", "k2"]
    path = tmp_path / "out.toml"
    path.write_text(cfgmod.render_toml(values))
    assert cfgmod.load(path, env={}).values == values


@pytest.mark.parametrize("flag, match", [
    ("agent.stop_timeout=inf", "agent.stop_timeout .* must be a finite number"),
    ("agent.start_timeout=Infinity", "agent.start_timeout .* must be a finite number"),
    ("api.max_request_bytes=100000000000000000000", "api.max_request_bytes .* at most"),
    ("peer.max_frame_bytes=100000000000000000000", "peer.max_frame_bytes .* at most"),
    ("journal.retention_age=" + "9" * 400 + "d", "journal.retention_age"),
])
def test_values_no_agent_can_use_are_refused_when_loaded(flag: str, match: str) -> None:
    """An endless timeout means a wait without a deadline (stop_timeout=inf broke the agent's close),
    and numbers past what ZeroMQ or the journal take crashed the start with an unexplained OverflowError."""
    with pytest.raises(ConfigurationError, match=match):
        cfgmod.load(None, env={}, flags=[flag])


@pytest.mark.parametrize("flag", ["agent.stop_timeout=1e300", "agent.start_timeout=1e12", "groups.publish_timeout=1e300",
                                  "agent.heartbeat_interval=1e300", "journal.fsync_interval_ms=9007199254740992"])
def test_waits_too_long_for_threading_are_refused_when_loaded(flag: str, tmp_path: Path) -> None:
    """Finite but huge waits passed: stop_timeout=1e300 made the agent's close fail with OverflowError
    ('timestamp out of range for platform time_t') for its API server and its ingest, and
    fsync_interval_ms=2**53 killed the journal's background thread (no fsync, no retention)."""
    name, _, value = flag.partition("=")
    with pytest.raises(ConfigurationError, match=rf"{name} \(from flag {name}\) must be at most"):
        cfgmod.load(None, env={}, flags=[flag])
    section, key = name.split(".")
    var = f"ZEROCOMM_{section.upper()}_{key.upper()}"
    with pytest.raises(ConfigurationError, match=rf"{name} \(from env {var}\) must be at most"):
        cfgmod.load(None, env={var: value})
    path = tmp_path / "z.toml"
    path.write_text(f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigurationError, match=rf"{name} \(from file {re.escape(str(path))}\) must be at most"):
        cfgmod.load(path, env={})
    cfgmod.load(None, env={}, flags=[f"{name}={'86400000' if key.endswith('_ms') else '86400'}"])  # a day is fine


@pytest.mark.parametrize("name", ["peer.endpoint", "peer.advertise", "groups.publish_endpoint"])
def test_a_relative_ipc_endpoint_is_refused_with_its_absolute_form(name: str, tmp_path: Path) -> None:
    """ZeroMQ resolved ipc://run/peer.sock from the current directory: a detached agent's is /, and
    the peers it was announced to resolved it from theirs, so nobody reached it."""
    with pytest.raises(ConfigurationError, match=rf"{name} .* relative ipc endpoint .*ipc://{os.getcwd()}/run/peer.sock"):
        cfgmod.load(None, env={}, flags=[f"{name}=ipc://run/peer.sock"])
    file = tmp_path / "zc.toml"
    section, key = name.split(".")
    file.write_text(f'[{section}]\n{key} = "ipc://peer.sock"\n')
    with pytest.raises(ConfigurationError, match="relative ipc endpoint"):
        cfgmod.load(file, env={})
    for fine in ("ipc:///tmp/peer.sock", "ipc://@abstract-name", "tcp://127.0.0.1:*"):
        if name != "peer.advertise" or "*" not in fine:
            assert cfgmod.load(None, env={}, flags=[f"{name}={fine}"]).get(section, key) == fine


def test_an_endless_timeout_in_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "z.toml"
    path.write_text("[agent]\nstop_timeout = inf\n")  # valid TOML
    with pytest.raises(ConfigurationError, match="must be a finite number"):
        cfgmod.load(path, env={})


def test_the_passphrase_variable_is_not_taken_for_a_misspelt_setting(tmp_path: Path) -> None:
    """identity.passphrase_env may name a ZEROCOMM_* variable: it holds the passphrase, and every
    command warned that it "names no setting"."""
    path = tmp_path / "z.toml"
    path.write_text('[identity]\npassphrase_env = "ZEROCOMM_SECRET"\n')
    cfg = cfgmod.load(path, env={"ZEROCOMM_SECRET": "hunter2", "ZEROCOMM_NOPE": "1"})
    assert len(cfg.warnings) == 1 and "ZEROCOMM_NOPE" in cfg.warnings[0]
    cfg = cfgmod.load(None, env={"ZEROCOMM_IDENTITY_PASSPHRASE_ENV": "ZEROCOMM_PW", "ZEROCOMM_PW": "x"})
    assert cfg.warnings == () and cfg.get("identity", "passphrase_env") == "ZEROCOMM_PW"


@pytest.mark.parametrize("where", ["flag", "env", "file"])
@pytest.mark.parametrize("given", ["hunter2 my real passphrase!", "p@ss-w0rd", "9lives", "pass\udcffword", 12345678])
def test_a_passphrase_given_in_place_of_its_variables_name_is_refused_and_never_shown(
        tmp_path: Path, where: str, given: object) -> None:
    """`--set identity.passphrase_env='the passphrase'` (a natural slip) was accepted: starting the agent
    then failed with "identity.passphrase_env names <the passphrase>, which is not set", on stderr and
    twice in the agent's log file, `zerocomm config` showed it, and a detached agent got it in its argv."""
    if isinstance(given, int) != (where == "file") and (where != "file" or "\udcff" in str(given)):
        pytest.skip("only a TOML file has numbers; only argv and the environment have undecodable bytes")
    path = tmp_path / "z.toml"
    flags: list[str] = []
    env: dict[str, str] = {}
    if where == "file":
        path.write_text(f"[identity]\npassphrase_env = {given if isinstance(given, int) else repr(given)}\n",
                        encoding="utf-8")
    elif where == "env":
        env["ZEROCOMM_IDENTITY_PASSPHRASE_ENV"] = str(given)
    else:
        flags.append(f"identity.passphrase_env={given}")
    with pytest.raises(ConfigurationError) as caught:
        cfgmod.load(path if where == "file" else None, env=env, flags=flags)
    text = f"{caught.value.message} {caught.value.hint}"
    assert "passphrase_env" in text and "name" in text
    assert str(given) not in text and "hunter2" not in text and "p@ss" not in text and "\\udcff" not in text
    assert repr(str(given)) not in text


def test_a_passphrase_variables_name_is_taken_as_it_is() -> None:
    for name in ("ZC_PASSPHRASE", "_x", "lower_case9", "ZEROCOMM_PW"):
        assert cfgmod.load(None, env={}, flags=[f"identity.passphrase_env={name}"]).get(
            "identity", "passphrase_env") == name
    assert cfgmod.load(None, env={}, flags=["identity.passphrase_env="]).get("identity", "passphrase_env") == ""


def test_a_setting_with_undecodable_bytes_names_itself(tmp_path: Path) -> None:
    """Flags and variables come from argv and the environment, decoded with surrogateescape: such a
    value cannot go into the TOML file, a socket path or a label peers see."""
    for flags, env, name in ((["identity.label=a\udcff"], {}, "identity.label"),
                             (["api.allowed_clients=a,b\udcff"], {}, "api.allowed_clients")):
        with pytest.raises(ConfigurationError, match=f"{name}.*not UTF-8 text"):
            cfgmod.load(None, env=env, flags=flags)
    # Paths are bytes on Linux and take them (a directory named in Latin-1)...
    cfg = cfgmod.load(None, env={"ZEROCOMM_JOURNAL_DIR": "/data/j\udce9", "ZEROCOMM_API_SOCKET_DIR": "/tmp/\udcff"})
    assert str(cfg.journal_dir) == "/data/j\udce9"
    # ...but not a ZeroMQ endpoint, which is UTF-8: the socket path says so when the endpoint is made.
    from zerocomm_spark.client import ipc_endpoint

    with pytest.raises(ConfigurationError, match="socket path.*not UTF-8 text"):
        ipc_endpoint(cfg.socket_dir)


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path: Path) -> None:
    """--config naming a directory or a device said "does not exist" about something that exists."""
    for path, said in ((tmp_path, "is a directory"), (Path("/dev/null"), "is not a regular file"),
                       (tmp_path / "nope.toml", "does not exist")):
        with pytest.raises(ConfigurationError, match=said):
            cfgmod.load(path, env={})
        with pytest.raises(ConfigurationError, match=f"ZEROCOMM_CONFIG.*{said}"):
            cfgmod.load(None, env={"ZEROCOMM_CONFIG": str(path)})


@pytest.mark.parametrize("zero", ["0", "0s", "0m", "0.0", "0d", "00"])
def test_a_zero_consumer_expiry_written_with_a_unit_still_means_never(zero: str) -> None:
    """consumer_expiry_ms reads "0s" as "0" (never forget consumers, not forget them at once); the
    5-minute floor (75b30d4) refused it as shorter than 5 minutes, so a file saying never failed
    every command and the agent's start."""
    assert cfgmod.load(None, env={}, flags=[f"journal.consumer_expiry={zero}"]).consumer_expiry_ms is None
    assert cfgmod.load(None, env={"ZEROCOMM_JOURNAL_CONSUMER_EXPIRY": zero}).consumer_expiry_ms is None
    with pytest.raises(ConfigurationError, match="at least 5 minutes"):  # a short one is still refused
        cfgmod.load(None, env={}, flags=["journal.consumer_expiry=1ms"])


def test_errors_in_a_file_name_the_file(tmp_path: Path) -> None:
    """A bad setting in a file said only "(from file)": an agent started by a service manager, or one
    that found ~/.config/zerocomm/zerocomm.toml by itself, left its user guessing which file to edit."""
    path = tmp_path / "site.toml"
    path.write_text("[journal]\nfsync = \"sometimes\"\n")
    with pytest.raises(ConfigurationError, match=rf"journal.fsync \(from file {re.escape(str(path))}\) must be one of"):
        cfgmod.load(path, env={})
    path.write_text("[journal]\nfsink = \"always\"\n")
    with pytest.raises(ConfigurationError, match=rf"unknown journal setting 'fsink' in {re.escape(str(path))} "
                                                 r"\(did you mean 'fsync'\?\)"):
        cfgmod.load(path, env={})
    path.write_text("[jurnal]\nfsync = \"always\"\n")
    with pytest.raises(ConfigurationError, match=rf"unknown section 'jurnal' in {re.escape(str(path))}"):
        cfgmod.load(path, env={})


def test_a_bad_file_value_that_a_variable_or_flag_overrides_does_not_fail(tmp_path: Path) -> None:
    """Every value in the file was checked before the environment and the flags were read: a bad one
    failed the command even with `--set` (or a ZEROCOMM_* variable) overriding it, the way a user
    would get past a shared file they cannot edit. Now the value in force is the one checked."""
    path = tmp_path / "site.toml"
    path.write_text('[journal]\nfsync = "sometimes"\n[api]\nworkers = "many"\n[log]\nlevel = "loud"\n')
    cfg = cfgmod.load(path, env={"ZEROCOMM_API_WORKERS": "3", "ZEROCOMM_LOG_LEVEL": "chatty"},
                      flags=["journal.fsync=always", "log.level=debug"])
    assert (cfg.get("journal", "fsync"), cfg.get("api", "workers"), cfg.get("log", "level")) == ("always", 3, "debug")
    assert cfg.source["journal.fsync"] == "flag" and cfg.source["api.workers"] == "env ZEROCOMM_API_WORKERS"
    # What is not overridden is still checked, naming the file; the winning value is checked too.
    with pytest.raises(ConfigurationError, match=rf"api.workers \(from file {re.escape(str(path))}\) must be an integer"):
        cfgmod.load(path, env={}, flags=["journal.fsync=always", "log.level=debug"])
    with pytest.raises(ConfigurationError, match=r"journal.fsync \(from flag journal.fsync\) must be one of"):
        cfgmod.load(path, env={"ZEROCOMM_API_WORKERS": "3"}, flags=["journal.fsync=often", "log.level=debug"])
    # A misspelt name in the file fails even when a flag gives the setting it meant.
    path.write_text('[journal]\nfsynk = "always"\n')
    with pytest.raises(ConfigurationError, match=rf"unknown journal setting 'fsynk' in {re.escape(str(path))}"):
        cfgmod.load(path, env={}, flags=["journal.fsync=always"])


def test_the_command_line_runs_with_a_bad_file_value_it_overrides(tmp_path: Path) -> None:
    """Where the user meets it: `zerocomm --config FILE --set ... config` exited 2 on the file's value."""
    import json
    import subprocess
    import sys

    path = tmp_path / "site.toml"
    path.write_text(f'[identity]\ndir = "{tmp_path / "id"}"\n[journal]\nfsync = "sometimes"\n')
    base = [sys.executable, "-m", "zerocomm_spark.agent", "--config", str(path), "--json"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROCOMM_")}
    done = subprocess.run([*base, "--set", "journal.fsync=always", "config"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr + done.stdout
    shown = json.loads(done.stdout)
    assert shown["values"]["journal"]["fsync"] == "always" and shown["source"]["journal.fsync"] == "flag"
    env["ZEROCOMM_JOURNAL_FSYNC"] = "never"
    done = subprocess.run([*base, "config"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and json.loads(done.stdout)["values"]["journal"]["fsync"] == "never", done.stderr
    del env["ZEROCOMM_JOURNAL_FSYNC"]
    # init keeps the file and creates the identity it names, the flag overriding the file's bad value
    done = subprocess.run([*base, "--set", "journal.fsync=always", "init", "--identity-dir", str(tmp_path / "id"),
                           "--label", "site"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "id" / "keystore.sealed").exists() and "sometimes" in path.read_text()
    done = subprocess.run([*base, "config"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and str(path) in done.stdout, done.stdout  # not overridden: still refused
