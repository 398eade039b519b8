"""A permissions violation reaches the user at once, in one line, instead of a timeout.

Against real nats-servers started from `hookbus auth init` (no mocks): a refused request
raises `NotPermittedError` as the server says it (the error callback still hears it), a
refused subscription is raised by the flush after it, and each user-facing case ends
within a few seconds with one line naming what was refused and to whom: a worker run with
a seed that may not serve its handlers, `hookbus approvals` as an agent, the Claude Code
hook without ``--agent`` (still denying), a bucket the identity may not create, and the
console's sign-in as another approver than its NATS credentials.

Before, these ended in timeouts of 15 to 31 s (or a page stuck on "answering..."); the
bounds below (10 s) leave room for a loaded machine and still fail the old behaviour, whose
messages (a timeout, "JetStream unavailable") are also asserted absent.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _ports import free_port, on_free_port
from nats.aio.client import Client as NATS

from hookbus._core.kv import ensure_buckets
from hookbus._core.nats_guard import harden_connection
from hookbus.cli import EmbeddedNatsServer
from hookbus.schemas import NotPermittedError

anyio_test = pytest.mark.anyio

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "security_policy.py"

FAST_S = 10.0
"""Upper bound for a refusal to reach the user (the old behaviour took 15 to 31 s)."""

PUBKEY = r"U[A-Z2-7]{55}"
REFUSED = re.compile(
    rf"NATS refused (publish|subscription) to (\S+) to ({PUBKEY}) \(([^()]+)\): "
    r"permissions violation"
)


@dataclass
class Secured:
    """A server from `hookbus auth init` (agent a1, approver alice, worker sec serving
    tool:pre/security_policy only; admin, dispatcher)."""

    out: Path
    url: str

    def context(self, stem: str) -> Path:
        return self.out / f"{stem}.json"

    def settings(self, stem: str) -> dict[str, Any]:
        return dict(json.loads(self.context(stem).read_text()))

    async def connect(self, stem: str, errors: list[str] | None = None) -> NATS:
        ctx = self.settings(stem)
        seen = errors if errors is not None else []

        async def on_error(exc: Exception) -> None:
            seen.append(str(exc))

        options: dict[str, Any] = {}
        if ctx.get("ca"):
            options["tls"] = ssl.create_default_context(cafile=ctx["ca"])
        return await nats.connect(
            ctx["url"], nkeys_seed=ctx["nkey"], inbox_prefix=ctx["inbox_prefix"],
            error_cb=on_error, allow_reconnect=False, connect_timeout=15, **options,
        )  # fmt: skip


def _server(base: Path) -> Iterator[Secured]:
    def start(port: int) -> tuple[EmbeddedNatsServer, Path]:
        out = base / f"port-{port}"
        subprocess.run(
            [sys.executable, "-m", "hookbus.cli", "auth", "init", "--out", str(out),
             "--agent", "a1", "--approver", "alice", "--worker",
             "sec:tool:pre/security_policy", "--port", str(port)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        server = EmbeddedNatsServer(out / "run", config=out / "server.conf")
        server.start()
        return server, out

    server, out = on_free_port(start)
    try:
        ctx = json.loads((out / "admin-admin.json").read_text())
        yield Secured(out, ctx["url"])
    finally:
        server.stop()


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A secured server whose buckets nobody made."""
    yield from _server(tmp_path_factory.mktemp("bare"))


async def _provision(secured: Secured) -> None:
    nc = await secured.connect("admin-admin")
    try:
        await ensure_buckets(nc)
    finally:
        await nc.close()


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A secured server whose buckets the admin made (`hookbus auth provision`, where the
    CLI has it; else hookbus's buckets, as the admin)."""
    for secured in _server(tmp_path_factory.mktemp("provisioned")):
        done, _ = hookbus("auth", "provision", "--dir", str(secured.out))
        if done.returncode != 0:
            assert "No such command" in done.stderr, done.stderr
            anyio.run(_provision, secured)
        yield secured


def hookbus(
    *args: str, stdin: str | None = None, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "hookbus.cli", *args], input=stdin, capture_output=True,
        text=True, timeout=timeout, env=env,
    )  # fmt: skip
    return done, time.monotonic() - started


def error_lines(text: str) -> list[str]:
    """The lines of stderr but the note naming where NATS is (a context gave the URL)."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith("NATS at ")]


def the_one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one error line of a command that failed (asserts it failed, with one line)."""
    assert done.returncode != 0
    lines = error_lines(done.stderr)
    assert len(lines) == 1, done.stderr
    return lines[0]


def assert_says_at_once(done: subprocess.CompletedProcess[str], took: float, pattern: str) -> None:
    """The command failed within `FAST_S` seconds, its one error line `pattern` in full."""
    line = the_one_error_line(done)
    assert re.fullmatch(pattern, line), line
    assert took < FAST_S, f"{took:.1f}s"


# -- the connection --------------------------------------------------------------------


@anyio_test
async def test_a_refused_request_raises_at_once_and_the_callback_still_hears_it(
    provisioned: Secured,
) -> None:
    errors: list[str] = []
    nc = await provisioned.connect("agent-a1", errors)
    try:
        harden_connection(nc, identity="agent a1")
        started = time.monotonic()
        with pytest.raises(NotPermittedError) as refused:
            await nc.request("hookbus.v1.emit.someone=20else.tool=3Apre", b"{}", timeout=20)
        assert time.monotonic() - started < FAST_S
        text = str(refused.value)
        public = provisioned.settings("agent-a1")["inbox_prefix"].removeprefix("_INBOX_")
        assert text == (
            f"NATS refused publish to hookbus.v1.emit.someone=20else.tool=3Apre to {public}"
            " (agent a1): permissions violation"
        )
        assert refused.value.identity == public and refused.value.role == "agent a1"
        assert refused.value.operation == "publish"
        assert any("permissions violation" in e for e in errors), errors

        # a subscription: the flush after it says so; the connection goes on working
        await nc.subscribe("hookbus.v1.handler.*.security_policy", queue="security_policy")
        with pytest.raises(NotPermittedError, match=r"^NATS refused subscription to "
                           r"hookbus\.v1\.handler\.\*\.security_policy to "):  # fmt: skip
            await nc.flush()
        await nc.flush()  # told once
        assert "\n" not in text
    finally:
        await nc.close()


@anyio_test
async def test_without_a_label_the_role_is_unknown(provisioned: Secured) -> None:
    nc = await provisioned.connect("agent-a1")
    try:
        harden_connection(nc)
        with pytest.raises(NotPermittedError, match=rf"to {PUBKEY} \(unknown\): permissions"):
            await nc.request("hookbus.v1.nobody", b"", timeout=20)
    finally:
        await nc.close()


# -- where users meet it ---------------------------------------------------------------


def test_a_worker_without_the_grants_exits_at_once_with_the_refusal(provisioned: Secured) -> None:
    done, took = hookbus(
        "worker", f"{EXAMPLE}:worker",
        "--context", str(provisioned.context("agent-a1")),
    )  # fmt: skip
    line = the_one_error_line(done)
    assert line.startswith("Error: NATS refused "), line
    assert REFUSED.search(line) and "(agent a1)" in line, line
    assert "JetStream unavailable" not in done.stderr and "within" not in done.stderr
    assert took < FAST_S, f"{took:.1f}s"


def test_a_worker_serving_a_handler_of_another_identity_is_refused_at_once(
    provisioned: Secured,
) -> None:
    """examples/security_policy.py also serves prompt:complete/response_dlp, which worker
    sec may not: its subscription is refused, and the worker exits with that line."""
    done, took = hookbus(
        "worker", f"{EXAMPLE}:worker",
        "--context", str(provisioned.context("worker-sec")),
    )  # fmt: skip
    assert_says_at_once(
        done,
        took,
        rf"Error: NATS refused subscription to hookbus\.v1\.handler\.prompt=3Acomplete\."
        rf"response_dlp to {PUBKEY} \(worker sec\): permissions violation",
    )


def test_a_bucket_an_identity_may_not_create_names_the_admin(bare: Secured) -> None:
    done, took = hookbus("approvals", "--context", str(bare.context("approver-alice")))
    assert_says_at_once(
        done,
        took,
        rf"Error: bucket hookbus_\w+ does not exist and {PUBKEY} \(approver alice\) may not"
        r" create it: provision it as the admin \(`hookbus auth provision`\)",
    )


def test_approvals_as_an_agent_say_so_at_once(provisioned: Secured) -> None:
    for args in (["approvals"], ["approvals", "answer", "approval:x", "Allow", "--approver",
                                 "alice"]):  # fmt: skip
        done, took = hookbus(*args, "--context", str(provisioned.context("agent-a1")))
        line = the_one_error_line(done)
        assert REFUSED.search(line) and "(agent a1)" in line, line
        assert "an approver's NATS credentials" in line, line
        assert "did not succeed within" not in done.stderr
        assert took < FAST_S, f"{args}: {took:.1f}s"


def test_approvals_answer_as_another_approver_is_refused_before_connecting(
    provisioned: Secured,
) -> None:
    done, took = hookbus(
        "approvals", "answer", "approval:x", "Allow", "--approver", "bob",
        "--context", str(provisioned.context("approver-alice")),
    )  # fmt: skip
    assert done.returncode != 0
    assert error_lines(done.stderr) == [
        f"Error: these NATS credentials are approver alice "
        f"({provisioned.settings('approver-alice')['inbox_prefix'].removeprefix('_INBOX_')}):"
        " they answer as alice only, not as bob (give --approver alice)"
    ]
    assert took < FAST_S


def test_the_claude_code_hook_without_agent_denies_with_the_refusal(provisioned: Secured) -> None:
    hook_input = {
        "hook_event_name": "PreToolUse", "session_id": "s1", "tool_name": "Bash",
        "tool_input": {"command": "ls"}, "cwd": "/tmp", "transcript_path": "/tmp/t.jsonl",
    }  # fmt: skip
    done, took = hookbus(
        "claude-code", "--context", str(provisioned.context("agent-a1")),
        stdin=json.dumps(hook_input),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)["hookSpecificOutput"]
    assert out["permissionDecision"] == "deny"  # fail-closed, as documented
    reason = out["permissionDecisionReason"]
    assert REFUSED.search(reason), reason
    assert "NATS refused publish to hookbus.v1.emit." in reason and "(agent a1)" in reason
    assert "no --agent given" in reason and "give --agent a1" in reason, reason
    assert "dispatcher service" not in reason, reason
    assert len(error_lines(done.stderr)) == 1, done.stderr
    assert took < FAST_S, f"{took:.1f}s"


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Hookbus-Console": "1"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_console_signs_in_only_the_approver_of_its_credentials(provisioned: Secured) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env["HOOKBUS_CONSOLE_TOKEN"] = "the-token"
    log = provisioned.out / "console.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hookbus.cli", "console", "--port", str(port),
             "--context", str(provisioned.context("approver-alice"))],
            stdout=subprocess.DEVNULL, stderr=stderr, env=env,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"{base}/api/session", timeout=2) as response:
                    session = json.loads(response.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "the console did not start"
                time.sleep(0.1)
        assert session["nats_approver"] == "alice"
        status, doc = _post(f"{base}/api/login", {"token": "the-token", "approver": "bob"})
        assert status == 403, doc
        assert doc["error"]["code"] == "wrong_approver"
        assert "approver alice" in doc["error"]["message"]
        assert "sign in as alice" in doc["error"]["message"]
        status, doc = _post(f"{base}/api/login", {"token": "the-token", "approver": "alice"})
        assert status == 200 and doc["approver"] == "alice", doc
    finally:
        proc.terminate()
        proc.wait(15)


def test_the_console_refuses_to_run_as_a_non_approver(provisioned: Secured) -> None:
    done, took = hookbus(
        "console", "--port", "0", "--console-token", "t",
        "--context", str(provisioned.context("agent-a1")),
    )  # fmt: skip
    assert done.returncode != 0
    assert "the console's NATS credentials are agent a1" in done.stderr, done.stderr
    assert "approver's seed" in done.stderr
    assert took < FAST_S
