"""`hookbus tail`: the decision audit trail followed live, as a real subprocess.

A real nats-server (the session's), a `HookWorker` policy (`guard` denies ``rm``, lets the
rest continue) and a `HookDispatcher` with the audit trail on. The stream is shared by the
tests, so each test uses its own agent id and tails with ``--agent``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from _serving import audited
from conftest import Connect, written
from nats.aio.client import Client as NATS

from hookbus._core.decisions_stream import ensure_decisions_stream
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult, decisions_subject

pytestmark = pytest.mark.anyio

TIMEOUT_S = 20.0
ENV = {**os.environ, "NO_COLOR": "1"}


@pytest.fixture
def agent() -> str:
    return f"agent-{uuid.uuid4().hex[:10]}"


async def guard(event: str, data: dict[str, Any]) -> HookResult:
    if data.get("tool_name") == "rm":
        return HookResult(action="deny", reason="no rm")
    return HookResult(action="continue")


@pytest.fixture
async def dispatcher(
    nc: NATS, connect: Connect, event: str, agent: str
) -> AsyncIterator[HookDispatcher]:
    """An audited dispatcher for `agent`, `guard` routed on `event`."""
    await ensure_decisions_stream(nc)
    async with audited(connect, agent, nc, (event, guard, {"name": "guard"})) as d:
        yield d


@contextlib.asynccontextmanager
async def tail(url: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """`hookbus tail ARGS --url URL`, started and following (its stderr banner read)."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "hookbus.cli", "tail", *args, "--url", url),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=ENV,
    )
    try:
        assert proc.stderr is not None
        with anyio.fail_after(TIMEOUT_S):
            banner = await proc.stderr.readline()
        assert b"following" in banner, banner
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    with anyio.fail_after(TIMEOUT_S):
        return (await proc.stdout.readline()).decode()


async def ctrl_c(proc: asyncio.subprocess.Process) -> tuple[bytes, str]:
    """SIGINT; the rest of its stdout and its stderr once it ended (exit 0, no traceback)."""
    proc.send_signal(signal.SIGINT)
    with anyio.fail_after(TIMEOUT_S):
        rest, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode()
    return rest, err.decode()


async def test_new_decisions_only_one_line_each_then_ctrl_c_exits_0(
    nats_url: str, dispatcher: HookDispatcher, event: str, agent: str
) -> None:
    await dispatcher.emit(event, {"tool_name": "rm"}, idempotency_key="before")
    await written(dispatcher, 1)
    async with tail(nats_url, "--agent", agent) as proc:
        await dispatcher.emit(event, {"tool_name": "ls"})
        first = (await line(proc)).split()
        await dispatcher.emit(event, {"tool_name": "rm"})
        second = (await line(proc)).split()
        rest, _ = await ctrl_c(proc)
    # time, event, agent, tool, action, latency, decided_by; the earlier deny is not shown
    assert first[1:5] == [event, agent, "ls", "continue"]
    assert [*second[1:5], second[6]] == [event, agent, "rm", "deny", "guard"]
    assert second[0].endswith("Z") and second[0].count(":") == 2
    assert second[5].endswith("ms") and float(second[5][:-2]) >= 0
    assert rest == b""


async def test_action_filter_shows_only_denies(
    nats_url: str, dispatcher: HookDispatcher, event: str, agent: str
) -> None:
    async with tail(nats_url, "--agent", agent, "--action", "deny") as proc:
        for tool in ("ls", "cat", "rm", "ls"):
            await dispatcher.emit(event, {"tool_name": tool})
        await written(dispatcher, 4)
        only = (await line(proc)).split()
        await asyncio.sleep(0.5)  # time for a wrongly printed continue to arrive
        rest, _ = await ctrl_c(proc)
    assert [*only[1:5], only[6]] == [event, agent, "rm", "deny", "guard"]
    assert rest == b""


async def test_last_n_then_new_ones_as_json(
    nats_url: str, dispatcher: HookDispatcher, event: str, agent: str
) -> None:
    for key in ("one", "two", "three"):
        await dispatcher.emit(event, {"tool_name": "rm"}, idempotency_key=key)
    await written(dispatcher, 3)
    async with tail(nats_url, "--agent", agent, "--last", "2", "--json") as proc:
        backlog = [json.loads(await line(proc)) for _ in range(2)]
        await dispatcher.emit(event, {"tool_name": "ls"}, idempotency_key="four")
        new = json.loads(await line(proc))
        await ctrl_c(proc)
    assert [r["idempotency_key"] for r in backlog] == ["two", "three"]
    assert new["idempotency_key"] == "four" and new["action"] == "continue"
    assert new["handlers"] == ["guard"] and new["agent_id"] == agent


SLEEP_S = 0.05


async def test_the_latency_column_is_at_least_the_handlers_sleep_and_json_has_it(
    nats_url: str, nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async def slow(event: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(SLEEP_S)
        return HookResult(action="continue")

    await ensure_decisions_stream(nc)
    async with audited(connect, agent, nc, (event, slow, {"name": "slow"})) as d:
        async with tail(nats_url, "--agent", agent) as proc:
            await d.emit(event, {"tool_name": "ls"})
            cells = (await line(proc)).split()
            await ctrl_c(proc)
        async with tail(nats_url, "--agent", agent, "--last", "1", "--json") as proc:
            record = json.loads(await line(proc))
            await ctrl_c(proc)
    assert cells[1:5] == [event, agent, "ls", "continue"] and cells[6] == "-"  # no decider
    assert cells[5].endswith("ms") and float(cells[5][:-2]) >= SLEEP_S * 1000
    assert record["duration_ms"] >= SLEEP_S * 1000


async def test_a_record_without_a_duration_shows_a_dash(
    nats_url: str, nc: NATS, agent: str
) -> None:
    """Records written before the duration was recorded have none: ``-`` in its column."""
    await ensure_decisions_stream(nc)
    old = {
        "id": uuid.uuid4().hex, "event": "tool:pre", "action": "deny", "time": 1767225600.0,
        "time_iso": "2026-01-01T00:00:00+00:00", "emit_id": "old-1", "idempotency_key": None,
        "agent_id": agent, "session_id": None, "tool_name": "rm", "handlers": ["guard"],
        "decided_by": "guard", "reason": "no", "failures": [], "approver": None,
        "trace_id": None,
    }  # fmt: skip
    await nc.jetstream().publish(decisions_subject(agent), json.dumps(old).encode())
    async with tail(nats_url, "--agent", agent, "--last", "1") as proc:
        cells = (await line(proc)).split()
        await ctrl_c(proc)
    assert cells == ["00:00:00.000Z", "tool:pre", agent, "rm", "deny", "-", "guard"]


async def test_without_the_stream_one_line_says_to_run_the_dispatcher_with_audit(
    embedded_server: EmbeddedNatsServer,
) -> None:
    with anyio.fail_after(TIMEOUT_S):
        p = await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", "tail", "--url", embedded_server.url],
            check=False,
            env=ENV,
        )
    err = p.stderr.decode()
    assert p.returncode == 1
    assert len(err.strip().splitlines()) == 1, err
    assert "hookbus_decisions stream does not exist" in err and "--audit" in err
    assert "Traceback" not in err
