"""The HTTP gateway (`hookbus gateway http|aos`, `hookbus.integrations.gateway`).

Everything is real: a private nats-server per test (the doors emit standard events such as
``tool:pre``, so declarations must not leak between tests), `HookWorker` handlers on their
own connections, the gateway served by uvicorn on a free port (in this process, or as the
``hookbus gateway`` subprocess), and HTTP over loopback with httpx or raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trustme
from _integration_kit import Connect, private_connect
from _otlp_receiver import OtlpReceiver
from _served_app import served
from _served_process import HOOKBUS, ServedProcess
from click.testing import CliRunner
from nats.aio.client import Client as NATS
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._command_tree import cli
from hookbus.cli._gateway_cmd import Replica
from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.integrations.claude_code import ClaudeCodeOptions
from hookbus.integrations.gateway import gateway_app
from hookbus.schemas import TOOL_PRE, HookResult
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

"""The installed console script (``.venv/bin/hookbus``), as an operator runs it."""
TOKEN = "gw-test-token-8d1f"


# -- fixtures and helpers --------------------------------------------------------------------
connect = private_connect


def pre_tool_use(command: str, **extra: Any) -> dict[str, Any]:
    """A Claude Code PreToolUse hook input for the Bash tool."""
    return {
        "session_id": "sess-gw",
        "transcript_path": "/tmp/t.jsonl",
        "cwd": "/work",
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": "Bash",
        "tool_input": {"command": command},
        **extra,
    }


AOS_TOOL_CALL = json.loads(
    (Path(__file__).parent / "fixtures" / "aos" / "tool_call_request.json").read_text()
)


def aos_tool_call(command: str, request_id: str | None = "req-1") -> dict[str, Any]:
    """An OWASP AOS ``steps/toolCallRequest`` of the Bash tool (no id: a notification)."""
    doc = json.loads(json.dumps(AOS_TOOL_CALL))
    doc["params"]["toolCallRequest"]["toolId"] = "Bash"
    doc["params"]["toolCallRequest"]["inputs"] = [{"name": "command", "value": command}]
    doc.pop("id", None)
    if request_id is not None:
        doc["id"] = request_id
    return doc


def policy_worker(conn: NATS, seen: list[str] | None = None, label: str = "w") -> HookWorker:
    """``tool:pre`` policy: ``rm -rf`` is denied, ``ls`` is rewritten, the rest goes on.
    Each call appends `label` to `seen` (which replica of the queue group answered)."""
    w = HookWorker(conn)

    @w.handler(TOOL_PRE, failure_policy="deny")
    async def policy(event: str, data: dict[str, Any]) -> HookResult:
        if seen is not None:
            seen.append(label)
        command = str(data.get("tool_input", {}).get("command", ""))
        if "rm -rf" in command:
            return HookResult(action="deny", reason="destructive command")
        if command == "ls":
            return HookResult(
                action="modify", data={**data, "tool_input": {"command": "ls --color=never"}}
            )
        return HookResult(action="continue")

    return w


@contextlib.asynccontextmanager
async def replica(
    connect: Connect, *, approvals: bool = False, **app_options: Any
) -> AsyncIterator[tuple[str, Replica]]:
    """A gateway replica in this process: its own connection and strict `HookDispatcher`,
    the app of `gateway_app` served by uvicorn; yields (URL, replica)."""
    nc = await connect()
    r = Replica(nc, HookDispatcher(nc, strict_events=True, approvals=approvals))
    await r.dispatcher.start()
    app = gateway_app(r.emit, ready=r.ready, lifespan=r.lifespan, **app_options)
    async with served(app) as url:
        yield url, r


class GatewayProcess(ServedProcess):
    """``hookbus gateway <kind> --port 0 ...`` as a subprocess; `url` once it serves."""

    def __init__(self, kind: str, *args: str, env: dict[str, str] | None = None) -> None:
        super().__init__(
            ["gateway", kind, "--port", "0", *args], banner="hookbus gateway serving ", env=env
        )


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.asynccontextmanager
async def token_gateway(
    door: str, connect: Connect, nats_url: str
) -> AsyncIterator[tuple[GatewayProcess, httpx.AsyncClient]]:
    """``hookbus gateway <door>`` on `nats_url` with the bearer token `TOKEN`, and a client
    of it that sends the token, while a `policy_worker` serves on a connection of its own."""
    async with (
        policy_worker(await connect()),
        GatewayProcess(door, "--url", nats_url, env={"HOOKBUS_GATEWAY_TOKEN": TOKEN}) as gw,
        httpx.AsyncClient(base_url=gw.url, headers=bearer(), timeout=10) as http,
    ):
        yield gw, http


async def raw_exchange(url: str, head: bytes, chunks: list[bytes]) -> bytes:
    """Send `head`, then `chunks` one by one, reading after each: what the server answered
    (before the rest was sent, if it answered early)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        for chunk in [b"", *chunks]:
            if chunk:
                writer.write(chunk)
                await writer.drain()
            try:
                with anyio.fail_after(0.5):
                    data = await reader.read(65536)
            except TimeoutError:
                continue
            return data
        return b""
    finally:
        writer.close()


# -- the Claude Code door through the real CLI -----------------------------------------------
async def test_cli_gateway_answers_claude_code_on_both_urls(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    async with token_gateway("http", connect, embedded_server.url) as (gw, http):
        assert gw.url.startswith("http://127.0.0.1:")
        assert "doors: claude-code; auth: bearer token" in gw.stderr
        denied = pre_tool_use("rm -rf /")
        for path in ("/claude-code", "/claude-code/PreToolUse"):
            r = await http.post(path, json=denied)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "application/json"
            assert r.json() == {
                "hookSpecificOutput": {
                    "hookEventName": "PreToolUse",
                    "permissionDecision": "deny",
                    "permissionDecisionReason": "destructive command",
                }
            }
        modified = (await http.post("/claude-code/PreToolUse", json=pre_tool_use("ls"))).json()
        specific = modified["hookSpecificOutput"]
        assert specific["updatedInput"] == {"command": "ls --color=never"}
        allowed = await http.post("/claude-code", json=pre_tool_use("git status"))
        assert (allowed.status_code, allowed.content) == (200, b"")  # no opinion
        # one URL per event: a body of another event is a non-blocking error (not 2xx)
        other = await http.post("/claude-code/PostToolUse", json=denied)
        assert other.status_code == 400
        assert "PreToolUse" in other.text and "PostToolUse" in other.text
        # bad input: a clear non-blocking error, never a 500
        bad = await http.post("/claude-code", content=b"{not json")
        assert bad.status_code == 400 and "not JSON" in bad.text
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        assert (await http.get("/readyz")).json() == {"status": "ready"}
        assert (await http.post("/aos", json={})).status_code == 404  # not a door of `http`
        code = await gw.stop()
    assert code == 0, gw.stderr
    assert "Traceback" not in gw.stderr
    assert TOKEN not in gw.stderr


async def test_cli_gateway_aos_answers_tool_calls(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    async with token_gateway("aos", connect, embedded_server.url) as (gw, http):
        assert "doors: aos;" in gw.stderr
        denied = await http.post("/aos", json=aos_tool_call("rm -rf /", "req-deny"))
        modified = await http.post("/aos", json=aos_tool_call("ls", "req-modify"))
        allowed = await http.post("/aos", json=aos_tool_call("git status", "req-allow"))
        notification = await http.post("/aos", json=aos_tool_call("rm -rf /", None))
        garbage = await http.post("/aos", content=b"{not json")
        unauthorized = await http.post("/aos", json=aos_tool_call("ls"), headers=bearer("no"))
        not_a_door = await http.post("/claude-code", json=pre_tool_use("ls"))
        code = await gw.stop()
    assert denied.status_code == 200 and denied.headers["content-type"] == "application/json"
    assert denied.json()["id"] == "req-deny"
    assert denied.json()["result"]["decision"] == "deny"
    assert denied.json()["result"]["message"] == "destructive command"
    result = modified.json()["result"]
    assert result["decision"] == "modify"
    call = result["modifiedRequest"]["params"]["toolCallRequest"]
    assert call["inputs"] == [{"name": "command", "value": "ls --color=never"}]
    assert allowed.json()["result"]["decision"] == "allow"
    assert (notification.status_code, notification.content) == (204, b"")
    assert garbage.status_code == 200 and garbage.json()["error"]["code"] == -32700
    assert unauthorized.status_code == 401
    assert not_a_door.status_code == 404
    assert code == 0, gw.stderr
    assert "Traceback" not in gw.stderr


async def test_a_claude_code_request_without_the_token_is_denied_not_401(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """Claude Code runs the tool on any non-2xx answer of an HTTP hook, so a missing or
    wrong token is answered 200 with the event's fallback (PreToolUse: deny), and nothing
    is emitted. The AOS door answers 401 (see the AOS test)."""
    seen: list[str] = []
    async with (
        policy_worker(await connect(), seen),
        replica(connect, token=TOKEN) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        body = pre_tool_use("git status")
        missing = await http.post("/claude-code", json=body)
        wrong = await http.post("/claude-code/PreToolUse", json=body, headers=bearer("not-it"))
        basic_auth = {"Authorization": f"Basic {TOKEN}"}
        basic = await http.post("/claude-code", json=body, headers=basic_auth)
        stop = {**body, "hook_event_name": "Stop", "stop_hook_active": False}
        for key in ("tool_name", "tool_input"):
            stop.pop(key)
        stopped = await http.post("/claude-code", json=stop, headers=bearer("not-it"))
        assert seen == []  # nothing reached the policy
        right = await http.post("/claude-code", json=body, headers=bearer())
        probes = [(await http.get(p)).status_code for p in ("/healthz", "/readyz")]
    for refused in (missing, wrong, basic):
        assert refused.status_code == 200
        out = refused.json()
        assert out["hookSpecificOutput"]["permissionDecision"] == "deny"
        assert "bearer token is missing or not accepted" in out["systemMessage"]
    assert stopped.status_code == 200  # Stop's fallback is no opinion: the refusal is told
    assert stopped.json() == {
        "systemMessage": "hookbus unavailable (unauthorized: the gateway's bearer token is"
        " missing or not accepted); Stop answered by the fallback: none"
    }
    assert (right.status_code, right.content) == (200, b"")  # allowed: no opinion
    assert seen == ["w"]
    assert probes == [200, 200]  # the probes need no token


async def test_an_oversize_claude_code_body_is_denied_before_it_is_read(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """A body over the limit is not read whole, and (Claude Code running the tool on a
    413) answered 200 with the event's fallback: the event from the URL, else from the part
    read before the limit; a request that names no event stops Claude. Nothing is emitted."""
    seen: list[str] = []
    async with (
        policy_worker(await connect(), seen),
        replica(connect, max_body_bytes=1000) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        big = pre_tool_use("echo " + "x" * 2000)
        r = await http.post("/claude-code/PreToolUse", json=big)
        shared = await http.post("/claude-code", json=big)  # Content-Length alone: no event
        assert seen == []
        fits = await http.post("/claude-code", json=pre_tool_use("rm -rf /"))
        # Content-Length over the limit: answered at once, with 500 of 10 MB sent
        head = (
            b"POST /claude-code/PreToolUse HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n"
        )
        early = await raw_exchange(url, head, [b"{" * 500])
        # chunked: refused as soon as the count passes the limit, the stream still open
        head = b"POST /claude-code HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"258\r\n" + b" " * 600 + b"\r\n"  # 600 bytes per chunk
        chunked = await raw_exchange(url, head, [chunk] * 20)
        bad_length = await raw_exchange(
            url, b"POST /claude-code HTTP/1.1\r\nHost: t\r\nContent-Length: -5\r\n\r\n", []
        )
    assert r.status_code == 200
    assert r.json()["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert "payload_too_large: the body is over 1000 bytes" in r.json()["systemMessage"]
    assert shared.status_code == 200 and shared.json()["continue"] is False
    assert fits.status_code == 200 and seen == ["w"]
    assert early.startswith(b"HTTP/1.1 200 "), early
    assert b'"permissionDecision":"deny"' in early
    assert chunked.startswith(b"HTTP/1.1 200 "), chunked
    assert b'"continue":false' in chunked  # no event named: Claude stops
    # not HTTP at all: the server's parser answers 400 before the app sees it
    assert bad_length.startswith(b"HTTP/1.1 400 "), bad_length


async def test_the_aos_door_answers_refusals_with_http_statuses(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    async with (
        policy_worker(await connect()),
        replica(connect, token=TOKEN, max_body_bytes=1000) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        call = aos_tool_call("ls", "req-1")
        missing = await http.post("/aos", json=call)
        wrong = await http.post("/aos", json=call, headers=bearer("not-it"))
        big = await http.post("/aos", json=aos_tool_call("x" * 2000, "req-2"), headers=bearer())
    # the HTTP statuses, each with a JSON-RPC error response (id null: the body was not read)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == 'Bearer realm="hookbus"'
    assert missing.json()["id"] is None and missing.json()["error"]["code"] == -32600
    assert missing.json()["error"]["data"]["reason"] == "unauthorized"
    assert "Authorization: Bearer" in missing.json()["error"]["data"]["detail"]
    assert wrong.status_code == 401
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    assert wrong.json()["error"]["data"]["detail"] == "the bearer token is not accepted"
    assert big.status_code == 413 and big.headers["content-type"] == "application/json"
    assert big.json() == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {
            "code": -32600,
            "message": "Request payload validation error",
            "data": {
                "detail": "the body is over 1000 bytes",
                "reason": "payload_too_large",
                "maxBytes": 1000,
            },
        },
    }


async def test_two_replicas_share_the_workers(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """Two gateway replicas (ports of their own, connections of their own) answer from
    the same two worker replicas (one queue group): every answer is right, and both
    workers took calls."""
    seen: list[str] = []
    async with (
        policy_worker(await connect(), seen, "w1"),
        policy_worker(await connect(), seen, "w2"),
        replica(connect) as (url_a, _),
        replica(connect) as (url_b, _),
        httpx.AsyncClient(timeout=10) as http,
    ):
        assert url_a != url_b
        answers = []
        for i in range(40):
            url = (url_a, url_b)[i % 2]
            command = "rm -rf /" if i % 4 < 2 else "git status"
            r = await http.post(f"{url}/claude-code", json=pre_tool_use(command))
            answers.append((url, command, r.status_code, r.content))
            aos = await http.post(f"{url}/aos", json=aos_tool_call(command, f"r{i}"))
            assert aos.status_code == 200
            expected = "deny" if command == "rm -rf /" else "allow"
            assert (aos.json()["id"], aos.json()["result"]["decision"]) == (f"r{i}", expected)
    for _, command, status, content in answers:
        assert status == 200
        if command == "rm -rf /":
            assert json.loads(content)["hookSpecificOutput"]["permissionDecision"] == "deny"
        else:
            assert content == b""
    assert {url for url, *_ in answers} == {url_a, url_b}
    assert len(seen) == 80 and set(seen) == {"w1", "w2"}


async def test_a_retry_on_another_replica_finds_the_same_approval(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """Replicas keep no state: an AOS request whose approval is pending on replica A is
    retried on replica B (the caller gave up on A); B finds the same approval (one pending
    record, not two), and the approver's answer decides B's reply. A's decision ended when
    its caller disconnected: an "Allow" allows one decision, and it must be the one read."""
    w = HookWorker(await connect())

    @w.handler(TOOL_PRE)
    async def gate(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="Run it?", approval_timeout=20)

    approver = ApprovalsClient(await connect())
    request = aos_tool_call("make deploy", "req-ask")
    async with (
        w,
        approver,
        replica(connect, approvals=True, aos_timeout_s=20) as (url_a, _),
        replica(connect, approvals=True, aos_timeout_s=20) as (url_b, _),
        httpx.AsyncClient(timeout=20) as http,
    ):
        events = await approver.events()
        first = asyncio.create_task(http.post(f"{url_a}/aos", json=request))
        with anyio.fail_after(10):
            pending = (await events.__anext__()).hook
        first.cancel()  # the caller gives up on replica A ...
        retry = asyncio.create_task(http.post(f"{url_b}/aos", json=request))  # ... tries B
        await asyncio.sleep(0.5)  # B is waiting on the same approval by now
        await approver.answer_approval(
            pending.label, "Allow", approver="alice", agent_id=pending.agent_id
        )
        with anyio.fail_after(10):
            answered = await retry
        seen = []
        with contextlib.suppress(TimeoutError), anyio.fail_after(1):
            async for ev in events:
                seen.append(ev.hook)
        await events.aclose()
    assert pending.status == "pending"
    result = answered.json()["result"]
    assert result["decision"] == "allow", result
    assert "approved_by:alice" in result["reasonCode"]
    assert [h.status for h in seen if h.status == "pending"] == []  # no second approval
    assert {h.label for h in seen} <= {pending.label}


async def test_the_claude_code_doors_approval_ends_within_its_wait(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """The handler's approval waits 60 s; the gateway's Claude Code door waits 3 s. Nobody
    answering, the approval ends with its default deny at the door's wait less a fifth
    (2.4 s): the door's answer is that deny, before its wait ends, and the record is closed,
    not left pending behind it."""
    w = HookWorker(await connect())

    @w.handler(TOOL_PRE)
    async def gate(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_prompt="Run it?", approval_timeout=60,
            approval_default="deny",
        )  # fmt: skip

    options = ClaudeCodeOptions(on_ask_user="approval", timeout_s=3)
    async with (
        w,
        replica(connect, approvals=True, claude_code_options=options) as (url, _),
        httpx.AsyncClient(timeout=30) as http,
    ):
        started = time.monotonic()
        reply = await http.post(f"{url}/claude-code/PreToolUse", json=pre_tool_use("deploy"))
        took = time.monotonic() - started
        async with ApprovalsClient(await connect()) as client:
            page = await client.approval_page(status=None)
    assert reply.status_code == 200
    assert reply.json() == {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": "timed out after 2.4s; default deny",
        }
    }
    assert took < 3 + 10  # far below the handler's 60 s (the door's own bound is 3 + 2 s)
    assert [(r.status, r.reason) for r in page.records] == [
        ("cancelled", "timed out after 2.4s; default deny applied")
    ]


# -- trace context ---------------------------------------------------------------------------
def ancestors(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[int]:
    """Span ids from `span`'s parent up, as far as the parents are known (the last one
    may be a remote parent: the caller's span)."""
    out = []
    parent = span.parent
    while parent is not None:
        out.append(parent.span_id)
        up = by_id.get(parent.span_id)
        parent = up.parent if up is not None else None
    return out


async def test_traceparent_is_continued(
    spans: InMemorySpanExporter, connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    trace_id = 0x4BF92F3577B34DA6A3CE929D0E0E4736
    caller_span = 0x00F067AA0BA902B7
    headers = {
        "traceparent": f"00-{trace_id:032x}-{caller_span:016x}-01",
        "tracestate": "vendor=abc",
    }
    async with (
        policy_worker(await connect()),
        replica(connect) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        r = await http.post("/claude-code", json=pre_tool_use("rm -rf /"), headers=headers)
        untraced = await http.post("/claude-code", json=pre_tool_use("rm -rf /"))
    assert r.status_code == untraced.status_code == 200
    finished = list(spans.get_finished_spans())
    emits = [s for s in finished if s.name == f"emit {TOOL_PRE}"]
    assert len(emits) == 2
    traced = [s for s in emits if s.context.trace_id == trace_id]
    assert len(traced) == 1, [f"{s.context.trace_id:032x}" for s in emits]
    emit = traced[0]
    by_id = {s.context.span_id: s for s in finished}
    chain = ancestors(emit, by_id)
    assert chain[-1] == caller_span
    server = by_id[chain[0]]
    assert server.kind is SpanKind.SERVER and server.name == "POST /claude-code"
    assert server.attributes["http.response.status_code"] == 200
    assert server.context.trace_state.get("vendor") == "abc"
    # the worker's span, across NATS, is in the same trace
    process = [s for s in finished if s.name.startswith("process ")]
    assert {s.context.trace_id for s in process} >= {trace_id}
    # without a traceparent, the request starts a trace of its own
    other = next(s for s in emits if s is not emit)
    assert other.context.trace_id != trace_id


async def test_cli_gateway_exports_the_callers_trace(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    """``hookbus gateway --otlp-endpoint``: the request's SERVER span and the emit's span,
    exported by the gateway process, continue the caller's trace."""
    trace_id, caller = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    with OtlpReceiver() as rx:
        async with (
            policy_worker(await connect()),
            GatewayProcess("http", "--url", embedded_server.url, "--otlp-endpoint", rx.url) as gw,
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            r = await http.post(
                "/claude-code/PreToolUse",
                json=pre_tool_use("rm -rf /"),
                headers={"traceparent": f"00-{trace_id}-{caller}-01"},
            )
            code = await gw.stop()  # flushes the exporter
        spans = [s for s in rx.spans if s.trace_id == trace_id]
    assert r.status_code == 200 and code == 0, gw.stderr
    (server,) = [s for s in spans if s.kind == "SERVER"]
    assert server.name == "POST /claude-code/{hook_event_name}"
    assert server.parent_span_id == caller
    assert server.attributes["url.path"] == "/claude-code/PreToolUse"
    assert server.attributes["http.response.status_code"] == 200
    (emit,) = [s for s in spans if s.name == f"emit {TOOL_PRE}"]
    assert emit.parent_span_id == server.span_id
    assert emit.attributes["hookbus.action"] == "deny"


# -- mTLS ------------------------------------------------------------------------------------
async def test_mtls_refuses_a_client_without_a_certificate(
    tmp_path: Any, connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("agent@example.test")
    stranger = trustme.CA().issue_cert("agent@example.test")
    files = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "server.pem",
        "client": tmp_path / "client.pem",
        "stranger": tmp_path / "stranger.pem",
    }
    ca.cert_pem.write_to_path(str(files["ca"]))
    server_cert.private_key_and_cert_chain_pem.write_to_path(str(files["cert"]))
    client_cert.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    stranger.private_key_and_cert_chain_pem.write_to_path(str(files["stranger"]))

    def client_context(cert: str | None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(files["ca"]))
        if cert:
            ctx.load_cert_chain(str(files[cert]))
        return ctx

    async with (
        policy_worker(await connect()),
        GatewayProcess(
            "http", "--url", embedded_server.url,
            "--gateway-tls-cert", str(files["cert"]), "--gateway-client-ca", str(files["ca"]),
        ) as gw,
    ):  # fmt: skip
        assert gw.url.startswith("https://127.0.0.1:")
        assert "auth: client certificates" in gw.stderr
        body = pre_tool_use("rm -rf /")
        async with httpx.AsyncClient(verify=client_context("client"), timeout=10) as http:
            served_ok = await http.post(f"{gw.url}/claude-code", json=body)
        for cert in (None, "stranger"):
            async with httpx.AsyncClient(verify=client_context(cert), timeout=10) as http:
                with pytest.raises(httpx.TransportError):
                    await http.post(f"{gw.url}/claude-code", json=body)
        code = await gw.stop()
    assert served_ok.status_code == 200
    assert served_ok.json()["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert code == 0, gw.stderr


# -- NATS down -------------------------------------------------------------------------------
async def test_nats_down_is_the_doors_fail_closed_answer(
    connect: Connect, embedded_server: EmbeddedNatsServer
) -> None:
    async with (
        policy_worker(await connect()),
        GatewayProcess("http", "--doors", "claude-code,aos", "--url", embedded_server.url) as gw,
        httpx.AsyncClient(base_url=gw.url, timeout=30) as http,
    ):
        before = await http.post("/claude-code", json=pre_tool_use("git status"))
        embedded_server.stop()
        readyz = await until_not_ready(http)
        down = await http.post("/claude-code", json=pre_tool_use("git status"))
        aos_down = await http.post("/aos", json=aos_tool_call("git status"))
        code = await gw.stop()
    assert (before.status_code, before.content) == (200, b"")
    assert readyz.json() == {"status": "not ready", "reason": "not connected to NATS"}
    assert down.status_code == 200, down.text
    specific = down.json()["hookSpecificOutput"]
    assert specific["permissionDecision"] == "deny"
    assert "not connected to NATS" in specific["permissionDecisionReason"]
    assert aos_down.status_code == 200, aos_down.text
    result = aos_down.json()["result"]
    assert result["decision"] == "deny"
    assert "hookbus:emit_failed:not_connected" in result["reasonCode"]
    assert code == 0, gw.stderr
    assert "Traceback" not in gw.stderr, gw.stderr


async def until_not_ready(http: httpx.AsyncClient) -> httpx.Response:
    """Poll ``GET /readyz`` until it says 503 (within 10 s)."""
    with anyio.fail_after(10):
        while True:
            r = await http.get("/readyz")
            if r.status_code == 503:
                return r
            await anyio.sleep(0.05)


# -- the app's and the command's own checks --------------------------------------------------
def test_gateway_app_refuses_bad_settings() -> None:
    async def emit(event: str, data: dict[str, Any], **kwargs: Any) -> HookResult:
        return HookResult()

    with pytest.raises(ValueError, match="unknown door"):
        gateway_app(emit, doors={"claude-code", "mcp"})
    with pytest.raises(ValueError, match="no door"):
        gateway_app(emit, doors=set())
    with pytest.raises(ValueError, match="token is empty"):
        gateway_app(emit, token=" ")
    with pytest.raises(ValueError, match="max_body_bytes"):
        gateway_app(emit, max_body_bytes=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--doors", "claude-code,mcp"], "doors are a comma-separated list"),
        (["--gateway-client-ca", "ca.pem"], "--gateway-client-ca needs --gateway-tls-cert"),
        (["--gateway-tls-key", "k.pem"], "--gateway-tls-key needs --gateway-tls-cert"),
        (["--max-body", "0"], "must be above 0 bytes"),
        (["--port", "70000"], "0<=x<=65535"),
    ],
)
def test_cli_options_are_checked(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli, ["gateway", "http", "--url", "nats://127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_empty_token_is_refused() -> None:
    result = CliRunner().invoke(
        cli,
        ["gateway", "aos", "--url", "nats://127.0.0.1:1"],
        env={"HOOKBUS_GATEWAY_TOKEN": ""},
    )
    assert result.exit_code == 2, result.output
    assert "HOOKBUS_GATEWAY_TOKEN) is empty" in result.output


async def test_cli_port_in_use_is_one_clear_line(embedded_server: EmbeddedNatsServer) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await anyio.run_process(
            [*HOOKBUS, "gateway", "http", "--port", str(port), "--url", embedded_server.url],
            check=False,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
