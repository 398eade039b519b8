"""Service mode: an agent in any language emits with one plain NATS request and JSON.

The "agent" here uses nothing of hookbus to build its requests: a subject string and a
JSON body, as ``nats req 'hookbus.v1.emit.<agent>.tool=3Apre' '{"data": {...}}'`` would
(``=`` is the agent token of a call without an agent id).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from unittest.mock import ANY

import msgspec
import nats.errors
import pytest
from _serving import stopped_twice_at_once

from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import (
    BadRequestError,
    CollectReply,
    EmitReply,
    HookResult,
    NotConnectedError,
    SuspensionAbortedError,
    decode,
    emit_service_subject,
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
    return "hookbus.v1.emit.=." + encode_token(event)


def _collect_subject(event: str) -> str:
    return "hookbus.v1.emit_and_collect.=." + encode_token(event)


async def _emit(agent: Any, event: str, body: bytes) -> dict[str, Any]:
    msg = await agent.request(_emit_subject(event), body, timeout=5)
    reply = json.loads(msg.data)  # plain JSON for any language ...
    decode(msg.data, EmitReply)  # ... and it is the documented wire type
    return reply


def _numbered(n: int) -> bytes:
    """An emit request body whose data is ``{"n": n}``."""
    return json.dumps({"data": {"n": n}}).encode()


def _emitting(agent: Any, event: str, ns: range) -> list[asyncio.Task[dict[str, Any]]]:
    """One `_emit` task a number of `ns` (its data ``{"n": n}``), started at once."""
    return [asyncio.create_task(_emit(agent, event, _numbered(n))) for n in ns]


async def _assert_serves(agent: Any, event: str) -> None:
    reply = await _emit(agent, event, b'{"data": {"secret": "pw"}}')
    assert "error" not in reply, reply
    assert reply["result"]["action"] == "inject_context"
    assert reply["result"]["chained_data"]["secret"] == "***"


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
    assert result["chained_data"]["tool_name"] == "bash"
    assert result["chained_data"]["secret"] == "***"  # modify chained into the next handler
    assert result["chained_data"]["agent_id"] == "agent-7"
    assert "timestamp" in result["chained_data"]
    assert [i["hook_name"] for i in result["context_injections"]] == ["context"]
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


@pytest.mark.parametrize(
    ("token", "bad"),
    [
        ("=.tool=3apre", "tool=3apre"),
        ("=.=ZZ", "=ZZ"),
        ("=.%3A", "%3A"),
        ("a=zz.tool=3Apre", "a=zz"),
        ("%.tool=3Apre", "'%'"),
    ],
)
async def test_bad_subject_token(connect, event, token, bad):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request("hookbus.v1.emit." + token, b'{"data": {}}', timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "bad_request"
        assert bad in reply["error"]["message"], reply
        await _assert_serves(agent, event)
        await service.stop()


@pytest.mark.parametrize(
    ("subject", "names_the_limit"), [(_emit_subject, True), (_collect_subject, False)]
)
async def test_oversize_request_gets_payload_too_large(connect, event, subject, names_the_limit):
    """An emit (or emit-and-collect) whose event would not fit is refused as too large."""
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        blob = b"x" * (agent.max_payload - 100)  # the request fits; the event does not
        body = b'{"data": {"b": "' + blob + b'"}}'
        msg = await agent.request(subject(event), body, timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "payload_too_large"
        if names_the_limit:
            assert str(agent.max_payload) in reply["error"]["message"]
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
    replies = await asyncio.gather(*(_emit(agent, event, _numbered(n)) for n in range(100)))
    for service in services:
        await service.stop()
    assert [r["result"]["chained_data"]["n"] for r in replies] == list(range(100))
    assert counts[0] > 0 and counts[1] > 0
    assert sum(counts) == 100
    by_replica = [
        sum(1 for r in replies if r["result"]["chained_data"]["replica"] == i) for i in (0, 1)
    ]
    assert by_replica == counts


async def test_stop_is_idempotent_and_drains(connect, event):
    """Requests running when stop() is called are all answered within the grace; a
    second, concurrent stop() also returns only once the drain is done."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    gate = asyncio.Event()
    started = 0
    all_started = asyncio.Event()

    async def slow(ev: str, data: dict[str, Any]) -> HookResult:
        nonlocal started
        started += 1
        if started == 6:
            all_started.set()
        await gate.wait()
        return HookResult(action="modify", data={**data, "done": True})

    d.register(event, slow)
    service = DispatcherService(d, snc, max_concurrency=6)
    await service.start()
    agent = await connect()
    pending = _emitting(agent, event, range(6))
    await all_started.wait()
    await agent.flush()  # every request has reached the server, hence the service
    await stopped_twice_at_once(service.stop, gate, "requests were still being handled")
    replies = await asyncio.gather(*pending)
    await service.stop()  # a third time, after the fact
    assert [r["result"]["chained_data"]["n"] for r in replies] == list(range(6))
    assert all(r["result"]["chained_data"]["done"] for r in replies)
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


def _gated(gate: asyncio.Event, started: list[int], ready: asyncio.Event, n: int) -> Any:
    """An in-process handler that waits on `gate`; `ready` is set once `n` calls run."""

    async def handler(ev: str, data: dict[str, Any]) -> HookResult:
        started.append(1)
        if len(started) == n:
            ready.set()
        await gate.wait()
        return HookResult(action="modify", data={**data, "done": True})

    return handler


async def _slow_service(
    connect: Any, event: str, slots: int
) -> tuple[DispatcherService, Any, asyncio.Event, list[int], asyncio.Event]:
    """A started service of `slots` concurrent requests at most, whose one handler
    ("slow", `_gated`) waits on a gate, and an agent's connection:
    (service, agent, gate, started calls, ready once `slots` calls run)."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    gate, started, ready = asyncio.Event(), [], asyncio.Event()
    d.register(event, _gated(gate, started, ready, slots), name="slow")
    service = DispatcherService(d, snc, max_concurrency=slots)
    await service.start()
    return service, await connect(), gate, started, ready


async def test_over_the_bound_is_refused_busy_at_once(connect, event):
    """Over max_concurrency the service answers `busy` (retryable) at once instead of
    queueing the request behind the ones in flight until the agent times out."""
    service, agent, gate, started, ready = await _slow_service(connect, event, 2)
    running = _emitting(agent, event, range(2))
    await ready.wait()
    extra = await asyncio.wait_for(
        asyncio.gather(*(_emit(agent, event, _numbered(n)) for n in range(2, 6))),
        timeout=4,  # answered while the slots are still taken (the gate is closed)
    )
    gate.set()
    first = await asyncio.gather(*running)
    await service.stop()
    assert [r["error"]["code"] for r in extra] == ["busy"] * 4
    assert all(r["error"]["retryable"] for r in extra)
    assert [r["result"]["chained_data"]["n"] for r in first] == [0, 1]
    assert len(started) == 2  # the refused requests never ran a handler


@pytest.mark.parametrize(
    ("subject", "body"),
    [
        (_collect_subject, b'{"data": {}, "timeout_s": -1}'),
        (_collect_subject, b'{"data": {}, "timeout_s": 0}'),
        (_collect_subject, b'{"data": {}, "timeout_s": 1e999}'),  # inf
        (_emit_subject, b'{"data": {}, "timeout_s": -5}'),
        (_emit_subject, b'{"data": {}, "timeout_s": 1e999}'),
        (_emit_subject, b'{"data": {}, "approval_timeout_s": 0}'),
        (_emit_subject, b'{"data": {}, "approval_timeout_s": -1}'),
        (_emit_subject, b'{"data": {}, "approval_timeout_s": 1e999}'),
        (_emit_subject, b'{"data": {}, "approval_timeout_s": "soon"}'),
    ],
)
async def test_timeouts_must_be_finite_and_positive(connect, event, subject, body):
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        msg = await agent.request(subject(event), body, timeout=5)
        reply = json.loads(msg.data)
        await _assert_serves(agent, event)
        await service.stop()
    assert reply["error"]["code"] == "bad_request", reply
    assert "timeout_s" in reply["error"]["message"]


async def test_collect_timeout_is_clamped(connect, event):
    """A collect asking for 1e9 s waits at most the service's maximum."""
    gate = asyncio.Event()

    async def stuck(ev: str, data: dict[str, Any]) -> HookResult:
        await gate.wait()
        return HookResult(action="modify", data={"late": True})

    w = _worker(await connect(), event)
    w.add_handler(event, stuck, name="stuck", priority=5)
    async with w:
        service, _ = await _service(connect, max_collect_timeout_s=0.5)
        agent = await connect()
        msg = await agent.request(
            _collect_subject(event), b'{"data": {"secret": "pw"}, "timeout_s": 1e9}', timeout=10
        )
        gate.set()
        await service.stop()
    reply = decode(msg.data, CollectReply)
    assert reply.error is None
    assert reply.responses == [{"secret": "***"}]  # the stuck handler was given up on


async def test_collects_with_huge_timeouts_do_not_starve_other_agents(connect, event):
    """600 emit_and_collect requests with timeout_s=1e9 to a handler with no live replica
    do not hold every slot: another agent's emit still gets its decision."""

    async def noop(ev: str, data: dict[str, Any]) -> None:
        return None

    w = HookWorker(await connect())
    w.add_handler(event, noop, name="gone")
    async with w:  # declare the handler, then stop its only replica:
        pass  # the declaration stays, nobody answers
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    other = event + "-other"

    async def deny(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="policy")

    d.register(other, deny, name="policy")
    service = DispatcherService(d, snc)
    await service.start()
    agents = [await connect() for _ in range(3)]
    body = b'{"data": {}, "timeout_s": 1e9}'
    flood = [
        asyncio.create_task(agents[i % 3].request(_collect_subject(event), body, timeout=30))
        for i in range(600)
    ]
    for a in agents:
        await a.flush()
    agent = await connect()
    msg = await agent.request(_emit_subject(other), b'{"data": {"tool_name": "x"}}', timeout=5)
    await service.stop(grace_s=0.5)
    answers = [decode(m.data, CollectReply) for m in await asyncio.gather(*flood)]
    reply = decode(msg.data, EmitReply)
    assert reply.result is not None and reply.result.action == "deny"
    # every flooding request got an answer too: responses, or a retryable refusal
    codes = {a.error.code if a.error else "ok" for a in answers}
    assert codes <= {"ok", "busy", "unavailable"}, codes
    assert all(a.error.retryable for a in answers if a.error)


async def test_drain_is_bounded_by_the_grace(connect, event):
    """stop(grace_s) lets a request that finishes in time complete, and answers one that
    does not with a retryable `unavailable` error once the grace is spent, instead of
    waiting for it forever (Kubernetes would SIGKILL first and the agent get nothing)."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    never, started, ready = asyncio.Event(), [], asyncio.Event()
    d.register(event, _gated(never, started, ready, 1), name="stuck")
    quick = event + "-quick"
    gate, q_started, q_ready = asyncio.Event(), [], asyncio.Event()
    d.register(quick, _gated(gate, q_started, q_ready, 1), name="finishes")
    service = DispatcherService(d, snc, grace_s=0.5)
    await service.start()
    agent = await connect()
    stuck_reply = asyncio.create_task(_emit(agent, event, b'{"data": {}}'))
    quick_reply = asyncio.create_task(_emit(agent, quick, b'{"data": {"n": 1}}'))
    await ready.wait()
    await q_ready.wait()
    stopping = asyncio.create_task(service.stop())
    gate.set()  # the quick one finishes within the grace
    await asyncio.wait_for(stopping, 10)
    stuck, done = await asyncio.gather(stuck_reply, quick_reply)
    assert done["result"]["chained_data"] == {"n": 1, "done": True, "timestamp": ANY}
    assert stuck["error"]["code"] == "unavailable"
    assert stuck["error"]["retryable"] is True
    assert "result" not in stuck


async def test_drain_stops_intake_on_every_subscription_at_once(connect, event):
    """While a drain waits for the requests in flight, no subscription takes new work:
    a request sent then is answered at once (no responders, or `unavailable`), not taken
    and left waiting behind the drain."""
    service, agent, gate, _, ready = await _slow_service(connect, event, 1)
    first = asyncio.create_task(_emit(agent, event, b'{"data": {}}'))
    await ready.wait()
    second = asyncio.create_task(_emit(agent, event, b'{"data": {}}'))  # over the bound
    await agent.flush()
    stopping = asyncio.create_task(service.stop(grace_s=8))
    outcome = None
    for _ in range(10):  # the unsubscribes are on their way: a few tries at most
        try:
            msg = await agent.request(_collect_subject(event), b'{"data": {}}', timeout=0.5)
        except nats.errors.NoRespondersError:
            outcome = "no_responders"
            break
        except nats.errors.TimeoutError:
            continue  # taken by a subscription that should have stopped
        outcome = json.loads(msg.data)["error"]["code"]
        if outcome == "unavailable":
            break
    gate.set()
    await asyncio.wait_for(stopping, 10)
    replies = await asyncio.gather(first, second)
    assert outcome in ("no_responders", "unavailable"), outcome
    assert replies[0]["result"]["chained_data"]["done"] is True
    assert replies[1]["error"]["code"] in ("busy", "unavailable")


@pytest.mark.parametrize(
    ("exc", "code", "retryable"),
    [
        (SuspensionAbortedError("aborted by the drain"), "unavailable", True),
        (NotConnectedError("connection closed"), "unavailable", True),
        (nats.errors.ConnectionClosedError(), "unavailable", True),
        (BadRequestError("$.data: expected object"), "bad_request", False),
        (RuntimeError("a bug"), "internal", False),
    ],
)
def test_every_failure_is_a_structured_error(exc, code, retryable):
    """What an emit raises becomes the agent's error reply: aborts and outages are
    retryable `unavailable`, never silence and never a generic `internal`."""
    from hookbus.dispatcher._service_requests import wire_error

    error = wire_error(exc)
    assert (error.code, error.retryable) == (code, retryable)
    assert error.message


@pytest.mark.parametrize("subject", [_emit_subject, _collect_subject])
async def test_data_nested_near_the_decoders_limit_is_a_bad_request_not_internal(
    connect, event, subject
):
    """Data that decodes just under the recursion limit cannot always be encoded again
    inside a reply: the agent gets ``bad_request`` (its data), never ``internal``, and the
    service keeps serving."""
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        codes = set()
        for depth in range(880, 1010, 6):
            body = b'{"data": {"d": ' + b"[" * depth + b"1" + b"]" * depth + b"}}"
            msg = await agent.request(subject(event), body, timeout=5)
            reply = msgspec.json.decode(msg.data)
            if "error" in reply:
                codes.add(reply["error"]["code"])
        assert codes <= {"bad_request"}, codes
        await _assert_serves(agent, event)
        await service.stop()


@pytest.mark.parametrize(
    "body",
    [
        b'{"data": {}, "agent_id": "mallory"}',
        b'{"data": {"agent_id": "mallory"}}',
        b'{"data": {"agent_id": "mallory"}, "agent_id": "payments"}',
    ],
)
async def test_the_agent_is_the_one_in_the_subject(connect, event, body):
    """The service acts as the agent its subject names (a subject only that agent's NATS
    user may publish on); a body naming another agent is refused, never believed."""
    async with _worker(await connect(), event):
        service, _ = await _service(connect)
        agent = await connect()
        subject = emit_service_subject(event, "payments")
        msg = await agent.request(subject, body, timeout=5)
        reply = json.loads(msg.data)
        assert reply["error"]["code"] == "bad_request", reply
        assert "mallory" in reply["error"]["message"]
        ok = json.loads((await agent.request(subject, b'{"data": {}}', timeout=5)).data)
        assert ok["result"]["chained_data"]["agent_id"] == "payments", ok
        await service.stop()
