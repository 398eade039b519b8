"""The connection options of the CLI (credentials, TLS, inbox prefix, `nats` contexts),
against real nats-server processes configured by each test.

Every command runs as a subprocess (``python -m hookbus.cli``), as a user runs it: a
refusal must be one error line and never a traceback. `hookbus handlers --json` is the
cheap command that connects, reads the registry bucket and pings the live workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nkeys  # type: ignore[import-untyped]
import pytest
import trustme

from hookbus.cli import find_nats_server

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PASSWORD = "s3cret-pw"
TOKEN = "t0ken-abc"


# -- servers and commands ----------------------------------------------------------------------
@dataclass
class Server:
    url: str
    port: int
    log: Path


@contextlib.contextmanager
def nats_server(folder: Path, config: str) -> Iterator[Server]:
    """A nats-server with JetStream and `config` (server.conf in `folder`), on a free
    loopback port read from its ports file; logs to a file."""
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "server.conf"
    conf.write_text(config + f'\njetstream {{ store_dir: "{folder / "js"}" }}\n')
    ports = folder / "ports"
    ports.mkdir(exist_ok=True)
    log = folder / "nats-server.log"
    cmd = [find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", "-1"]
    cmd += ["--ports_file_dir", str(ports), "-l", str(log)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        url = ""
        while not url:
            assert proc.poll() is None, f"nats-server exited: {log.read_text()}"
            assert time.monotonic() < deadline, "nats-server did not start"
            for found in ports.glob(f"*_{proc.pid}.ports"):
                with contextlib.suppress(json.JSONDecodeError):
                    url = (json.loads(found.read_text()).get("nats") or [""])[0]
            time.sleep(0.02)
        yield Server(url=url, port=int(url.rsplit(":", 1)[1]), log=log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hookbus(
    *args: str, env: dict[str, str] | None = None, home: Path | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run the CLI with no NATS_* variable but those in `env`; `home` is XDG_CONFIG_HOME."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    clean.pop("HOOKBUS_TEST_NATS_URL", None)
    clean.update(COLUMNS="200", XDG_CONFIG_HOME=str(home or Path("/nonexistent-config")))
    clean.update(env or {})
    return subprocess.run(
        [*HOOKBUS, *args], capture_output=True, text=True, timeout=timeout, env=clean
    )


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []  # `handlers --json` on a fresh server


def one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed with one line on stderr holding every needle."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("Error: "), line
    for needle in needles:
        assert needle in line, line
    return line


def user_seed(folder: Path, name: str) -> tuple[Path, str]:
    """A fresh nkey user seed file and its public key."""
    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    kp = nkeys.from_seed(bytearray(seed))
    public = bytes(kp.public_key).decode()
    kp.wipe()
    path = folder / f"{name}.nk"
    path.write_bytes(bytes(seed) + b"\n")
    path.chmod(0o600)
    return path, public


USERS = f"""
authorization {{
  users = [
    {{user: alice, password: "{PASSWORD}"}}
    {{user: bob, password: "{PASSWORD}",
      permissions: {{publish: {{allow: ["$JS.API.>", "$KV.>"]}}}}}}
  ]
}}
"""


@pytest.fixture
def users(tmp_path: Path) -> Iterator[Server]:
    with nats_server(tmp_path / "users", USERS) as server:
        yield server


# -- user and password -------------------------------------------------------------------------
def test_user_and_password_connect(users: Server) -> None:
    ok(hookbus("handlers", "--json", "--url", users.url, "--user", "alice", "--password", PASSWORD))


def test_a_wrong_password_is_one_line_naming_the_server_and_user(users: Server) -> None:
    proc = hookbus("handlers", "--url", users.url, "--user", "alice", "--password", "wrong")
    line = one_error_line(
        proc, f"NATS at {users.url} refused the connection", "authorization violation", "'alice'"
    )
    assert "wrong" not in line


def test_no_credentials_on_a_server_that_needs_them(users: Server) -> None:
    one_error_line(hookbus("handlers", "--url", users.url), "authorization violation")


def test_a_password_in_the_url_is_not_printed(users: Server) -> None:
    url = f"nats://alice:wrong@127.0.0.1:{users.port}"
    line = one_error_line(hookbus("handlers", "--url", url), "authorization violation")
    assert "wrong" not in line and "alice:***@" in line


def test_the_environment_variables(users: Server) -> None:
    env = {"NATS_URL": users.url, "NATS_USER": "alice", "NATS_PASSWORD": PASSWORD}
    ok(hookbus("handlers", "--json", env=env))
    one_error_line(
        hookbus("handlers", env={**env, "NATS_PASSWORD": "wrong"}), "authorization violation"
    )


def test_options_that_do_not_go_together_are_a_usage_error(users: Server) -> None:
    proc = hookbus("handlers", "--url", users.url, "--user", "alice", "--token", "x")
    assert proc.returncode == 2 and "do not go together" in proc.stderr
    proc = hookbus("handlers", "--url", users.url, "--password", "x")
    assert proc.returncode == 2 and "--password needs --user" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_permissions_violation_is_one_warning_naming_the_subject(users: Server) -> None:
    """bob may not publish to $SRV.*: the liveness pings are refused (one warning each), the
    listing goes on."""
    proc = hookbus(
        "handlers", "--json", "--url", users.url, "--user", "bob", "--password", PASSWORD
    )
    ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if "permissions violation" in line]
    assert warnings, proc.stderr
    # nats-py hands the server's error text over lowercased, subject included
    # one warning per refused subject: the workers' ping and the dispatcher services' stats
    assert all("WARNING" in w and "'$srv." in w and "user 'bob'" in w for w in warnings)
    assert any("'$srv.ping.hookbus-worker'" in w for w in warnings), warnings
    assert len(warnings) == len(set(warnings)), warnings


@pytest.mark.parametrize(
    "command",
    [
        ["handlers"],
        ["handlers", "require", "tool:pre", "x"],
        ["handlers", "unrequire", "tool:pre", "x"],
        ["emit", "tool:pre", "{}"],
        ["worker", f"{EXAMPLES / 'security_policy.py'}:worker"],
        ["dispatcher"],
        ["suspensions", "list"],
        ["suspensions", "show", "x"],
        ["suspensions", "cancel", "x"],
        ["suspensions", "clear", "x"],
        ["approvals"],
        ["approvals", "grants"],
        ["approvals", "revoke", "--all"],
        ["decisions"],
        ["demo"],
    ],
    ids=" ".join,
)
def test_every_command_that_connects_takes_the_options(users: Server, command: list[str]) -> None:
    proc = hookbus(*command, "--url", users.url, "--user", "alice", "--password", "wrong")
    one_error_line(proc, "authorization violation (user 'alice')")


# -- token -------------------------------------------------------------------------------------
def test_a_token(tmp_path: Path) -> None:
    config = f'authorization {{ token: "{TOKEN}" }}'
    with nats_server(tmp_path / "token", config) as server:
        ok(hookbus("handlers", "--json", "--url", server.url, "--token", TOKEN))
        ok(hookbus("handlers", "--json", env={"NATS_URL": server.url, "NATS_TOKEN": TOKEN}))
        line = one_error_line(
            hookbus("handlers", "--url", server.url, "--token", "bad-token"),
            "authorization violation (token)",
        )
        assert "bad-token" not in line


# -- nkeys -------------------------------------------------------------------------------------
def test_an_nkey_user_replies_on_its_own_inbox_prefix(tmp_path: Path) -> None:
    """The user may subscribe to `_INBOX_<its public key>.>` only: every reply (JetStream
    API, KV watch, service ping) must come there, so the prefix derived from the seed works."""
    seed, public = user_seed(tmp_path, "admin")
    config = f"""
    authorization {{ users = [
      {{nkey: {public}, permissions: {{
        publish: {{allow: [">"]}}, subscribe: {{allow: ["_INBOX_{public}.>"]}}
      }}}}
    ] }}
    """
    with nats_server(tmp_path / "nkey", config) as server:
        ok(hookbus("handlers", "--json", "--url", server.url, "--nkey", str(seed)))
        ok(hookbus("handlers", "--json", env={"NATS_URL": server.url, "NATS_NKEY": str(seed)}))
        # another key: refused, and the message names the public key it tried
        other, other_public = user_seed(tmp_path, "other")
        one_error_line(
            hookbus("handlers", "--url", server.url, "--nkey", str(other)),
            "authorization violation",
            f"nkey {other_public}",
        )
        # an inbox prefix the user may not subscribe to: one error line at once, naming the
        # subscription refused (as written, though nats-py hands the server's text over
        # lowercased) and the key it was refused to
        proc = hookbus(
            "handlers", "--url", server.url, "--nkey", str(seed), "--inbox-prefix", "_INBOX"
        )
        assert "Traceback" not in proc.stderr and proc.returncode != 0
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "NATS refused subscription to _INBOX." in proc.stderr
        assert f"to {public} (unknown): permissions violation" in proc.stderr


def bad_file_is_one_line(option: str, path: Path, *needles: str) -> None:
    """``hookbus handlers OPTION PATH`` with a URL nothing answers on: the file is read
    before connecting, so the command fails with one error line holding `needles`."""
    one_error_line(hookbus("handlers", "--url", "nats://127.0.0.1:1", option, str(path)), *needles)


def test_a_bad_nkey_file_is_one_line(tmp_path: Path) -> None:
    not_a_seed = tmp_path / "not-a-seed.nk"
    not_a_seed.write_text("hello\n")
    bad_file_is_one_line(
        "--nkey", not_a_seed, f"the nkey seed file {not_a_seed} holds no valid nkey seed"
    )
    missing = tmp_path / "gone.nk"
    bad_file_is_one_line(
        "--nkey", missing, "cannot read the nkey seed file", "No such file or directory"
    )


# -- creds files -------------------------------------------------------------------------------
def test_an_unreadable_creds_file_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.creds"
    bad_file_is_one_line(
        "--creds", missing, f"cannot read the creds file {missing}: No such file or directory"
    )
    bad_file_is_one_line(
        "--creds", tmp_path, f"cannot read the creds file {tmp_path}: Is a directory"
    )
    garbage = tmp_path / "garbage.creds"
    garbage.write_text("not a creds file\n")
    one_error_line(
        hookbus("handlers", "--url", "nats://127.0.0.1:1", env={"NATS_CREDS": str(garbage)}),
        f"{garbage} is not a NATS credentials file",
    )


# -- nats CLI contexts -------------------------------------------------------------------------
def write_context(home: Path, name: str, **fields: str) -> Path:
    path = home / "nats" / "context" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # the nats CLI writes every field, empty ones as ""
    path.write_text(json.dumps({"description": "", "token": "", "creds": "", **fields}))
    return path


def test_a_context_by_name_and_by_path(users: Server, tmp_path: Path) -> None:
    home = tmp_path / "config"
    path = write_context(home, "dev", url=users.url, user="alice", password=PASSWORD)
    ok(hookbus("handlers", "--json", "--context", "dev", home=home))
    ok(hookbus("handlers", "--json", env={"NATS_CONTEXT": "dev"}, home=home))
    ok(hookbus("handlers", "--json", "--context", str(path)))


def test_options_given_win_over_the_context(users: Server, tmp_path: Path) -> None:
    home = tmp_path / "config"
    write_context(home, "stale", url="nats://127.0.0.1:1", user="alice", password="old")
    given = ["--url", users.url, "--password", PASSWORD]
    ok(hookbus("handlers", "--json", "--context", "stale", *given, home=home))
    env = {"NATS_URL": users.url, "NATS_PASSWORD": PASSWORD}
    ok(hookbus("handlers", "--json", "--context", "stale", env=env, home=home))
    # another kind of credential replaces the context's: its token is dropped
    write_context(home, "tok", url=users.url, token="context-token")
    login = ["--user", "alice", "--password", PASSWORD]
    ok(hookbus("handlers", "--json", "--context", "tok", *login, home=home))


def test_a_bad_context_is_one_line(tmp_path: Path) -> None:
    home = tmp_path / "config"
    one_error_line(hookbus("handlers", "--context", "nope", home=home), "no NATS context 'nope'")
    one_error_line(
        hookbus("handlers", "--context", str(tmp_path / "missing.json")), "no NATS context"
    )
    broken = write_context(home, "broken")
    broken.write_text("{not json")
    one_error_line(hookbus("handlers", "--context", "broken", home=home), "is not valid JSON")
    write_context(home, "jwt", url="nats://127.0.0.1:1", user_jwt="eyJ...")
    one_error_line(
        hookbus("handlers", "--context", "jwt", home=home), "sets user_jwt", "not support"
    )


# -- TLS ---------------------------------------------------------------------------------------
@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    written = {  # key: (file name, PEM bytes)
        "ca": ("ca.pem", ca.cert_pem.bytes()),
        "cert": ("server.pem", b"".join(pem.bytes() for pem in cert.cert_chain_pems)),
        "key": ("server-key.pem", cert.private_key_pem.bytes()),
        "other_ca": ("other-ca.pem", trustme.CA().cert_pem.bytes()),
    }
    for name, pem in written.values():
        (tmp_path / name).write_bytes(pem)
    return {key: tmp_path / name for key, (name, _) in written.items()}


def test_tls_with_a_ca(tmp_path: Path, tls_files: dict[str, Path]) -> None:
    config = f"""
    tls {{ cert_file: "{tls_files["cert"]}", key_file: "{tls_files["key"]}" }}
    {USERS}
    """
    with nats_server(tmp_path / "tls", config) as server:
        auth = ["--user", "alice", "--password", PASSWORD]
        ca = str(tls_files["ca"])
        ok(hookbus("handlers", "--json", "--url", server.url, "--tls-ca", ca, *auth))
        ok(hookbus("handlers", "--json", *auth, env={"NATS_URL": server.url, "NATS_CA": ca}))
        home = tmp_path / "config"
        write_context(home, "tls", url=server.url, ca=ca, user="alice", password=PASSWORD)
        ok(hookbus("handlers", "--json", "--context", "tls", home=home))

        start = time.monotonic()
        proc = hookbus(
            "handlers", "--url", server.url, "--tls-ca", str(tls_files["other_ca"]), *auth
        )
        line = one_error_line(proc, "TLS with NATS at", "failed", f"CA {tls_files['other_ca']}")
        assert "certificate" in line or "issuer" in line
        assert time.monotonic() - start < 15  # refused at once, not after the retries

        # no CA given: the system's CAs do not know this one
        one_error_line(hookbus("handlers", "--url", server.url, *auth), "the system's CAs")
        # a wrong password over TLS is still one line
        wrong = ["--user", "alice", "--password", "wrong"]
        one_error_line(
            hookbus("handlers", "--url", server.url, "--tls-ca", ca, *wrong),
            "authorization violation (user 'alice')",
        )


def test_a_bad_tls_file_is_one_line(tmp_path: Path) -> None:
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("nothing here\n")
    bad_file_is_one_line("--tls-ca", not_pem, f"cannot load the TLS CA {not_pem}")
    bad_file_is_one_line("--tls-cert", not_pem, f"cannot load the TLS certificate {not_pem}")
