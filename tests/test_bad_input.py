"""Bad input never kills a worker or a dispatcher: it gets a structured error and the
process keeps serving. Raw requests use plain nats-py, the way an agent in another
language (or a broken one) would talk to a handler subject."""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import nats
import pytest

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    MAX_NESTING,
    SESSION_END,
    EventEnvelope,
    HookReply,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    UnknownEventError,
    WireFormatError,
    decode,
    encode,
    handler_subject,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


def _echo_worker(nc: Any, event: str, **options: Any) -> HookWorker:
    w = HookWorker(nc)

    @w.handler(event, **options)
    async def echo(ev: str, data: dict[str, Any]) -> HookResult:
        if data.get("raise"):
            raise RuntimeError(f"boom {data['raise']}")
        if data.get("huge"):
            return HookResult(action="modify", data={"blob": "x" * data["huge"]})
        if data.get("return"):
            return data["return"]
        return HookResult(action="modify", data={**data, "echoed": True})

    return w


async def _raw(nc: Any, subject: str, body: bytes) -> HookReply:
    msg = await nc.request(subject, body, timeout=5)
    return decode(msg.data, HookReply)


async def _assert_still_serves(nc: Any, subject: str, event: str) -> None:
    envelope = EventEnvelope(id="ok", event=event, data={"n": 1})
    reply = await _raw(nc, subject, encode(envelope))
    assert reply.error is None
    assert reply.result is not None and reply.result.data == {"n": 1, "echoed": True}


BAD_BODIES = [
    # (body, what the error message must name)
    (b"{not json", "malformed"),
    (b"", "truncated"),
    (b'{"id": "a", "event": "e", "data": {}', "truncated"),
    (b"[1, 2]", "Expected `object`, got `array`"),
    (b'{"id": "a", "event": 1, "data": {}}', "$.event"),
    (b'{"id": 7, "event": "e", "data": {}}', "$.id"),
    (b'{"id": "a", "event": "e", "data": []}', "$.data"),
    (b'{"id": "a", "event": "e"}', "missing required field `data`"),
    (b'{"id": "a", "event": "e", "data": {}, "budget_s": "soon"}', "$.budget_s"),
    ("\ud800".encode("utf-8", "surrogatepass"), "invalid"),
]


@pytest.mark.parametrize(("body", "named"), BAD_BODIES)
async def test_malformed_request_gets_bad_request(nc, connect, event, body, named):
    async with _echo_worker(nc, event) as w:
        raw = await connect()
        subject = handler_subject(event, "echo")
        reply = await _raw(raw, subject, body)
        assert reply.result is None and reply.error is not None
        assert reply.error.code == "bad_request"
        assert named in reply.error.message
        assert reply.handler == "echo"
        await _assert_still_serves(raw, subject, event)
    assert w.handled == 2


HOSTILE_BODIES = [
    b'{"id": "a", "event": "e", "data": {"k": "\xff\xfe"}}',  # invalid UTF-8 in a string
    b'{"id": "\xc3", "event": "e", "data": {}}',
    b'{"id": "a", "event": "e", "data": {"k": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
    b'{"id": "a", "event": "e", "data": {"k": 1e999999}}',
    b'{"id": "a", "event": "e", "data": {}, "budget_s": NaN}',
]


@pytest.mark.parametrize("body", HOSTILE_BODIES)
async def test_hostile_request_gets_bad_request_not_internal(nc, connect, event, body, caplog):
    """Invalid UTF-8 and deep nesting used to escape the decoder as UnicodeDecodeError /
    RecursionError: answered ``internal`` with a traceback logged at ERROR per message."""
    async with _echo_worker(nc, event):
        raw = await connect()
        subject = handler_subject(event, "echo")
        reply = await _raw(raw, subject, body)
        assert reply.error is not None and reply.error.code == "bad_request", reply.error
        await _assert_still_serves(raw, subject, event)
    records = [r for r in caplog.records if r.name == "hookbus.workers"]
    assert all(r.levelname != "ERROR" and r.exc_info is None for r in records)


@pytest.mark.faults
async def test_ten_thousand_hostile_requests(nc, connect, event, caplog):
    """10,000 generated bodies (random bytes, JSON of random shapes, broken UTF-8) on a
    handler subject: every answer is ``bad_request``, the worker still serves, and the log
    stays small (one line per bad request at most a few times, then a count)."""
    import random

    rng = random.Random(7)

    def body(i: int) -> bytes:
        kind = i % 4
        if kind == 0:
            return rng.randbytes(rng.randrange(0, 200))
        if kind == 1:
            junk = rng.randbytes(rng.randrange(1, 6)).replace(b'"', b"").replace(b"\\", b"")
            return b'{"id":"a","event":"e","data":{"k":"' + junk + b'\xff"}}'
        if kind == 2:
            depth = rng.randrange(1000, 3000)
            return b'{"id":"a","event":"e","data":{"k":' + b"[" * depth + b"]" * depth + b"}}"
        shape = rng.choice([[], 1, "x", None, {"id": 1}, {"data": []}, {"event": {}}])
        return encode(shape)

    async with _echo_worker(nc, event) as w:
        raw = await connect()
        subject = handler_subject(event, "echo")
        codes: dict[str, int] = {}
        sem = asyncio.Semaphore(200)

        async def one(i: int) -> None:
            async with sem:
                reply = await _raw(raw, subject, body(i))
                code = reply.error.code if reply.error else "result"
                codes[code] = codes.get(code, 0) + 1

        caplog.clear()
        await asyncio.gather(*(one(i) for i in range(10_000)))
        await _assert_still_serves(raw, subject, event)
    assert codes == {"bad_request": 10_000}
    logged = [r for r in caplog.records if r.name == "hookbus.workers"]
    size = sum(len(r.getMessage()) for r in logged)
    print(f"\n10,000 hostile requests: {len(logged)} log lines, {size} bytes of log")
    assert len(logged) < 100 and all(r.exc_info is None for r in logged)
    assert w.handled >= 10_001


async def test_handler_that_raises(nc, connect, event):
    async with _echo_worker(nc, event, failure_policy="ignore") as w:
        raw = await connect()
        subject = handler_subject(event, "echo")
        envelope = EventEnvelope(id="x", event=event, data={"raise": "on purpose"})
        reply = await _raw(raw, subject, encode(envelope))
        assert reply.error is not None and reply.result is None
        assert reply.error.code == "handler_error"
        assert reply.error.message == "RuntimeError: boom on purpose"
        await _assert_still_serves(raw, subject, event)

        async with HookDispatcher(await connect()) as d:
            r = await d.emit(event, {"raise": "again"})
            ok = await d.emit(event, {"n": 2})
    assert r.action == "continue"  # policy ignore: fail open, recorded
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("echo", "error", "ignore")]
    assert "RuntimeError: boom again" in r.failures[0].message
    assert ok.failures == [] and ok.data["echoed"] is True
    assert w.handled == 4


async def test_handler_returning_a_bad_result(nc, connect, event):
    async with _echo_worker(nc, event, failure_policy="deny") as w:
        raw = await connect()
        subject = handler_subject(event, "echo")
        reply = await _raw(
            raw, subject, encode(EventEnvelope(id="x", event=event, data={"return": 42}))
        )
        assert reply.error is not None and reply.error.code == "bad_result"
        reply = await _raw(
            raw,
            subject,
            encode(EventEnvelope(id="y", event=event, data={"return": {"action": "explode"}})),
        )
        assert reply.error is not None and reply.error.code == "bad_result"
        assert "$.action" in reply.error.message
        async with HookDispatcher(await connect()) as d:
            r = await d.emit(event, {"return": 42})
        await _assert_still_serves(raw, subject, event)
    assert r.action == "deny" and r.decided_by == "echo"
    assert [(f.kind, f.policy) for f in r.failures] == [("bad_reply", "deny")]
    assert w.handled == 4


async def test_handler_timeout(nc, connect, event):
    w = HookWorker(nc)

    @w.handler(event, timeout_s=0.2, failure_policy="deny")
    async def stuck(ev: str, data: dict[str, Any]) -> None:
        if data.get("stick"):
            await asyncio.Event().wait()  # never returns

    async with w:
        raw = await connect()
        subject = handler_subject(event, "stuck")
        reply = await _raw(
            raw, subject, encode(EventEnvelope(id="x", event=event, data={"stick": True}))
        )
        assert reply.error is not None and reply.error.code == "handler_timeout"
        async with HookDispatcher(await connect()) as d:
            r = await d.emit(event, {"stick": True})
            ok = await d.emit(event, {})
    assert r.action == "deny"
    assert [(f.kind, f.policy) for f in r.failures] == [("timeout", "deny")]
    assert ok.action == "continue" and ok.failures == []


async def test_oversize_emit_raises_and_sends_nothing(nc, connect, event):
    spy = await connect()
    seen = 0

    async def count(msg: Any) -> None:
        nonlocal seen
        seen += 1

    await spy.subscribe(handler_subject(event, "echo"), cb=count)  # hears every request
    await spy.flush()
    async with _echo_worker(nc, event) as w:
        dnc = await connect()
        async with HookDispatcher(dnc) as d:
            with pytest.raises(PayloadTooLargeError) as info:
                await d.emit(event, {"blob": "x" * dnc.max_payload})
            ok = await d.emit(event, {"n": 1})
    await spy.flush()
    message = str(info.value)
    sizes = [int(n) for n in re.findall(r"(\d+) bytes", message)]
    assert dnc.max_payload in sizes, message
    assert any(n > dnc.max_payload for n in sizes), message
    assert ok.failures == [] and ok.data["echoed"] is True
    assert seen == 1  # only the valid emit reached the subject
    assert w.handled == 1


async def test_oversize_emit_and_collect_raises(nc, connect, event):
    async with _echo_worker(nc, event) as w:
        dnc = await connect()
        async with HookDispatcher(dnc) as d:
            with pytest.raises(PayloadTooLargeError, match="max_payload"):
                await d.emit_and_collect(event, {"blob": "x" * dnc.max_payload})
            ok = await d.emit_and_collect(event, {"n": 1})
    assert ok == [{"n": 1, "echoed": True}]
    assert w.handled == 1


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_oversize_reply_is_a_recorded_failure(nc, connect, event, policy):
    async with _echo_worker(nc, event, failure_policy=policy) as w:
        dnc = await connect()
        async with HookDispatcher(dnc) as d:
            r = await d.emit(event, {"huge": nc.max_payload})
            ok = await d.emit(event, {"n": 1})
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("echo", "error", policy)]
    assert "payload_too_large" in r.failures[0].message
    assert str(nc.max_payload) in r.failures[0].message
    if policy == "deny":
        assert r.action == "deny" and r.decided_by == "echo"
    else:
        assert r.action == "continue" and r.decided_by is None
    assert "blob" not in (r.chained_data or {})  # the oversize modify never applied
    assert ok.failures == [] and ok.data["echoed"] is True
    assert w.handled == 2


async def test_unknown_event_in_strict_mode(nc, event):
    async with HookDispatcher(nc, strict_events=True) as d:
        with pytest.raises(UnknownEventError, match=re.escape(repr(event))):
            await d.emit(event, {})
        with pytest.raises(UnknownEventError):
            await d.emit_and_collect(event, {})
        # a standard event with no handler is not unknown
        r = await d.emit(SESSION_END, {"a": 1})
    assert r.action == "continue" and r.data == {"a": 1}


async def test_unknown_event_passes_without_strict_mode(nc, event):
    async with HookDispatcher(nc) as d:
        r = await d.emit(event, {"a": 1})
        assert await d.emit_and_collect(event, {"a": 1}) == []
    assert r.action == "continue" and r.data == {"a": 1} and r.failures == []


async def _lost_server_setup(embedded_server: Any, event: str, dispatcher_options: dict[str, Any]):
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async def on_error(exc: Exception) -> None:
        pass  # the disconnect is expected

    wnc = await nats.connect(embedded_server.url, error_cb=on_error)
    dnc = await nats.connect(
        embedded_server.url, error_cb=on_error, closed_cb=on_closed, **dispatcher_options
    )
    w = _echo_worker(wnc, event, failure_policy="deny", timeout_s=0.5)
    await w.start()
    d = HookDispatcher(dnc)
    await d.start()
    before = await d.emit(event, {"n": 0})
    assert before.failures == [] and before.data["echoed"] is True
    return w, d, wnc, dnc, closed


async def _close_all(*conns: Any) -> None:
    for conn in conns:
        with contextlib.suppress(Exception):  # nats-py raises ConnectionResetError here
            await conn.close()


@pytest.mark.parametrize("method", ["emit", "emit_and_collect"])
async def test_lost_server_with_a_closed_connection(embedded_server, event, method):
    """No reconnect: once the connection is closed, emit (and emit_and_collect, not with a
    raw nats error) raises NotConnectedError at once."""
    w, d, wnc, dnc, closed = await _lost_server_setup(
        embedded_server, event, {"allow_reconnect": False}
    )
    try:
        embedded_server.kill()
        await closed.wait()
        with pytest.raises(NotConnectedError):
            await getattr(d, method)(event, {"n": 1})
        await asyncio.wait_for(w.shutdown(), 10)  # the worker stops cleanly too
        await asyncio.wait_for(d.close(), 10)
    finally:
        await _close_all(wnc, dnc)
    assert w.handled == 1


async def test_lost_server_while_reconnecting(embedded_server, event):
    """Reconnecting (the default): the request waits out the handler's timeout, then the
    failure is recorded as a timeout and the handler's policy (deny) applies."""
    w, d, wnc, dnc, closed = await _lost_server_setup(embedded_server, event, {})
    try:
        embedded_server.kill()
        r = await asyncio.wait_for(d.emit(event, {"n": 1}), 10)
        assert dnc.is_reconnecting and not closed.is_set()  # still trying, not closed
        assert r.action == "deny" and r.decided_by == "echo"
        assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("echo", "timeout", "deny")]
        await asyncio.wait_for(w.shutdown(), 10)
        await asyncio.wait_for(d.close(), 10)
    finally:
        await _close_all(wnc, dnc)
    assert w.handled == 1


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_one_nesting_limit_on_every_python(opener: bytes) -> None:
    """MAX_NESTING levels decode; one more is a format error for whoever reads it, whatever
    the interpreter's own recursion limit (about 1,000 levels on 3.11, 10,000 on 3.13)."""
    closer = b"]" if opener == b"[" else b"}"

    def nested(depth: int) -> bytes:  # the envelope and its data are two levels
        inner = opener * (depth - 2) + b"1" + closer * (depth - 2)
        return b'{"id":"a","event":"e","data":{"k":' + inner + b"}}"

    ok = decode(nested(MAX_NESTING), EventEnvelope)
    assert encode(ok) == nested(MAX_NESTING)
    with pytest.raises(WireFormatError, match="nested too deeply"):
        decode(nested(MAX_NESTING + 1), EventEnvelope)
    deeper: Any = 1
    for _ in range(MAX_NESTING):
        deeper = [deeper]
    with pytest.raises(WireFormatError, match="nested too deeply"):  # as its receiver reads it
        decode(encode(EventEnvelope(id="a", event="e", data={"k": deeper})), EventEnvelope)
    # brackets inside strings are text, not nesting
    text = '[{"' * MAX_NESTING
    envelope = EventEnvelope(id="a", event="e", data={"k": text})
    assert decode(encode(envelope), EventEnvelope).data == {"k": text}


@pytest.mark.parametrize(
    ("shape", "deep"),
    [
        ("a large text, nested to the limit", False),
        ("a large text, one level deeper", True),
        ("many shallow objects", False),
        ("many shallow objects, one nested too deeply", True),
        ("brackets inside a large string", False),
    ],
)
def test_large_messages_keep_the_one_nesting_limit(shape: str, deep: bool) -> None:
    """Large messages take other paths to the same limit (few opening brackets are found
    without a pass over every byte): MAX_NESTING levels decode, one more is refused."""
    text = "the quick brown fox\n" * 4096  # 80 KB
    depth = MAX_NESTING - 2 + (1 if deep else 0)  # the envelope and its data: two levels
    nested: Any = 1
    for _ in range(depth):
        nested = [nested]
    data: dict[str, Any] = {"text": text}
    if shape.startswith("a large text"):
        data["k"] = nested
    elif shape.startswith("many shallow objects"):
        data["items"] = [{"n": i, "tags": [i]} for i in range(3000)]
        if deep:
            data["k"] = nested
    else:
        data["text"] = text + "[{" * 2000
    body = encode(EventEnvelope(id="a", event="e", data=data))
    if deep:
        with pytest.raises(WireFormatError, match="nested too deeply"):
            decode(body, EventEnvelope)
    else:
        assert decode(body, EventEnvelope).data == data
