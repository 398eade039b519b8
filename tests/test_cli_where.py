"""Where a command connects, as the `nats` CLI decides it: ``--url``, else ``NATS_URL``,
else the NATS context (``--context``, ``NATS_CONTEXT``, else the selected one in
``$XDG_CONFIG_HOME/nats/context.txt``), else ``nats://127.0.0.1:4222`` if a server
answers there; no command but ``demo`` (and ``server``) starts a server unless asked with
``--embedded``. Each command runs as a real subprocess against real nats-server processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hookbus.cli import EmbeddedNatsServer

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
LOCAL = "nats://127.0.0.1:4222"
DEAD = "nats://127.0.0.1:1"


def hookbus(
    *args: str, home: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    clean.update(XDG_CONFIG_HOME=str(home), COLUMNS="200", **(env or {}))
    return subprocess.run([*HOOKBUS, *args], capture_output=True, text=True, timeout=60, env=clean)


def select_context(home: Path, name: str, url: str) -> None:
    """What `nats context save NAME --server URL` and `nats context select NAME` write."""
    folder = home / "nats" / "context"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"description": "test", "url": url}))
    (home / "nats" / "context.txt").write_text(name)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "config"


@pytest.fixture
def full_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A server of the user's, not empty: a handler requirement stored in its registry.
    Yields (url, event)."""
    event = f"test:{uuid.uuid4().hex[:10]}"
    with EmbeddedNatsServer() as server:
        proc = hookbus("handlers", "require", event, "guard", "--url", server.url,
                       home=tmp_path / "setup")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        yield server.url, event


def listed(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 0, proc.stderr
    return [h["event"] for h in json.loads(proc.stdout)]


def test_nats_url_is_used_and_named(home: Path, full_server: tuple[str, str]) -> None:
    url, event = full_server
    proc = hookbus("handlers", "--json", home=home, env={"NATS_URL": url})
    assert event in listed(proc)
    assert f"NATS at {url} (from NATS_URL)" in proc.stderr


def test_url_wins_over_nats_url_and_is_not_repeated(
    home: Path, full_server: tuple[str, str]
) -> None:
    url, event = full_server
    select_context(home, "stale", DEAD)
    proc = hookbus("handlers", "--json", "--url", url, home=home, env={"NATS_URL": DEAD})
    assert event in listed(proc)
    assert "NATS at" not in proc.stderr  # the user typed it


def test_the_selected_context_is_used_and_named(home: Path, full_server: tuple[str, str]) -> None:
    url, event = full_server
    select_context(home, "dev", url)
    proc = hookbus("handlers", "--json", home=home)
    assert event in listed(proc)
    assert f"NATS at {url} (from the selected NATS context 'dev')" in proc.stderr


def test_nats_url_wins_over_the_selected_context(home: Path, full_server: tuple[str, str]) -> None:
    url, event = full_server
    select_context(home, "stale", DEAD)
    proc = hookbus("handlers", "--json", home=home, env={"NATS_URL": url})
    assert event in listed(proc)


def test_a_context_named_in_nats_context_wins_over_the_selected_one(
    home: Path, full_server: tuple[str, str]
) -> None:
    url, event = full_server
    select_context(home, "good", url)
    select_context(home, "stale", DEAD)  # now selected
    proc = hookbus("handlers", "--json", home=home, env={"NATS_CONTEXT": "good"})
    assert event in listed(proc)


def _port_4222_free() -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", 4222))
        except OSError:
            return False
    return True


@pytest.fixture
def nothing_on_4222() -> None:
    if not _port_4222_free():
        pytest.skip("another process on this machine listens on 127.0.0.1:4222")


@pytest.mark.parametrize(
    "command",
    [
        ["handlers"],
        ["suspensions", "list"],
        ["approvals"],
        ["emit", "tool:pre", "{}"],
        ["decisions"],
    ],
    ids=" ".join,
)
def test_no_server_anywhere_is_one_line_not_a_private_empty_server(
    home: Path, nothing_on_4222: None, command: list[str]
) -> None:
    proc = hookbus(*command, home=home)
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("Error: no NATS server: nothing answers at nats://127.0.0.1:4222")
    assert "--url" in line and "hookbus server" in line and "--embedded" in line
    assert "embedded nats-server" not in proc.stderr


def test_the_local_server_is_found_and_named(home: Path, nothing_on_4222: None) -> None:
    event = f"test:{uuid.uuid4().hex[:10]}"
    with EmbeddedNatsServer(port=4222) as server:
        assert server.url == LOCAL
        hookbus("handlers", "require", event, "guard", "--url", LOCAL, home=home)
        proc = hookbus("handlers", "--json", home=home)
    assert event in listed(proc)
    assert f"NATS at {LOCAL} (from nothing else given: the local default)" in proc.stderr


def test_embedded_asks_for_a_private_server(home: Path, full_server: tuple[str, str]) -> None:
    url, _event = full_server
    proc = hookbus("handlers", "--json", "--embedded", home=home, env={"NATS_URL": url})
    assert listed(proc) == []  # its own, empty server: not NATS_URL's
    assert "embedded nats-server at nats://127.0.0.1:" in proc.stderr


def test_embedded_and_url_do_not_go_together(home: Path) -> None:
    proc = hookbus("handlers", "--embedded", "--url", DEAD, home=home)
    assert proc.returncode == 2
    assert "--embedded and --url do not go together" in proc.stderr


def test_every_command_that_connects_takes_embedded() -> None:
    """``--embedded`` on every command with connection options (but the Claude Code hook,
    whose --embedded means an in-process dispatcher on the hook's connection)."""
    import click

    from hookbus.cli._command_tree import cli

    def walk(cmd: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, f"{path} {name}".strip())

    missing = [
        path
        for path, cmd in walk(cli, "")
        if any(p.name == "url" for p in cmd.params)
        and not any(p.name == "embedded" for p in cmd.params)
    ]
    assert missing == []
