"""What the CLI shows: the worker's and the dispatcher's banners at the default log level,
one debug line per request, and listings that have ``--json`` and never cut an identifier
a user copies into the next command (an approval label, a grant key), even in an
80-column terminal. Real subprocesses against the test's nats-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from hookbus.cli._service_emit import service_emit
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult

pytestmark = pytest.mark.anyio

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


async def hookbus(*args: str, columns: int = 80) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI as in a terminal `columns` wide (rich's TTY_COMPATIBLE), without colour."""
    terminal = {"COLUMNS": str(columns), "TTY_COMPATIBLE": "1", "NO_COLOR": "1"}
    with anyio.fail_after(60):
        return await anyio.run_process([*HOOKBUS, *args], check=False, env=_env(**terminal))


class Serving:
    """A serving command (worker, dispatcher) whose stderr is collected."""

    def __init__(self, proc: anyio.abc.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def pump(self) -> None:
        assert self.proc.stderr is not None
        buf = b""
        async for chunk in self.proc.stderr:
            buf += chunk
            *done, buf = buf.split(b"\n")
            self.lines += [line.decode() for line in done]

    async def expect(self, needle: str) -> str:
        with anyio.fail_after(30):
            while True:
                for line in self.lines:
                    if needle in line:
                        return line
                await anyio.sleep(0.02)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


async def serve(tg: Any, *args: str) -> Serving:
    proc = await anyio.open_process(
        [*HOOKBUS, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=_env()
    )
    s = Serving(proc)
    tg.start_soon(s.pump)
    return s


async def stop(s: Serving) -> None:
    s.proc.send_signal(signal.SIGTERM)
    with anyio.fail_after(20):
        assert await s.proc.wait() == 0, s.text


WORKER = """
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler({event!r}, priority=3, tool_filter=["bash*"])
async def guard(event, data):
    return {{"action": "deny", "reason": "no"}}


@worker.handler({event!r}, priority=7)
async def audit(event, data):
    return None
"""


@pytest.mark.parametrize("level", ["warning", "debug"])
async def test_worker_banner_and_a_line_per_request(
    tmp_path: Path, nats_url: str, event: str, nc: Any, level: str
) -> None:
    module = tmp_path / "banner_worker.py"
    module.write_text(textwrap.dedent(WORKER.format(event=event)))
    async with anyio.create_task_group() as tg:
        w = await serve(tg, "--log-level", level, "worker", f"{module}:worker",
                        "--url", nats_url, "--max-concurrency", "17")  # fmt: skip
        banner = await w.expect("hookbus worker: serving 2 handler(s)")
        assert f"at {nats_url}" in banner and "concurrency 17" in banner
        guard = await w.expect(f"{event}  guard")
        assert "priority 3" in guard and "queue group guard" in guard and "tools bash*" in guard
        assert "queue group audit" in await w.expect(f"{event}  audit")
        async with HookDispatcher(nc) as d:
            result = await d.emit(event, {"tool_name": "bash"})
        assert result.action == "deny"
        if level == "debug":
            line = await w.expect(f"call {event}/guard: deny in ")
            assert line.rstrip().endswith("ms")
        await stop(w)
        tg.cancel_scope.cancel()
    if level == "warning":
        assert f"call {event}/guard" not in w.text  # per request: debug only


@pytest.mark.parametrize("level", ["warning", "debug"])
async def test_dispatcher_banner_and_a_line_per_request(nats_url: str, nc: Any, level: str) -> None:
    async with anyio.create_task_group() as tg:
        d = await serve(tg, "--log-level", level, "dispatcher", "--url", nats_url,
                        "--max-concurrency", "9", "--audit")  # fmt: skip
        banner = await d.expect("dispatcher serving hookbus.v1.emit.")
        assert f"at {nats_url}" in banner and "queue group hookbus-dispatcher" in banner
        assert "concurrency 9" in banner and "audit on" in banner and "handler(s)" in banner
        result = await service_emit(nc, agent_id="banner-agent")("session:start", {"x": 1})
        assert result.action == "continue"
        if level == "debug":
            await d.expect("emit session:start agent=banner-agent session=-: continue in ")
        await stop(d)
        tg.cancel_scope.cancel()
    if level == "warning":
        assert "emit session:start agent=" not in d.text


# -- listings ---------------------------------------------------------------------------------
@pytest.fixture
async def pending(nc: Any, event: str) -> AsyncIterator[tuple[HookDispatcher, str, str]]:
    """An approval pending for a session: yields (the agent's dispatcher, label, session)."""
    session = f"output-session-{uuid.uuid4().hex}"

    async def ask(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_prompt="Deploy to prod?",
            approval_options=["Allow once", "Allow always", "Deny"], approval_timeout=60,
        )  # fmt: skip

    d = HookDispatcher(nc)
    async with d, anyio.create_task_group() as tg:
        d.register(event, ask, name="a_rather_long_handler_name_for_the_table")
        d.set_default_fields(session_id=session)
        stream = await d.hook_events()
        tg.start_soon(d.emit, event, {"tool_name": "deploy_to_production_cluster"})
        with anyio.fail_after(10):
            async for e in stream:
                if e.hook.status == "pending" and e.hook.metadata.get("session_id") == session:
                    label = e.hook.label
                    break
        await stream.aclose()
        yield d, label, session
        tg.cancel_scope.cancel()


def rows_holding(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def cells(text: str) -> list[list[str]]:
    """The body rows of a rich table, as lists of cell texts."""
    return [[c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if line.startswith("│")]  # fmt: skip


def folded(text: str, column: int) -> list[str]:
    """A column's values, each joined back from the lines rich folded it onto (a row's
    first line has the id in column 0; its continuation lines have none)."""
    values: list[str] = []
    for row in cells(text):
        if row[0]:
            values.append(row[column])
        elif values:
            values[-1] += row[column]
    return values


async def test_approvals_in_a_narrow_terminal_nothing_is_cut(
    nats_url: str, pending: tuple[HookDispatcher, str, str]
) -> None:
    """80 columns: the label and the grant key fold but lose no character, and the id
    beside them (8 characters) is accepted by `answer` and `revoke`."""
    _, label, session = pending
    for args in (["approvals"], ["approvals", "list"]):
        table = await hookbus(*args, "--url", nats_url)
        assert table.returncode == 0, table.stderr
        assert "…" not in table.stdout.decode()
        assert label in folded(table.stdout.decode(), 2), table.stdout.decode()  # id, status, label
        listed = await hookbus(*args, "--url", nats_url, "--json")
        assert listed.returncode == 0, listed.stderr
        (record,) = [r for r in json.loads(listed.stdout) if r["label"] == label]
        assert record["metadata"]["session_id"] == session
    assert [r for r in cells(table.stdout.decode()) if r[0] == record["id"]]

    answer = await hookbus("approvals", "answer", record["id"], "Allow always",
                           "--approver", "ops", "--url", nats_url)  # fmt: skip
    assert answer.returncode == 0, answer.stderr
    assert f"answered {label}: Allow always (as ops)" in answer.stdout.decode()

    grants = await hookbus("approvals", "grants", "--session", session, "--url", nats_url)
    assert grants.returncode == 0, grants.stderr
    as_json = await hookbus("approvals", "grants", "--session", session, "--url", nats_url,
                            "--json")  # fmt: skip
    (grant,) = json.loads(as_json.stdout)
    assert len(grant["key"]) > 80  # wider than the terminal
    text = grants.stdout.decode()
    assert "…" not in text and folded(text, 1) == [grant["key"]], text
    assert [r[0] for r in cells(text) if r[0]] == [grant["id"]]
    revoked = await hookbus("approvals", "revoke", grant["id"], "--url", nats_url)
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked {grant['key']}" in revoked.stdout.decode()
    again = await hookbus("approvals", "revoke", grant["id"], "--url", nats_url)
    assert again.returncode == 1 and "no grant with id" in again.stderr.decode()
