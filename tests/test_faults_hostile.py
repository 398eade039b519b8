"""Hostile messages, generated with hypothesis (10,000 in all): bodies and headers sent to a
worker's handler and collect subjects and to the dispatcher service's emit and
emit_and_collect subjects, and values put into every KV bucket hookbus uses.

The decision is asserted: a worker answers ``bad_request`` (never silence, never
``internal``, no ERROR log); the service answers a structured error; after the KV garbage
a real emit through the dispatchers that were running, a new dispatcher and the service
process still gets the right decision (the fail-closed handler still denies), a handler
declared afterwards is still routed, and ``hookbus handlers``, ``hookbus suspensions list`` and
``hookbus approvals`` exit 0 with no traceback.

Examples are generated first (hypothesis ``given`` collecting them, generation phase only)
and then sent concurrently: one test per target, each a share of the 10,000.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import anyio
import nats
import nats.js.errors
import pytest
from _fleet import Fleet, run_cli
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS

import hookbus._core.buckets as buckets
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    CollectReply,
    CollectRequest,
    EmitReply,
    EmitRequest,
    EventEnvelope,
    HandlerDeclaration,
    HookReply,
    HookResult,
    WireFormatError,
    chain_subject,
    collect_service_subject,
    collect_subject,
    decode,
    emit_service_subject,
    encode,
    handler_key,
    handler_set_id,
    handler_subject,
    suspension_key,
)
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

T = TypeVar("T")

TOTAL = 10_000
SHARES = {
    "handler": 1500,
    "chain": 1000,
    "collect": 1500,
    "emit": 2500,
    "emit_and_collect": 1500,
    "kv": 2000,
}
assert sum(SHARES.values()) == TOTAL

STRUCTURED_SERVICE_ERRORS = {"bad_request", "unknown_event", "payload_too_large"}


# -- strategies ----------------------------------------------------------------------------
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
hostile_strings = st.sampled_from(
    ["", ">", "*", "a.b", "attacker.inbox", "x" * 5000, "\u0000", "tool:pre", "é" * 3000]
)
hostile_numbers = st.sampled_from([1e9, 1e308, -1, 0, -0.0, 2**63, 1e-300])


def _with_bad_utf8(doc: dict[str, Any]) -> bytes:
    """`doc` as JSON with an invalid UTF-8 byte inside its first string value."""
    raw = json.dumps(doc).encode()
    marker = raw.find(b'": "')
    if marker < 0:
        return raw[:1] + b'"\xff\xfe":1,' + raw[1:] if raw.startswith(b"{") else b'"\xff"'
    return raw[: marker + 4] + b"\xff\xc3(" + raw[marker + 4 :]


def _nested(depth: int, opener: bytes = b"[") -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    inner = b"[" * depth + b"1" + b"]" * depth if opener == b"[" else b'{"a":' * depth + b"1"
    if opener == b"{":
        inner += closer * depth
    return b'{"id":"x","event":"e","data":{"k":' + inner + b"}}"


def object_bodies(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """JSON objects with some of `fields` (wrong or hostile types) plus random keys, as
    bytes; sometimes with invalid UTF-8 inside."""
    docs = st.fixed_dictionaries({}, optional=fields) | st.dictionaries(
        st.text(max_size=10), json_values, max_size=5
    )
    return st.one_of(
        docs.map(lambda d: json.dumps(d).encode()),
        docs.map(_with_bad_utf8),
    )


any_field = json_values | hostile_strings | hostile_numbers
bodies = st.one_of(
    st.binary(max_size=400),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.integers(min_value=1500, max_value=5000).map(_nested),
    st.integers(min_value=1500, max_value=5000).map(lambda n: _nested(n, b"{")),
    object_bodies(
        {
            "id": any_field,
            "event": any_field,
            "data": any_field,
            "budget_s": any_field,
            "attempt": any_field,
            "agent_id": any_field,
            "session_id": any_field,
            "timeout_s": any_field,
            "idempotency_key": any_field,
            "emitted_at": any_field,
        }
    ),
)
header_names = st.sampled_from(
    ["traceparent", "tracestate", "Nats-Msg-Id", "Nats-Expected-Stream", "X-Hookbus"]
) | st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,15}", fullmatch=True)
header_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60
) | st.sampled_from(["00-" + "f" * 32 + "-" + "0" * 16 + "-01", "00-zz-zz-zz", "-"])
headers = st.none() | st.dictionaries(header_names, header_values, max_size=4)
messages = st.tuples(bodies, headers)


def generate(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """`n` examples of `strategy` (hypothesis's generation phase, collected)."""
    out: list[T] = []

    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: T) -> None:
        out.append(example)

    collect()
    return out


def fails_to_decode(body: bytes, type_: type[Any]) -> bool:
    try:
        decode(body, type_)
    except (WireFormatError, ValueError, RecursionError):  # older decoders leak the latter
        return True
    return False


# -- the system under attack ----------------------------------------------------------------
@pytest.fixture(scope="module")
def private_server() -> Iterator[EmbeddedNatsServer]:
    """A server of this module's own: the garbage never reaches other tests' buckets."""
    with EmbeddedNatsServer() as server:
        yield server


async def guard(event: str, data: dict[str, Any]) -> HookResult:
    if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
        return HookResult(action="deny", reason="destructive")
    return HookResult(action="continue")


class System:
    def __init__(self, nc: NATS, event: str, guard: str, fleet: Fleet) -> None:
        self.nc, self.event, self.guard, self.fleet = nc, event, guard, fleet


@pytest.fixture
async def system(private_server: EmbeddedNatsServer, tmp_path: Path) -> AsyncIterator[System]:
    event, name = f"hostile:{uuid.uuid4().hex[:8]}", f"guard_{uuid.uuid4().hex[:6]}"
    nc = await nats.connect(private_server.url)
    wnc = await nats.connect(private_server.url)
    w = HookWorker(wnc)
    w.add_handler(event, guard, name=name, priority=10, failure_policy="deny", timeout_s=2.0)
    try:
        async with w, Fleet(private_server.url, tmp_path) as fleet:
            yield System(nc, event, name, fleet)
    finally:
        await wnc.close()
        await nc.close()


async def send_all(
    nc: NATS,
    items: list[tuple[str, bytes, dict[str, str] | None]],
    judge: Callable[[bytes], str | None],
) -> list[str]:
    """Request every (subject, body, headers); returns what was wrong with the replies."""
    problems: list[str] = []
    limit = anyio.Semaphore(64)

    async def one(subject: str, body: bytes, hdrs: dict[str, str] | None) -> None:
        async with limit:
            try:
                msg = await nc.request(subject, body, timeout=5, headers=hdrs)
            except Exception as exc:
                problems.append(f"{subject}: no answer ({type(exc).__name__}) to {body[:80]!r}")
                return
            why = judge(msg.data)
            if why:
                problems.append(f"{subject}: {why} for {body[:80]!r}")

    async with anyio.create_task_group() as tg:
        for subject, body, hdrs in items:
            tg.start_soon(one, subject, body, hdrs)
    return problems


def _clean_headers(h: dict[str, str] | None) -> dict[str, str] | None:
    return {k: v.strip() or "-" for k, v in h.items()} if h else None


def judge_worker(data: bytes) -> str | None:
    try:
        reply = decode(data, HookReply)
    except (WireFormatError, ValueError, RecursionError) as exc:
        return f"reply is not a HookReply: {exc}"
    if reply.error is None or reply.error.code != "bad_request":
        return f"answered {reply.error.code if reply.error else reply.result}, not bad_request"
    return None


def judge_service(type_: type[Any]) -> Callable[[bytes], str | None]:
    def judge(data: bytes) -> str | None:
        try:
            reply = decode(data, type_)
        except (WireFormatError, ValueError, RecursionError) as exc:
            return f"reply is not a {type_.__name__}: {exc}"
        if reply.error is None or reply.error.code not in STRUCTURED_SERVICE_ERRORS:
            return f"answered {reply.error or 'a result'}, not a structured request error"
        return None

    return judge


async def assert_decides(d: HookDispatcher, system: System) -> None:
    """A real emit still gets the right decision from the fail-closed guard."""
    bad = await d.emit(system.event, {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}})
    ok = await d.emit(system.event, {"tool_name": "bash", "tool_input": {"command": "ls"}})
    assert (bad.action, bad.decided_by, bad.failures) == ("deny", system.guard, [])
    assert (ok.action, ok.failures) == ("continue", [])


def _no_error_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage()[:200] for r in caplog.records if r.levelno >= logging.ERROR]


# -- worker subjects ------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["handler", "chain", "collect"])
async def test_worker_answers_bad_request(
    system: System, target: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    subject = {
        "handler": handler_subject(system.event, system.guard),
        "chain": chain_subject(system.event, handler_set_id([system.guard])),
        "collect": collect_subject(system.event),
    }[target]
    examples = generate(messages, SHARES[target])
    items = [
        (subject, body, _clean_headers(h))
        for body, h in examples
        if fails_to_decode(body, EventEnvelope)
    ]
    assert len(items) > SHARES[target] // 2
    problems = await send_all(system.nc, items, judge_worker)
    assert problems == [], f"{len(problems)} of {len(items)}: {problems[:5]}"
    assert _no_error_logs(caplog) == []
    async with HookDispatcher(system.nc) as d:
        await assert_decides(d, system)


# -- dispatcher service subjects ------------------------------------------------------------
@pytest.mark.parametrize("target", ["emit", "emit_and_collect"])
async def test_service_answers_structured_errors(system: System, target: str) -> None:
    service = await system.fleet.dispatcher()
    type_, reply_type, subject_of = (
        (EmitRequest, EmitReply, emit_service_subject)
        if target == "emit"
        else (CollectRequest, CollectReply, collect_service_subject)
    )
    examples = generate(messages, SHARES[target])
    items = [
        (subject_of(system.event), body, _clean_headers(h))
        for body, h in examples
        if fails_to_decode(body, type_)
    ]
    # hostile event tokens in the subject too
    for token in ("=ZZ", "=C3=28", "a" * 600, "=2E"):
        items.append((f"{subject_of('x').rpartition('.')[0]}.{token}", b"{}", None))
    assert len(items) > SHARES[target] // 2
    problems = await send_all(system.nc, items, judge_service(reply_type))
    assert problems == [], f"{len(problems)} of {len(items)}: {problems[:5]}"
    # still serving, and right
    req = EmitRequest(data={"tool_name": "bash", "tool_input": {"command": "rm -rf /"}})
    msg = await system.nc.request(emit_service_subject(system.event), encode(req), timeout=10)
    reply = decode(msg.data, EmitReply)
    assert reply.result is not None, reply.error
    assert (reply.result.action, reply.result.decided_by) == ("deny", system.guard)
    assert service.alive
    assert service.tracebacks() == [], service.tail()


# -- KV values of every bucket --------------------------------------------------------------
def bucket_configs() -> list[Any]:
    """Every bucket hookbus declares (``*_bucket_config`` in hookbus._core.buckets)."""
    return [
        getattr(buckets, name)()
        for name in sorted(dir(buckets))
        if name.endswith("_bucket_config") and callable(getattr(buckets, name))
    ]


declaration_like = object_bodies(
    {
        "event": any_field,
        "name": any_field,
        "priority": any_field,
        "tool_filter": any_field | st.just(["*"]),
        "timeout_s": any_field,
        "failure_policy": st.sampled_from(["ignore", "deny", "open", ""]) | any_field,
        "parallel": any_field,
        "subject": any_field,
        "collect_subject": any_field,
        "queue_group": any_field,
    }
)
record_like = object_bodies(
    {
        "label": any_field,
        "hook_id": any_field,
        "status": st.sampled_from(["pending", "resolved", "cancelled", "weird"]) | any_field,
        "created_at": any_field,
        "value": any_field,
        "schema": any_field,
        "metadata": any_field,
        "run_id": any_field,
        "write_id": any_field,
    }
)
kv_values = st.one_of(
    st.binary(max_size=400),
    json_values.map(lambda v: json.dumps(v).encode()),
    declaration_like,
    record_like,
    st.integers(min_value=1500, max_value=5000).map(_nested),
)


def impersonations(event: str, guard: str) -> list[tuple[str, bytes]]:
    """Valid-looking declarations under keys they do not match: a value claiming the
    guard's name and event (fail-open, every tool, an attacker's subject), a value under a
    fresh key that declares the guard's event, an empty subject, a huge timeout."""
    fresh = f"other:{uuid.uuid4().hex[:6]}"
    takeover = HandlerDeclaration(
        event=event,
        name=guard,
        priority=0,
        tool_filter=["*"],
        failure_policy="ignore",
        subject="attacker.inbox",
        collect_subject="attacker.inbox",
        queue_group="attacker",
    )
    return [
        (handler_key(event, "intruder"), encode(takeover)),
        (handler_key(fresh, "x"), encode(takeover)),
        (handler_key(event, guard + "2"), encode(HandlerDeclaration(event=event, name=guard))),
        (handler_key(fresh, "empty"), encode(HandlerDeclaration(event=fresh, name="empty"))),
        (
            handler_key(fresh, "slow"),
            encode(HandlerDeclaration(event=fresh, name="slow", timeout_s=1e9)),
        ),
        (handler_key(fresh, "big"), encode(HandlerDeclaration(event=fresh, name="b" * 5000))),
    ]


async def test_kv_garbage_in_every_bucket(system: System, connect_private: Any) -> None:
    nc = system.nc
    js = nc.jetstream()
    configs = bucket_configs()
    assert {c.bucket for c in configs} >= {
        "hookbus_handlers",
        "hookbus_suspensions",
        "hookbus_approvals",
    }
    service = await system.fleet.dispatcher()
    running = HookDispatcher(await connect_private())
    await running.start()
    try:
        await assert_decides(running, system)
        kvs = {}
        for config in configs:
            try:
                kvs[config.bucket] = await js.create_key_value(config=config)
            except nats.js.errors.BadRequestError:
                kvs[config.bucket] = await js.key_value(config.bucket)
        per_bucket = SHARES["kv"] // len(kvs)
        puts: list[tuple[str, str, bytes]] = []
        for bucket in kvs:
            for i, value in enumerate(generate(kv_values, per_bucket)):
                if bucket == "hookbus_handlers":
                    event = system.event if i % 2 else f"garbage:{uuid.uuid4().hex[:6]}"
                    key = handler_key(event, f"x{i}")
                else:
                    key = suspension_key(f"garbage {i} {uuid.uuid4().hex[:6]}")
                puts.append((bucket, key, value))
        puts += [("hookbus_handlers", k, v) for k, v in impersonations(system.event, system.guard)]
        for bucket, key, value in puts:
            await kvs[bucket].put(key, value)
        await nc.flush()

        # the dispatchers that were running, a new one, and the service: still right
        await running.refresh()
        await assert_decides(running, system)
        async with HookDispatcher(await connect_private()) as fresh:
            await assert_decides(fresh, system)
        req = EmitRequest(data={"tool_name": "bash", "tool_input": {"command": "rm -rf /"}})
        msg = await nc.request(emit_service_subject(system.event), encode(req), timeout=10)
        reply = decode(msg.data, EmitReply)
        assert reply.result is not None, reply.error
        assert (reply.result.action, reply.result.decided_by) == ("deny", system.guard)
        assert service.alive and service.tracebacks() == [], service.tail()

        # a fail-closed handler declared after the garbage is routed by the running one
        later_event, later = f"hostile:{uuid.uuid4().hex[:8]}", f"later_{uuid.uuid4().hex[:6]}"
        w = HookWorker(await connect_private())
        w.add_handler(later_event, guard, name=later, failure_policy="deny", timeout_s=2.0)
        async with w:
            with anyio.fail_after(10):
                while later not in {r.name for r in running.routes(later_event)}:
                    await running.refresh()
            result = await running.emit(
                later_event, {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}
            )
            assert (result.action, result.decided_by) == ("deny", later)

        # the CLI lists what is there, skipping what is not valid
        for args in (("handlers",), ("suspensions", "list"), ("approvals",)):
            status, _out, err = await run_cli(system.fleet.url, *args)
            assert status == 0, (args, err[-2000:])
            assert "Traceback" not in err, (args, err[-2000:])
    finally:
        await running.close()


@pytest.fixture
async def connect_private(private_server: EmbeddedNatsServer) -> AsyncIterator[Any]:
    conns: list[NATS] = []

    async def make() -> NATS:
        conn = await nats.connect(private_server.url)
        conns.append(conn)
        return conn

    yield make
    for conn in conns:
        await conn.close()
