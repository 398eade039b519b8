"""The real Claude Code CLI (npm ``@anthropic-ai/claude-code``, tests/claude_cli/package.json)
driven headless (``claude -p``) through hookbus's two doors, against a fake Anthropic
Messages API (`_claude_cli.FakeMessagesApi`) that asks for one ``Bash`` tool call.

The project's ``.claude/settings.json`` is written by ``hookbus claude-code settings
--merge ... --write`` (plus ``"permissions": {"allow": ["Bash"]}``, so an allowed call runs
without a prompt). Whether the tool REALLY ran is read from a sentinel file the Bash command
creates (``touch ran``), never from what the hook printed. Behind the doors: a private
nats-server, a ``hookbus dispatcher`` process and a ``hookbus worker`` serving
tests/fixtures/claude_code/policy.py (``rm -rf`` denied, the rest allowed).

Node.js and npm are installed with apt-get when missing; a CLI that does not run fails the test.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _claude_bus import ENV, FIXTURES, HOOKBUS, policy_bus
from _claude_cli import FakeMessagesApi, claude_env, run_claude, trust
from _ports import free_port

DENIED = "rm -rf ./scratch; touch ran"
ALLOWED = "touch ran"
# the first test installs the CLI (about 400 MB, once per machine); then each takes seconds
pytestmark = pytest.mark.timeout(300)


def denies(url: str, answers: list[str]) -> bool:
    """Whether ``hookbus claude-code`` answers an ``rm -rf`` PreToolUse with the worker's deny
    (its output is appended to `answers`)."""
    body = json.loads((FIXTURES / "PreToolUse.json").read_text())
    body["tool_input"] = {**body["tool_input"], "command": "rm -rf /"}
    done = subprocess.run([HOOKBUS, "claude-code", "--url", url], input=json.dumps(body),
                          capture_output=True, text=True, timeout=30, env=ENV)  # fmt: skip
    answers.append(f"exit {done.returncode}: {done.stdout.strip()} {done.stderr.strip()}")
    return "destructive command" in done.stdout


@dataclass
class Bus:
    nats_url: str
    gateway_url: str  # .../claude-code
    seen: Path
    env: dict[str, str]


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bus]:
    """A private server, a dispatcher service, the policy worker and an HTTP gateway."""
    gateway = [HOOKBUS, "gateway", "http", "--port", "0"]
    with policy_bus(tmp_path_factory.mktemp("claude-real"), gateway) as served:
        url, answers = served.url, []
        served.wait_until(
            lambda: denies(url, answers), "tool:pre routed to the policy worker", interval_s=0.1,
            last=lambda: f"the last answer: {answers[-1:]}",
        )  # fmt: skip
        banner: list[str] = []

        def serving() -> bool:
            m = re.search(r"hookbus gateway serving (\S+)", served.logs[2].read_text())
            banner[:] = [m.group(1)] if m else []
            return bool(m)

        served.wait_until(serving, "the gateway's banner", interval_s=0.1)
        yield Bus(url, banner[0].rstrip("/") + "/claude-code", served.seen, served.env)


@dataclass
class Outcome:
    ran: bool
    tool_results: list[str]
    stdout: str
    stderr: str
    shown_to_model: str  # every Messages API request body of the turn, as JSON
    sentinel: Path


def turn(
    claude: Path, tmp_path: Path, command: str, settings_args: list[str], env: dict[str, str]
) -> Outcome:
    """One headless turn whose one tool call is Bash `command`, in a project whose settings
    ``hookbus claude-code settings SETTINGS_ARGS --merge ... --write`` wrote."""
    home, project = tmp_path / "home", tmp_path / "project"
    (project / ".claude").mkdir(parents=True)
    home.mkdir()
    settings = project / ".claude" / "settings.json"
    settings.write_text(json.dumps({"permissions": {"allow": ["Bash"]}}))
    done = subprocess.run(
        [HOOKBUS, "claude-code", "settings", "--merge", str(settings), "--write",
         *settings_args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    trust(home, project)
    with FakeMessagesApi(command=command).serving() as api:
        t = run_claude(claude, project, claude_env(home, api.url), timeout=45)
    assert t.code == 0, f"claude exit {t.code}\nstdout: {t.stdout}\nstderr: {t.stderr}"
    assert len(api.tool_results) == 1, (api.tool_results, t.stdout, t.stderr)
    sentinel = project / "ran"
    return Outcome(sentinel.exists(), api.tool_results, t.stdout, t.stderr,
                   json.dumps(api.requests), sentinel)  # fmt: skip


def command_door(url: str, *more: str) -> list[str]:
    return ["--", "--url", url, "--timeout", "10", *more]


def http_door(url: str) -> list[str]:
    return ["--door", "http", "--url", url]


@pytest.mark.parametrize("door", ["command", "http"])
def test_a_denied_tool_call_does_not_run(claude: Path, bus: Bus, tmp_path: Path, door: str) -> None:
    args = command_door(bus.nats_url) if door == "command" else http_door(bus.gateway_url)
    out = turn(claude, tmp_path, DENIED, args, bus.env)
    assert not out.ran, out
    assert "destructive command" in out.tool_results[0], out


@pytest.mark.parametrize("door", ["command", "http"])
def test_an_allowed_tool_call_runs(claude: Path, bus: Bus, tmp_path: Path, door: str) -> None:
    args = command_door(bus.nats_url) if door == "command" else http_door(bus.gateway_url)
    out = turn(claude, tmp_path, ALLOWED, args, bus.env)
    assert out.ran, out
    # the policy worker decided it: the hook really ran, with Claude Code's own input
    seen = [json.loads(x) for x in bus.seen.read_text().splitlines()]
    pre = [s for s in seen if s["event"] == "tool:pre" and s["data"].get("cwd") ==
           str((tmp_path / "project").resolve())]  # fmt: skip
    assert [s["data"]["tool_input"]["command"] for s in pre] == [ALLOWED], seen
    # every event of the turn reached the worker (SessionStart hooks are commands only)
    turn_events = [s["event"] for s in seen if s["data"].get("cwd") == pre[0]["data"]["cwd"]]
    expected = ["prompt:submit", "tool:pre", "tool:post", "claude_code:stop", "session:end"]
    if door == "command":
        expected.append("session:start")
    assert sorted(turn_events) == sorted(expected), turn_events


@pytest.mark.parametrize("failure", ["nats-down", "hookbus-missing", "gateway-down"])
def test_when_hookbus_cannot_answer_the_tool_call_does_not_run(
    claude: Path, bus: Bus, tmp_path: Path, failure: str
) -> None:
    nowhere = free_port()
    args = {
        "nats-down": command_door(f"nats://127.0.0.1:{nowhere}"),
        "hookbus-missing": ["--command", str(tmp_path / "no-such" / "hookbus"),
                            *command_door(bus.nats_url)],
        "gateway-down": http_door(f"http://127.0.0.1:{nowhere}/claude-code"),
    }[failure]  # fmt: skip
    out = turn(claude, tmp_path, ALLOWED, args, bus.env)
    assert not out.ran, out
    # why, in Claude Code's words: the door's fallback, or Claude Code's onFailure block
    why = "hookbus unavailable" if failure == "nats-down" else "blocking because onFailure"
    assert why in out.tool_results[0], out


@pytest.mark.parametrize("door", ["command", "http"])
def test_a_rewritten_tool_call_is_not_run_unconfirmed_in_a_headless_turn(
    claude: Path, bus: Bus, tmp_path: Path, door: str
) -> None:
    """The policy rewrites the command (modify). By default the door answers the rewrite
    with "ask" (the user confirms it), and nobody can answer in ``claude -p``: Claude Code
    refuses the call, so neither the original nor the rewrite runs."""
    args = command_door(bus.nats_url) if door == "command" else http_door(bus.gateway_url)
    out = turn(claude, tmp_path, "echo SECRET > ran", args, bus.env)
    assert not out.ran, out


def test_a_rewritten_tool_call_runs_as_rewritten_with_on_continue_allow(
    claude: Path, bus: Bus, tmp_path: Path
) -> None:
    args = command_door(bus.nats_url, "--on-continue", "allow")
    out = turn(claude, tmp_path, "echo SECRET > ran", args, bus.env)
    assert out.ran, out
    assert out.sentinel.read_text() == "[redacted]\n"  # the rewrite ran, not the original


@pytest.mark.parametrize("door", ["command", "http"])
def test_added_context_reaches_the_model_and_the_tool_call_runs(
    claude: Path, bus: Bus, tmp_path: Path, door: str
) -> None:
    args = command_door(bus.nats_url) if door == "command" else http_door(bus.gateway_url)
    out = turn(claude, tmp_path, "git push origin main 2>/dev/null; touch ran", args, bus.env)
    assert out.ran, out
    assert "main is protected" in out.shown_to_model, out.shown_to_model[-2000:]


@contextlib.contextmanager
def approver(url: str, choice: str) -> Iterator[list[dict[str, object]]]:
    """Answer the first pending approval with `choice`, as a person at ``hookbus approvals``
    would, while the turn waits; yields the approvals answered."""
    answered: list[dict[str, object]] = []
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set() and not answered:
            listed = subprocess.run(
                [HOOKBUS, "approvals", "list", "--json", "--url", url],
                capture_output=True, text=True, timeout=30, env=ENV,
            )  # fmt: skip
            pending = json.loads(listed.stdout or "[]") if listed.returncode == 0 else []
            for approval in pending:
                done = subprocess.run(
                    [HOOKBUS, "approvals", "answer", approval["label"], choice,
                     "--approver", "alice", "--url", url],
                    capture_output=True, text=True, timeout=30, env=ENV,
                )  # fmt: skip
                assert done.returncode == 0, done.stderr
                answered.append(approval)
                return
            stop.wait(0.3)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield answered
    finally:
        stop.set()
        thread.join(40)


@pytest.mark.parametrize("choice", ["Allow", "Deny"])
def test_a_tool_call_waits_for_a_human_and_runs_only_when_approved(
    claude: Path, bus: Bus, tmp_path: Path, choice: str
) -> None:
    """The policy asks a human for ``deploy``; the dispatcher service runs the approval and
    the command door waits for it (its --timeout long enough for the human)."""
    args = ["--", "--url", bus.nats_url, "--timeout", "30"]
    with approver(bus.nats_url, choice) as answered:
        out = turn(claude, tmp_path, "deploy 2>/dev/null; touch ran", args, bus.env)
    prompts = [a["metadata"]["prompt"] for a in answered]  # type: ignore[index]
    assert prompts == ["Run 'deploy 2>/dev/null; touch ran' on production?"], out
    assert out.ran is (choice == "Allow"), out
