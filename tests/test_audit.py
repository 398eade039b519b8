"""The decision audit trail: one `DecisionRecord` per decided emit in the hookbus_decisions
stream, and `hookbus decisions` reading it.

A real nats-server (the session's). The stream is shared by the tests, so each test uses
its own agent id and reads that agent's subject only. Workers and dispatchers each have
their own connection, as separate processes would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import nats.js.errors
import pytest
from _answering import answered
from _serving import audited, serving, until_routed
from click.testing import CliRunner
from conftest import Connect, written
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, RetentionPolicy
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from hookbus._core.buckets import stream_config_differences
from hookbus._core.decisions_stream import ensure_decisions_stream
from hookbus._core.kv import release_consumer
from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._auth_files import DEFAULT_TENANT, load_setup
from hookbus.cli._command_tree import cli
from hookbus.cli._connect import auth_ssl_context
from hookbus.cli._decisions_cmd import latency
from hookbus.cli._permissions import inbox_prefix
from hookbus.cli._provision import provision
from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.dispatcher._audit import DecisionLog
from hookbus.schemas import (
    DECISIONS_STREAM,
    DECISIONS_WILDCARD,
    DecisionRecord,
    EmitReply,
    EmitRequest,
    HookResult,
    decisions_stream_config,
    decisions_subject,
    decode,
    emit_service_subject,
    encode,
)

pytestmark = pytest.mark.anyio


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
async def decisions_stream(nc: NATS) -> None:
    """The stream exists on the session's server (a dispatcher pinned to an agent only
    appends to it: an agent's NATS user may not create it)."""
    await ensure_decisions_stream(nc)


@pytest.fixture
def agent() -> str:
    """A fresh agent id per test (its records are on its own subject)."""
    return f"agent-{uuid.uuid4().hex[:10]}"


def emit_trace_id(exporter: InMemorySpanExporter, event: str) -> str:
    found = [s for s in exporter.get_finished_spans() if s.name == f"emit {event}"]
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return format(found[0].context.trace_id, "032x")


async def records(nc: NATS, agent: str | None) -> list[DecisionRecord]:
    """Every record on `agent`'s subject, oldest first (read with an ordered consumer)."""
    js = nc.jetstream()
    subject = decisions_subject(agent)
    try:
        info = await js.stream_info(DECISIONS_STREAM, subjects_filter=subject)
    except nats.js.errors.NotFoundError:
        return []
    count = (info.state.subjects or {}).get(subject, 0)
    if not count:
        return []
    sub = await js.subscribe(subject, stream=DECISIONS_STREAM, ordered_consumer=True)
    try:
        return [decode((await sub.next_msg(timeout=5)).data, DecisionRecord) for _ in range(count)]
    finally:
        await release_consumer(sub)


def then_policy(
    event: str, first: tuple[str, Callable[..., Any]], policy: Callable[..., Any]
) -> tuple[tuple[str, Callable[..., Any], dict[str, Any]], ...]:
    """The `audited` handlers of `event`: `first` ``(name, fn)`` at priority 1, then
    `policy` (named ``policy``, its failure a deny) at priority 2."""
    name, fn = first
    return (
        (event, fn, {"name": name, "priority": 1}),
        (event, policy, {"name": "policy", "priority": 2, "failure_policy": "deny"}),
    )


@asynccontextmanager
async def audited_service(
    connect: Connect, worker_nc: NATS, handler: tuple[str, Callable[..., Any], dict[str, Any]]
) -> AsyncIterator[HookDispatcher]:
    """`handler` ``(event, fn, options naming it)`` served on `worker_nc`, and a
    `DispatcherService` (audit on) on a connection of its own, started; its dispatcher is
    yielded once it routes to the handler. The service stops (1 s grace) on exit."""
    event, _, options = handler
    service_nc = await connect()
    d = HookDispatcher(service_nc)
    service = DispatcherService(d, service_nc, audit=True)
    async with serving(worker_nc, handler):
        await service.start()
        try:
            await until_routed(d, event, [options["name"]])
            yield d
        finally:
            await service.stop(grace_s=1)


def deny(reason: str) -> Callable[..., Awaitable[HookResult]]:
    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason=reason)

    return handler


async def go_on(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="continue")


# -- off by default ---------------------------------------------------------------------------
async def test_off_by_default_nothing_is_written(
    nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async with (
        serving(nc, (event, deny("no"), {"name": "guard"})),
        HookDispatcher(await connect(), agent_id=agent) as d,
    ):
        await until_routed(d, event, ["guard"])
        assert (await d.emit(event, {"tool_name": "bash"})).action == "deny"
        assert d.decision_log is None
        await anyio.sleep(0.2)
    assert await records(nc, agent) == []


# -- one record per decided emit ----------------------------------------------------------------
async def test_a_deny_by_a_remote_worker_is_one_record(
    spans: InMemorySpanExporter, nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    later_calls: list[str] = []

    async def later(ev: str, data: dict[str, Any]) -> None:
        later_calls.append(ev)

    async with audited(
        connect,
        agent,
        nc,
        (event, deny("destructive command"), {"name": "guard", "priority": 1}),
        (event, later, {"name": "later", "priority": 2}),
    ) as d:
        d.set_default_fields(session_id="sess-1")
        before = time.time()
        r = await d.emit(event, {"tool_name": "bash"}, idempotency_key="call-7")
        assert r.action == "deny" and r.decided_by == "guard"
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert later_calls == []
    assert rec.event == event
    assert rec.agent_id == agent and rec.session_id == "sess-1" and rec.tool_name == "bash"
    assert rec.handlers == ["guard"]  # `later` was never called
    assert rec.action == "deny" and rec.decided_by == "guard"
    assert rec.reason == "destructive command"
    assert rec.failures == [] and rec.approver is None
    assert rec.idempotency_key == "call-7"
    assert len(rec.emit_id) == 32 and rec.emit_id != "call-7"  # the emit's own, fresh id
    assert rec.trace_id == emit_trace_id(spans, event)
    assert before <= rec.time <= time.time()
    assert datetime.fromisoformat(rec.time_iso).timestamp() == pytest.approx(rec.time)
    assert len(rec.id) == 32


async def test_a_continue_is_one_record_with_the_handlers_called_in_order(
    spans: InMemorySpanExporter, nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async with (
        serving(
            nc,
            (event, go_on, {"name": "first", "priority": 1}),
            (event, go_on, {"name": "skipped", "priority": 2, "tool_filter": ["python"]}),
            (event, go_on, {"name": "second", "priority": 3}),
        ),
        HookDispatcher(await connect(), audit=True) as d,
    ):
        await until_routed(d, event, ["first", "skipped", "second"])
        r = await d.emit(event, {"tool_name": "bash", "agent_id": agent, "session_id": "s2"})
        assert r.action == "continue"
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert rec.handlers == ["first", "second"]  # the tool filter skipped the middle one
    assert rec.action == "continue" and rec.decided_by is None and rec.reason is None
    assert rec.agent_id == agent and rec.session_id == "s2"
    assert rec.idempotency_key is None and len(rec.emit_id) == 32
    assert rec.trace_id == emit_trace_id(spans, event)


async def test_a_failure_under_deny_policy_is_one_record_with_the_failure(
    spans: InMemorySpanExporter, nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async def broken(ev: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("policy store down")

    async with audited(connect, agent, nc, *then_policy(event, ("audit_ok", go_on), broken)) as d:
        r = await d.emit(event, {"tool_name": "bash"})
        assert r.action == "deny"
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert rec.action == "deny" and rec.decided_by == r.decided_by
    assert rec.handlers == ["audit_ok", "policy"]
    assert [(f.handler, f.kind, f.policy) for f in rec.failures] == [("policy", "error", "deny")]
    assert rec.reason == r.reason
    assert rec.trace_id == emit_trace_id(spans, event)


async def test_the_service_records_its_emits_with_the_agent_of_the_subject(
    nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async with audited_service(connect, nc, (event, deny("no"), {"name": "guard"})) as d:
        msg = await nc.request(
            emit_service_subject(event, agent),
            encode(EmitRequest(data={"tool_name": "sh"}, session_id="s3")),
            timeout=5,
        )
        reply = decode(msg.data, EmitReply)
        assert reply.result is not None and reply.result.action == "deny"
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert (rec.agent_id, rec.session_id, rec.tool_name) == (agent, "s3", "sh")
    assert rec.handlers == ["guard"] and rec.action == "deny"
    assert rec.trace_id is None  # tracing off: no trace id, nothing else changes


async def test_an_answered_approval_records_its_approver(
    nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async def guard(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="Run it?", approval_timeout=10.0)

    agent_d = HookDispatcher(await connect(), audit=True)
    agent_d.register(event, guard)
    approver = ApprovalsClient(await connect())
    async with agent_d, approver:
        data = {"tool_name": "bash", "agent_id": agent, "session_id": "s4"}
        r = await answered(
            approver,
            lambda: agent_d.emit(event, data),
            lambda hook: hook.metadata.get("agent_id") == agent,
            "Allow",
        )
        assert r.action == "continue" and r.approved_by == "alice"
        await written(agent_d, 1)
    [rec] = await records(nc, agent)
    assert (rec.action, rec.approver, rec.decided_by) == ("continue", "alice", "guard")
    assert rec.handlers == ["guard"]


async def test_an_event_without_handlers_is_not_recorded(nc: NATS, event: str, agent: str) -> None:
    async with HookDispatcher(nc, agent_id=agent, audit=True) as d:
        assert (await d.emit(event, {"tool_name": "bash"})).action == "continue"
        log = d.decision_log
        assert log is not None and log.pending == 0
    assert await records(nc, agent) == []


# -- how long each decision took -------------------------------------------------------------
SLEEP_S = 0.05
"""The slow handler's sleep: every record of a call through it took at least 50 ms."""


async def slow_continue(event: str, data: dict[str, Any]) -> HookResult:
    await asyncio.sleep(SLEEP_S)
    return HookResult(action="continue")


async def test_a_record_carries_the_emits_duration_at_least_the_handlers_sleep(
    nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async with audited(connect, agent, nc, (event, slow_continue, {"name": "slow"})) as d:
        started = time.monotonic()
        await d.emit(event, {"tool_name": "ls"})
        took_ms = (time.monotonic() - started) * 1000
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert rec.duration_ms is not None
    assert SLEEP_S * 1000 <= rec.duration_ms <= took_ms  # within the emit call


async def test_the_services_records_carry_the_duration_too(
    nc: NATS, connect: Connect, event: str, agent: str
) -> None:
    async with audited_service(connect, nc, (event, slow_continue, {"name": "slow"})) as d:
        started = time.monotonic()
        await nc.request(emit_service_subject(event, agent), b"{}", timeout=5)
        took_ms = (time.monotonic() - started) * 1000
        await written(d, 1)
    [rec] = await records(nc, agent)
    assert rec.duration_ms is not None
    assert SLEEP_S * 1000 <= rec.duration_ms <= took_ms


OLD_RECORD = {
    "id": "0" * 32, "event": "tool:pre", "action": "deny", "time": 1767225600.0,
    "time_iso": "2026-01-01T00:00:00+00:00", "emit_id": "old-1", "idempotency_key": None,
    "agent_id": None, "session_id": None, "tool_name": "rm", "handlers": ["guard"],
    "decided_by": "guard", "reason": "no", "failures": [], "approver": None, "trace_id": None,
}  # fmt: skip
"""A record as hookbus wrote it before records carried their duration."""


async def test_an_old_record_without_a_duration_still_decodes() -> None:
    rec = decode(json.dumps(OLD_RECORD).encode(), DecisionRecord)
    assert rec.duration_ms is None and rec.emit_id == "old-1" and rec.action == "deny"


# -- an append that fails never changes the decision ---------------------------------------
async def test_records_that_do_not_fit_the_queue_are_dropped_and_logged_by_emit_id(
    nc: NATS, caplog: pytest.LogCaptureFixture, agent: str
) -> None:
    log = DecisionLog(nc, queue_size=2)
    await log.start()
    ids = [f"emit-{i}" for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher.audit"):
        for emit_id in ids:  # no await in between: the publisher cannot take any yet
            log.append("tool:pre", HookResult(action="deny"), emit_id=emit_id, agent_id=agent)
        assert log.dropped == 4
        await log.close()
    assert log.written == 2
    assert [r.emit_id for r in await records(nc, agent)] == ids[:2]
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "hookbus.dispatcher.audit"
    ]  # only the log's own: a meter provider another test shut down warns on its own logger
    assert len(warnings) == 1  # rate-limited: one line naming every dropped emit id
    assert "queue_full 4" in warnings[0]
    assert all(emit_id in warnings[0] for emit_id in ids[2:])


async def test_a_missing_stream_changes_no_decision(
    embedded_server: EmbeddedNatsServer,
    caplog: pytest.LogCaptureFixture,
    event: str,
    agent: str,
) -> None:
    """On a private server without the stream: an agent's dispatcher (pinned) starts at
    once without creating it; its emits decide as before and at once, and the records not
    stored are counted and named, with what to do."""
    worker_nc = await nats.connect(embedded_server.url)
    nc = await nats.connect(embedded_server.url)
    try:
        async with (
            serving(worker_nc, (event, deny("no"), {"name": "guard"})),
            HookDispatcher(nc, agent_id=agent, audit=True) as d,
        ):
            await until_routed(d, event, ["guard"])
            with pytest.raises(nats.js.errors.NotFoundError):
                await nc.jetstream().stream_info(DECISIONS_STREAM)
            with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher.audit"):
                started = time.monotonic()
                results = [await d.emit(event, {}, idempotency_key=f"k{i}") for i in range(3)]
                assert time.monotonic() - started < 2.0  # the emits never waited on the log
                assert [r.action for r in results] == ["deny"] * 3
                log = d.decision_log
                assert log is not None
                await log.close(timeout_s=0.2)
            assert (log.written, log.dropped) == (0, 3)
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "NOT stored" in text
        assert len(re.findall(r"\b[0-9a-f]{32}\b", text.partition("emit ids:")[2])) == 3
        assert f"no stream stores {decisions_subject(agent)}" in text
    finally:
        await nc.close()
        await worker_nc.close()


# -- retention -----------------------------------------------------------------------------------
async def test_retention_is_limits_30_days_1_gib_discard_old(nc: NATS, agent: str) -> None:
    config = decisions_stream_config()
    assert config.name == DECISIONS_STREAM and config.subjects == [DECISIONS_WILDCARD]
    assert config.retention == RetentionPolicy.LIMITS and config.discard == DiscardPolicy.OLD
    assert config.max_age == 30 * 24 * 3600 and config.max_bytes == 1 << 30
    assert config.num_replicas == 1 and config.deny_delete
    custom = decisions_stream_config(max_age_s=3600, max_bytes=1 << 20, replicas=3)
    assert (custom.max_age, custom.max_bytes, custom.num_replicas) == (3600, 1 << 20, 3)
    assert stream_config_differences(config, custom) == [
        "max_bytes: asked 1073741824, stream has 1048576",
        "replicas: asked 1, stream has 3",
        "max_age: asked 2.592e+06 s, stream has 3600 s",
    ]
    log = DecisionLog(nc)  # opens the stream (creates it if this is the first test)
    await log.start()
    await log.close()
    info = await nc.jetstream().stream_info(DECISIONS_STREAM)
    assert stream_config_differences(config, info.config) == []
    assert info.config.deny_delete


# -- hookbus decisions ---------------------------------------------------------------------------
CLI_TIMEOUT_S = 30.0
CLI_ENV = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}


async def hookbus(nats_url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    with anyio.fail_after(CLI_TIMEOUT_S):
        return await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", *args, "--url", nats_url],
            check=False,
            env=CLI_ENV,
        )


def json_lines(p: subprocess.CompletedProcess[bytes]) -> list[dict[str, Any]]:
    assert p.returncode == 0, p.stderr.decode()
    return [json.loads(line) for line in p.stdout.decode().splitlines() if line.strip()]


@pytest.fixture
async def trail(nc: NATS, connect: Connect, event: str, agent: str) -> list[DecisionRecord]:
    """Four decisions of `agent`: deny by `guard` (sessions a, b), continue, and a deny by
    `policy`'s failure; the `guard` denies come from calls on tool ``rm``."""

    async def guard(ev: str, data: dict[str, Any]) -> HookResult:
        if data.get("tool_name") == "rm":
            return HookResult(action="deny", reason="no rm")
        return HookResult(action="continue")

    async def policy(ev: str, data: dict[str, Any]) -> HookResult:
        if data.get("tool_name") == "curl":
            raise RuntimeError("down")
        return HookResult(action="continue")

    async with audited(connect, agent, nc, *then_policy(event, ("guard", guard), policy)) as d:
        for tool, session in (("rm", "a"), ("ls", "a"), ("curl", "b"), ("rm", "b")):
            await d.emit(event, {"tool_name": tool, "session_id": session})
        await written(d, 4)
    got = await records(nc, agent)
    assert [r.action for r in got] == ["deny", "continue", "deny", "deny"]
    return got


async def test_decisions_json_filters_by_agent_action_handler_session(
    nats_url: str, trail: list[DecisionRecord], agent: str
) -> None:
    every = json_lines(await hookbus(nats_url, "decisions", "--agent", agent, "--json"))
    assert [r["emit_id"] for r in every] == [r.emit_id for r in trail]
    assert every[0]["agent_id"] == agent and every[0]["handlers"] == ["guard"]
    assert every[0]["reason"] == "no rm" and every[0]["failures"] == []

    denies = json_lines(
        await hookbus(nats_url, "decisions", "--agent", agent, "--action", "deny", "--json")
    )
    assert [r["emit_id"] for r in denies] == [trail[i].emit_id for i in (0, 2, 3)]

    by_policy = json_lines(
        await hookbus(nats_url, "decisions", "--agent", agent, "--handler", "policy", "--json")
    )
    assert [r["emit_id"] for r in by_policy] == [trail[i].emit_id for i in (1, 2)]
    assert by_policy[1]["failures"][0]["kind"] == "error"

    session_b = json_lines(
        await hookbus(
            nats_url, "decisions", "--agent", agent, "--session", "b", "--limit", "1", "--json"
        )
    )
    assert [r["emit_id"] for r in session_b] == [trail[3].emit_id]  # the most recent one

    other = json_lines(await hookbus(nats_url, "decisions", "--agent", f"x{agent}", "--json"))
    assert other == []


async def test_decisions_table_shows_whole_identifiers(
    nats_url: str, trail: list[DecisionRecord], agent: str
) -> None:
    p = await hookbus(nats_url, "decisions", "--agent", agent, "--action", "deny")
    assert p.returncode == 0, p.stderr.decode()
    text = p.stdout.decode()
    for r in (trail[0], trail[2], trail[3]):
        assert r.emit_id in text
    assert trail[1].emit_id not in text  # the continue is filtered out
    assert agent in text and "guard" in text and "policy:error:deny" in text


async def test_decisions_shows_each_decisions_latency_and_a_dash_for_old_records(
    nc: NATS, connect: Connect, nats_url: str, event: str, agent: str
) -> None:
    await nc.jetstream().publish(
        decisions_subject(agent), json.dumps({**OLD_RECORD, "agent_id": agent}).encode()
    )
    async with audited(connect, agent, nc, (event, slow_continue, {"name": "slow"})) as d:
        await d.emit(event, {"tool_name": "ls"}, idempotency_key="slow-1")
        await written(d, 1)
    old, new = json_lines(await hookbus(nats_url, "decisions", "--agent", agent, "--json"))
    assert old["emit_id"] == "old-1" and old["duration_ms"] is None
    assert new["idempotency_key"] == "slow-1" and new["duration_ms"] >= SLEEP_S * 1000

    shown = latency(new["duration_ms"])
    assert shown.endswith("ms") and float(shown[:-2]) >= SLEEP_S * 1000
    p = await hookbus(nats_url, "decisions", "--agent", agent)
    assert p.returncode == 0, p.stderr.decode()
    header, rows = _table(p.stdout.decode())
    assert "latency" in header
    col = header.index("latency")
    assert {r[header.index("emit id")]: r[col] for r in rows} == {
        "old-1": "-",
        new["emit_id"]: shown,
    }


def _table(text: str) -> tuple[list[str], list[list[str]]]:
    """A rich table's header and rows, each as a list of stripped cells."""
    lines = [ln for ln in text.splitlines() if ln.count("│") > 2 or ln.count("┃") > 2]
    cells = [[c.strip() for c in re.split("[│┃]", ln)[1:-1]] for ln in lines]
    return cells[0], cells[1:]


async def test_latency_is_written_for_people() -> None:
    assert [latency(v) for v in (None, 0.0, 12.345, 999.94, 1500.0, 61_000.0, 187_400.0)] == [
        "-", "0.0ms", "12.3ms", "999.9ms", "1.50s", "1m01s", "3m07s",
    ]  # fmt: skip


async def test_decisions_without_the_stream_is_a_clear_error(
    embedded_server: EmbeddedNatsServer,
) -> None:
    p = await hookbus(embedded_server.url, "decisions")
    assert p.returncode == 1
    assert "hookbus_decisions stream does not exist" in p.stderr.decode()
    assert "Traceback" not in p.stderr.decode()


async def test_decisions_follow_prints_new_records_and_stops_cleanly_on_ctrl_c(
    nc: NATS, connect: Connect, nats_url: str, event: str, agent: str
) -> None:
    js = nc.jetstream()
    async with audited(connect, agent, nc, (event, deny("no"), {"name": "guard"})) as d:
        await d.emit(event, {"tool_name": "rm"}, idempotency_key="before")
        await written(d, 1)
        consumers = (await js.stream_info(DECISIONS_STREAM)).state.consumer_count
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "hookbus.cli", "decisions", "--agent", agent),
            *("--follow", "--json", "--url", nats_url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=CLI_ENV,
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            with anyio.fail_after(CLI_TIMEOUT_S):
                first = json.loads(await proc.stdout.readline())
            assert first["idempotency_key"] == "before"  # the backlog, then it waits for more
            await d.emit(event, {"tool_name": "rm"}, idempotency_key="after")
            with anyio.fail_after(CLI_TIMEOUT_S):
                second = json.loads(await proc.stdout.readline())
            assert second["idempotency_key"] == "after" and second["action"] == "deny"
            proc.send_signal(signal.SIGINT)
            with anyio.fail_after(CLI_TIMEOUT_S):
                rest, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert "Traceback" not in err.decode() and rest == b""
    # the ordered consumer was deleted on exit, not left for its inactive threshold
    assert (await js.stream_info(DECISIONS_STREAM)).state.consumer_count == consumers


# -- on a server with the generated permissions ---------------------------------------------
async def test_on_a_secured_server_the_service_and_the_agent_write_and_only_auditors_read(
    tmp_path: Path,
) -> None:
    """`hookbus auth init` users: the admin provisions the stream, the dispatcher service
    records the agent's service emits; the agent's own pinned dispatcher (an embedded
    agent) appends its embedded emits;
    the auditor reads both with `hookbus decisions --nkey`; the agent may not read them."""
    out = tmp_path / "auth"
    init = CliRunner().invoke(
        cli, ["auth", "init", "--out", str(out), "--embedded-agent", "payments",
              "--auditor", "audit"],
    )  # fmt: skip
    assert init.exit_code == 0, init.output
    setup = load_setup(out)

    def seed(role: str, name: str) -> str:
        who = setup.find(DEFAULT_TENANT, role, name)
        assert who is not None
        return str(who.seed_path(out))

    async def connect_as(role: str, name: str) -> NATS:
        who = setup.find(DEFAULT_TENANT, role, name)
        assert who is not None
        return await nats.connect(
            url,
            nkeys_seed=str(who.seed_path(out)),
            inbox_prefix=inbox_prefix(who.public_key),
            allow_reconnect=False,
            tls=auth_ssl_context(out),  # auth init's CA (TLS by default)
        )

    event = f"test:{uuid.uuid4().hex[:8]}"
    with EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1) as server:
        url = server.url
        admin_nc = await connect_as("admin", "admin")
        await provision(admin_nc)  # only the admin may create the stream and the buckets
        await admin_nc.close()
        service_nc, agent_nc = await connect_as("dispatcher", "dispatcher"), None
        try:
            d = HookDispatcher(service_nc)
            d.register(event, deny("by the service"), name="guard")
            service = DispatcherService(d, service_nc, audit=True)
            await service.start()
            agent_nc = await connect_as("agent", "payments")
            reply = decode(
                (
                    await agent_nc.request(
                        emit_service_subject(event, "payments"),
                        encode(EmitRequest(data={"tool_name": "bash"})),
                        timeout=5,
                    )
                ).data,
                EmitReply,
            )
            assert reply.result is not None and reply.result.action == "deny"
            await written(d, 1)
            own = HookDispatcher(agent_nc, agent_id="payments", audit=True)
            own.register(event, deny("in the agent"), name="local_guard")
            async with own:
                assert (await own.emit(event, {"tool_name": "sh"})).action == "deny"
                await written(own, 1)
            await service.stop(grace_s=1)
        finally:
            for conn in (service_nc, agent_nc):
                if conn is not None:
                    await conn.close()

        auditor = await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", "decisions", "--json",
             "--url", url, "--nkey", seed("auditor", "audit")],
            check=False, env=CLI_ENV,
        )  # fmt: skip
        got = json_lines(auditor)
        assert [(r["agent_id"], r["decided_by"], r["tool_name"]) for r in got] == [
            ("payments", "guard", "bash"),
            ("payments", "local_guard", "sh"),
        ]
        refused = await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", "decisions",
             "--url", url, "--nkey", seed("agent", "payments")],
            check=False, env=CLI_ENV,
        )  # fmt: skip
        assert refused.returncode == 1 and refused.stdout == b""
        text = refused.stderr.decode()  # the refusal, in one line, naming the identity
        assert "NATS refused publish to $JS.API.STREAM.INFO.hookbus_decisions" in text, text
        assert "(agent payments)" in text and len(text.strip().splitlines()) == 1, text
        assert "Traceback" not in refused.stderr.decode()
