"""Service mode: an agent in any language emits with one plain NATS request and JSON.

The "agent" here uses nothing of hookbus to build its requests: a subject string and a
JSON body, as ``nats req 'hookbus.v1.emit.tool=3Apre' '{"data": {...}}'`` would.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import nats.errors
import pytest

from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import (
    CollectReply,
    EmitReply,
    HookResult,
    decode,
    encode_token,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


def _worker(nc: Any, event: str) -> HookWorker:
    w = HookWorker(nc)

    @w.handler(event, priority=1)
    async def redact(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "secret": "***"})

    @w.handler(event, priority=2)
    async def context(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection=f"saw {data['secret']}")

    return w


async def _service(connect: Any, **options: Any) -> tuple[DispatcherService, HookDispatcher]:
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    service = DispatcherService(d, snc, **options)
    await service.start()
    return service, d


def _emit_subject(event: str) -> str:
    return "hookbus.v1.emit." + encode_token(event)


def _collect_subject(event: str) -> str:
    return "hookbus.v1.emit_and_collect." + encode_token(event)


async def _emit(agent: Any, event: str, body: bytes) -> dict[str, Any]:
    msg = await agent.request(_emit_subject(event), body, timeout=5)
    reply = json.loads(msg.data)  # plain JSON for any language ...
    decode(msg.data, EmitReply)  # ... and it is the documented wire type
    return reply


async def _assert_serves(agent: Any, event: str) -> None:
    reply = await _emit(agent, event, b'{"data": {"secret": "pw"}}')
    assert "error" not in reply, reply
    assert reply["result"]["action"] == "inject_context"
    assert reply["result"]["data"]["secret"] == "***"


async def test_plain_request_gets_the_folded_result(connect, event):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        reply = await _emit(
            agent,
            event,
            b'{"data": {"tool_name": "bash", "secret": "hunter2"}, "agent_id": "agent-7"}',
        )
        await service.stop()
    result = reply["result"]
    assert result["action"] == "inject_context"
    assert result["context_injection"] == "saw ***"
    assert result["data"]["tool_name"] == "bash"
    assert result["data"]["secret"] == "***"  # modify chained into the next handler
    assert result["data"]["agent_id"] == "agent-7"
    assert "timestamp" in result["data"]
    assert [i["handler"] for i in result["context_injections"]] == ["context"]
    assert result["failures"] == []  # every field is on the wire, defaults included


async def test_emit_and_collect_through_the_service(connect, event):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request(
            _collect_subject(event), b'{"data": {"secret": "pw"}, "timeout_s": 5}', timeout=10
        )
        await service.stop()
    reply = decode(msg.data, CollectReply)
    assert reply.error is None
    # non-None data of each handler, in priority order: only `redact` returns data
    assert reply.responses == [{"secret": "***"}]


BAD_EMITS = [
    # (subject builder, body, error code, text the message must hold)
    (_emit_subject, b"{oops", "bad_request", "malformed"),
    (_emit_subject, b'{"data": 1}', "bad_request", "$.data"),
    (_emit_subject, b'{"data": {}, "agent_id": 5}', "bad_request", "$.agent_id"),
    (_emit_subject, b"[]", "bad_request", "EmitRequest"),
    (_collect_subject, b'{"data": {}, "timeout_s": "soon"}', "bad_request", "$.timeout_s"),
    (_collect_subject, b"nope", "bad_request", "malformed"),
]


@pytest.mark.parametrize(("subject", "body", "code", "named"), BAD_EMITS)
async def test_bad_body_gets_a_structured_error(connect, event, subject, body, code, named):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request(subject(event), body, timeout=5)
        reply = json.loads(msg.data)
        assert "result" not in reply and "responses" not in reply
        assert reply["error"]["code"] == code
        assert named in reply["error"]["message"]
        await _assert_serves(agent, event)
        await service.stop()


@pytest.mark.parametrize("subject", [_emit_subject, _collect_subject])
async def test_unknown_event(connect, event, subject):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request(subject(event + "-typo"), b'{"data": {}}', timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "unknown_event"
        assert event + "-typo" in reply["error"]["message"]
        await _assert_serves(agent, event)
        await service.stop()


@pytest.mark.parametrize("token", ["tool=3apre", "=ZZ", "%3A"])
async def test_bad_subject_token(connect, event, token):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request("hookbus.v1.emit." + token, b'{"data": {}}', timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "bad_request"
        assert token in reply["error"]["message"]
        await _assert_serves(agent, event)
        await service.stop()


async def test_oversize_emit_gets_payload_too_large(connect, event):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        blob = b"x" * (agent.max_payload - 100)  # the request fits; the event does not
        body = b'{"data": {"b": "' + blob + b'"}}'
        msg = await agent.request(_emit_subject(event), body, timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "payload_too_large"
        assert str(agent.max_payload) in reply["error"]["message"]
        await _assert_serves(agent, event)
        await service.stop()


async def test_oversize_emit_and_collect_gets_payload_too_large(connect, event):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        blob = b"x" * (agent.max_payload - 100)
        msg = await agent.request(
            _collect_subject(event), b'{"data": {"b": "' + blob + b'"}}', timeout=5
        )
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "payload_too_large"
        await _assert_serves(agent, event)
        await service.stop()


async def test_two_replicas_share_the_load(connect, event):
    counts = [0, 0]
    services = []
    for i in (0, 1):
        snc = await connect()
        d = HookDispatcher(snc, strict_events=True)

        def make(i: int):
            async def count(ev: str, data: dict[str, Any]) -> HookResult:
                counts[i] += 1
                return HookResult(action="modify", data={**data, "replica": i})

            return count

        d.register(event, make(i), name="count")
        service = DispatcherService(d, snc)
        await service.start()
        services.append(service)
    agent = await connect()
    replies = await asyncio.gather(
        *(_emit(agent, event, json.dumps({"data": {"n": n}}).encode()) for n in range(100))
    )
    for service in services:
        await service.stop()
    assert [r["result"]["data"]["n"] for r in replies] == list(range(100))
    assert counts[0] > 0 and counts[1] > 0
    assert sum(counts) == 100
    by_replica = [sum(1 for r in replies if r["result"]["data"]["replica"] == i) for i in (0, 1)]
    assert by_replica == counts


async def test_stop_is_idempotent_and_drains(connect, event):
    """Requests running and queued when stop() is called are all answered; a second,
    concurrent stop() also returns only once the drain is done."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    gate = asyncio.Event()
    started = 0
    two_started = asyncio.Event()

    async def slow(ev: str, data: dict[str, Any]) -> HookResult:
        nonlocal started
        started += 1
        if started == 2:
            two_started.set()
        await gate.wait()
        return HookResult(action="modify", data={**data, "done": True})

    d.register(event, slow)
    service = DispatcherService(d, snc, max_concurrency=2)
    await service.start()
    agent = await connect()
    pending = [
        asyncio.create_task(_emit(agent, event, json.dumps({"data": {"n": n}}).encode()))
        for n in range(6)
    ]
    await two_started.wait()
    await agent.flush()  # every request has reached the server, hence the service
    first = asyncio.create_task(service.stop())
    second = asyncio.create_task(service.stop())
    done, _ = await asyncio.wait({first, second}, timeout=0.3)
    assert done == set(), "a stop() returned while requests were still being handled"
    gate.set()
    await asyncio.gather(first, second)
    replies = await asyncio.gather(*pending)
    await service.stop()  # a third time, after the fact
    assert [r["result"]["data"]["n"] for r in replies] == list(range(6))
    assert all(r["result"]["data"]["done"] for r in replies)
    assert started == 6
    with pytest.raises(nats.errors.NoRespondersError):
        await agent.request(_emit_subject(event), b'{"data": {}}', timeout=5)


async def test_run_returns_once_stopped(connect, event):
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    d.register(event, lambda ev, data: None, name="noop")
    service = DispatcherService(d, snc)
    await service.start()
    runner = asyncio.create_task(service.run())  # start() again is a no-op; then it waits
    agent = await connect()
    reply = await _emit(agent, event, b'{"data": {}}')
    await service.stop()
    await asyncio.wait_for(runner, 10)
    assert "error" not in reply
    # `action` is omitted at its default, "continue" (msgspec omit_defaults)
    assert reply["result"].get("action", "continue") == "continue"
