"""The call path under faults: hostile replies, a skewed worker clock, an emit deadline, a
server outage and a stalled replica. Each test asserts the decision, not only "no crash".
Every test talks to a real nats-server; replicas that are paused or skewed run as
separate processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgspec
import nats
import pytest
from _serving import sleeper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    EventEnvelope,
    HookbusError,
    HookReply,
    HookResult,
    WireError,
    WireFormatError,
    decode,
    encode,
    handler_queue_group,
    handler_subject,
)
from hookbus.schemas import telemetry as tn
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


# -- a raw NATS responder: answers each request with exactly the bytes it is given -----------
class RawResponder:
    """Speaks the NATS client protocol over a plain socket, so it can send what no client
    library would: invalid UTF-8, status lines with bodies, any header bytes."""

    def __init__(self, url: str, subject: str, queue: str) -> None:
        u = urlparse(url)
        self._addr = (u.hostname or "127.0.0.1", u.port or 4222)
        self._sub = f"SUB {subject} {queue} 1\r\n".encode()
        self.body = b""
        self.headers: bytes | None = None
        self.requests = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RawResponder:
        self._r, self._w = await asyncio.open_connection(*self._addr)
        await self._r.readline()  # INFO
        connect = b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n'
        self._w.write(connect + self._sub + b"PING\r\n")
        await self._w.drain()
        while (await self._r.readline()).strip() != b"PONG":
            pass
        self._task = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._w.close()

    async def _serve(self) -> None:
        while True:
            parts = (await self._r.readline()).split()
            if parts == [b"PING"]:
                self._w.write(b"PONG\r\n")
                continue
            if not parts or parts[0] not in (b"MSG", b"HMSG"):
                continue
            await self._r.readexactly(int(parts[-1]) + 2)
            self.requests += 1
            reply = parts[3]  # MSG subject sid reply size / HMSG subject sid reply hdr size
            if self.headers is None:
                self._w.write(b"PUB %s %d\r\n%s\r\n" % (reply, len(self.body), self.body))
            else:
                size = len(self.headers) + len(self.body)
                self._w.write(
                    b"HPUB %s %d %d\r\n%s%s\r\n"
                    % (reply, len(self.headers), size, self.headers, self.body)
                )
            await self._w.drain()


async def _declare(nc: Any, event: str, name: str, **options: Any) -> None:
    """Declare a handler the way a worker does, then stop serving it (the raw responder
    takes its subject)."""
    w = HookWorker(nc)

    async def placeholder(ev: str, data: dict[str, Any]) -> None:
        return None

    w.add_handler(event, placeholder, name=name, **options)
    await w.start()
    await w.shutdown()


@contextlib.asynccontextmanager
async def _raw_handler(
    nats_url: str, connect: Any, event: str, policy: str
) -> AsyncIterator[tuple[RawResponder, HookDispatcher]]:
    await _declare(await connect(), event, "raw", failure_policy=policy, timeout_s=3)
    async with (
        RawResponder(nats_url, handler_subject(event, "raw"), handler_queue_group("raw")) as r,
        HookDispatcher(await connect()) as d,
    ):
        yield r, d


OK = b'{"handler":"raw","result":{"action":"continue"}}'
_DEEP = b"[" * 5000 + b"]" * 5000
HOSTILE: dict[str, tuple[bytes | None, bytes]] = {
    "invalid utf-8 in a string": (None, b'{"handler":"raw","result":{"data":{"k":"\xff\xfe"}}}'),
    "invalid utf-8 in the handler": (None, b'{"handler":"r\xc3","result":{}}'),
    "invalid utf-8 outside strings": (None, b"\xff\xfe\xfd"),
    "deep nesting": (None, b'{"handler":"raw","result":{"data":{"k":%s}}}' % _DEEP),
    "number out of range": (None, b'{"handler":"raw","result":{"data":{"k":1e999999}}}'),
    "wrong types": (None, b'{"handler":7,"result":{"action":"explode"}}'),
    "an array": (None, b"[]"),
    "empty": (None, b""),
    "neither result nor error": (None, b'{"handler":"raw"}'),
    "a 503 status with a body": (b"NATS/1.0 503\r\n\r\n", OK),
    "a status line with invalid utf-8": (b"NATS/1.0 \xff\xfe\r\n\r\n", b"x"),
}  # fmt: skip


@pytest.mark.parametrize("policy", ["deny", "ignore"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_reply_is_a_bad_reply_denied_whatever_the_policy(
    nats_url, connect, event, case, policy
):
    """A reply that cannot be read might have been a deny: it fails closed even under
    ``ignore`` (as amplifier-core denies a handler result it cannot parse)."""
    async with _raw_handler(nats_url, connect, event, policy) as (responder, d):
        responder.headers, responder.body = HOSTILE[case]
        result = await d.emit(event, {"n": 1})
        assert [(f.handler, f.kind, f.policy) for f in result.failures] == [
            ("raw", "bad_reply", "deny")
        ]
        assert result.action == "deny"
        # the connection still hears replies: a good one is a result again
        responder.headers, responder.body = None, OK
        again = await d.emit(event, {"n": 2})
        assert again.failures == [] and again.action == "continue"


@pytest.mark.parametrize("policy", ["deny", "ignore"])
async def test_a_reply_with_fields_hookbus_does_not_know_keeps_its_deny(
    nats_url, connect, event, policy
):
    """A newer worker's reply: unknown fields (top level, in the result, in an injection
    item) are ignored and its decision stands, never a bad reply turned into a continue."""
    body = (
        b'{"handler":"raw","from_the_future":1,"result":{"action":"deny","reason":"no",'
        b'"user_message_source":"policy","severity":"high","context_injections":'
        b'[{"content":"c","priority":3}]}}'
    )
    async with _raw_handler(nats_url, connect, event, policy) as (responder, d):
        responder.body = body
        result = await d.emit(event, {})
    assert result.action == "deny" and result.reason == "no" and result.failures == []
    assert result.user_message_source == "policy"


async def test_status_line_with_invalid_utf8_does_not_silence_the_dispatcher(
    nats_url, connect, event
):
    """nats-py decodes a status description strictly in its read loop: one such reply
    used to leave the dispatcher's connection deaf for good (every later emit a timeout)."""
    async with _raw_handler(nats_url, connect, event, "deny") as (responder, d):
        responder.headers, responder.body = b"NATS/1.0 503 \xff\xfe\r\n\r\n", b""
        await d.emit(event, {})
        responder.headers, responder.body = None, OK
        after = await d.emit(event, {})
    assert after.failures == [] and after.action == "continue"


_KEYS = st.sampled_from(["handler", "result", "error", "action", "data", "code", "message"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=20,
)
_BROKEN_UTF8 = st.binary(min_size=1, max_size=8).map(
    lambda junk: b'{"handler":"raw","result":{"action":"continue","data":{"k":"%s"}}}' % junk
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=st.one_of(st.binary(max_size=300), _JSON.map(msgspec.json.encode), _BROKEN_UTF8))
async def test_any_reply_bytes_end_as_a_decision(nats_url, connect, event, body):
    """Whatever bytes come back, emit returns a decision: the reply's own result if the
    bytes are a valid reply, else ``bad_reply`` under the deny policy. It never raises."""
    async with _raw_handler(nats_url, connect, event, "deny") as (responder, d):
        responder.body = body
        result = await d.emit(event, {})
    try:
        valid = decode(body, HookReply).result is not None
    except WireFormatError:
        valid = False
    if valid:
        assert result.failures == [] or result.failures[0].kind != "bad_reply"
    else:
        assert [(f.kind, f.policy) for f in result.failures] == [("bad_reply", "deny")]
        assert result.action == "deny"


# -- worker processes (skewed clock, stalled replica) ---------------------------------------------
WORKER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, time
    import nats
    from hookbus.workers import HookWorker

    url, event, skew, log = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    real_time = time.time
    time.time = lambda: real_time() + skew  # this host's wall clock is off by `skew` s

    async def main():
        nc = await nats.connect(url)
        w = HookWorker(nc)
        calls = open(log, "a", buffering=1)

        async def gate(ev, data):
            return {"action": "continue"}

        async def audit(ev, data):
            calls.write(f"{data['n']}\\n")
            return None

        def add(fn, **options):
            try:
                w.add_handler(event, fn, **options)
            except TypeError:  # a worker without retry_safe: declare it without
                options.pop("retry_safe")
                w.add_handler(event, fn, **options)

        add(gate, priority=1, failure_policy="deny", timeout_s=1.0, retry_safe=True)
        add(audit, priority=2, failure_policy="ignore", timeout_s=1.0, retry_safe=False)
        await w.start()
        print("ready", flush=True)
        await w.run(handle_signals=True)
        await nc.close()

    asyncio.run(main())
    """
)


@pytest.fixture
def worker_process(tmp_path: Path, nats_url: str) -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(event: str, *, skew_s: float = 0.0, log: Path) -> subprocess.Popen[str]:
        script = tmp_path / "worker.py"
        script.write_text(WORKER_SCRIPT)
        proc = subprocess.Popen(
            [sys.executable, str(script), nats_url, event, str(skew_s), str(log)],
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ.copy(),
        )
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # blocks until it serves
        return proc

    yield start
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.faults
async def test_worker_with_a_skewed_clock_still_answers(connect, event, worker_process, tmp_path):
    """A worker whose wall clock is an hour ahead serves as any other: the envelope carries
    a relative budget, not a wall-clock deadline, so a deny-policy handler denies nothing."""
    worker_process(event, skew_s=3600.0, log=tmp_path / "calls.txt")
    async with HookDispatcher(await connect()) as d:
        results = [await d.emit(event, {"n": n}) for n in range(20)]
    assert [r.action for r in results] == ["continue"] * 20
    assert all(r.failures == [] for r in results), results[0].failures


@pytest.mark.faults
async def test_stalled_replica_costs_latency_not_decisions(
    connect, event, worker_process, tmp_path
):
    """Two replica processes; one is paused (SIGSTOP, as a GC pause or a hung loop would)
    under load. The retry_safe deny-policy handler is hedged to the live replica, so
    (nearly) no emit is denied; the non-retry_safe handler is never run twice for a call."""
    logs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    stalled = worker_process(event, log=logs[0])
    worker_process(event, log=logs[1])
    results: list[HookResult] = []
    async with HookDispatcher(await connect()) as d:
        loop = asyncio.get_running_loop()
        end = loop.time() + 4.5
        counter = iter(range(10**9))

        async def agent() -> None:
            while loop.time() < end:
                results.append(await d.emit(event, {"n": next(counter)}))

        agents = [asyncio.create_task(agent()) for _ in range(50)]
        await asyncio.sleep(0.5)  # steady load first
        os.kill(stalled.pid, signal.SIGSTOP)
        await asyncio.sleep(3.0)  # a 3 s stall under load
        os.kill(stalled.pid, signal.SIGCONT)
        await asyncio.gather(*agents)
    n = len(results)
    denied = sum(1 for r in results if r.action == "deny")
    timeouts = sum(1 for r in results for f in r.failures if f.handler == "audit")
    print(f"\n3 s stall: {denied}/{n} emits denied, {timeouts} audit calls timed out (ignore)")
    assert denied <= max(3, n // 1000), f"{denied} of {n} emits denied by policy"
    await asyncio.sleep(1.5)  # let the resumed replica finish what it had buffered
    calls = [line for log in logs for line in log.read_text().split()]
    assert len(calls) == len(set(calls)), "a non-retry_safe handler ran twice for one call"


# -- deadlines -----------------------------------------------------------------------------------
async def test_emit_deadline_cuts_the_chain(connect, event):
    """emit(timeout_s=...) bounds the whole chain: the slow handler is cut to what was left
    and the handler not reached in time is a ``timeout`` judged by its (deny) policy."""
    dnc = await connect()
    w = HookWorker(await connect())
    ran: list[str] = []

    @w.handler(event, priority=1, timeout_s=5.0)
    async def slow(ev: str, data: dict[str, Any]) -> None:
        ran.append("slow")
        await asyncio.sleep(3.0)

    @w.handler(event, priority=2, timeout_s=5.0, failure_policy="deny")
    async def policy(ev: str, data: dict[str, Any]) -> None:
        ran.append("policy")

    async with w, HookDispatcher(dnc) as d:
        t0 = asyncio.get_running_loop().time()
        result = await d.emit(event, {}, timeout_s=0.5)
        took = asyncio.get_running_loop().time() - t0
    assert [(f.handler, f.kind, f.policy) for f in result.failures] == [
        ("slow", "timeout", "ignore"),
        ("policy", "timeout", "deny"),
    ]
    assert result.action == "deny" and ran == ["slow"]
    assert took < 3.0  # the 5 s handler timeout was cut to the emit's budget


async def test_worker_never_runs_past_the_callers_budget(connect, event):
    """The worker cuts its handler's own timeout to the budget in the envelope, and a
    request whose budget is already spent is answered at once, not dropped."""
    nc = await connect()
    long, cancelled = sleeper("long", 10)
    w = HookWorker(nc)
    w.add_handler(event, long, timeout_s=30)
    async with w:
        client = await connect()
        subject = handler_subject(event, "long")
        body = b'{"id":"x","event":"%s","data":{},"budget_s":0.2}' % event.encode()
        reply = decode((await client.request(subject, body, timeout=5)).data, HookReply)
        assert reply.error is not None and reply.error.code == "handler_timeout"
        assert cancelled.is_set()
        spent = b'{"id":"y","event":"%s","data":{},"budget_s":-1}' % event.encode()
        reply = decode((await client.request(subject, spent, timeout=5)).data, HookReply)
        assert reply.error is not None
        assert (reply.error.code, reply.error.retryable) == ("deadline_exceeded", True)


# -- an outage: only hookbus errors or decisions come out ------------------------------------------
@pytest.mark.faults
async def test_emit_during_an_outage_raises_only_hookbus_errors(embedded_server, event):
    url = embedded_server.url
    wnc = await nats.connect(url)
    dnc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    w = HookWorker(wnc)

    @w.handler(event, failure_policy="deny", timeout_s=0.5)
    async def gate(ev: str, data: dict[str, Any]) -> None:
        return None

    await w.start()
    d = HookDispatcher(dnc)
    ask = f"{event}:ask"

    @d.register(ask, failure_policy="deny")
    async def asks(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="go?", approval_timeout=1)

    await d.start()
    assert (await d.emit(event, {})).action == "continue"
    embedded_server.stop()
    outcomes: list[str] = []
    for i in range(30):
        try:  # a remote handler, and an approval (KV) while the server is gone
            r = await d.emit(ask if i == 0 else event, {"session_id": "s", "i": i})
            outcomes.append(r.action)
            assert r.action == "deny" and (r.failures == [] or r.failures[0].policy == "deny")
        except HookbusError as exc:
            outcomes.append(type(exc).__name__)
        await asyncio.sleep(0.01)
    with contextlib.suppress(OSError):
        await dnc.close()
    try:
        await d.emit(event, {})
    except HookbusError as exc:
        outcomes.append(type(exc).__name__)
    assert outcomes[-1] == "NotConnectedError"
    # anything but a hookbus error would have propagated: decisions are all fail-closed
    assert "continue" not in outcomes, outcomes
    with contextlib.suppress(Exception):
        await wnc.close()


# -- hedging and refusals, seen from the replicas ------------------------------------------------
@pytest.mark.parametrize("retry_safe", [True, False])
async def test_hedged_only_when_retry_safe(connect, event, retry_safe):
    """A replica that never answers (stalled): a retry_safe call is sent again within its
    budget, each request numbered in ``attempt`` with the budget left; any other call is
    sent exactly once. Either way the call ends as a ``timeout`` under its policy."""
    await _declare(
        await connect(), event, "slow", failure_policy="deny", timeout_s=1.0, retry_safe=retry_safe
    )
    stalled = await connect()
    seen: list[EventEnvelope] = []

    async def record(msg: Any) -> None:  # and never answer
        seen.append(decode(msg.data, EventEnvelope))

    await stalled.subscribe(
        handler_subject(event, "slow"), queue=handler_queue_group("slow"), cb=record
    )
    await stalled.flush()
    async with HookDispatcher(await connect()) as d:
        result = await d.emit(event, {})
    assert [(f.kind, f.policy) for f in result.failures] == [("timeout", "deny")]
    assert len({e.id for e in seen}) == 1
    attempts = [e.attempt for e in seen]
    budgets = [e.budget_s or 0.0 for e in seen]
    if retry_safe:
        assert attempts == list(range(1, len(seen) + 1)) and len(seen) >= 3, attempts
        assert budgets == sorted(budgets, reverse=True) and budgets[0] <= 1.0
    else:
        assert attempts == [1] and budgets[0] <= 1.0


@pytest.mark.parametrize("code", ["busy", "unavailable"])
async def test_refused_calls_go_to_another_replica(connect, event, code):
    """A replica that refuses every request (over its bound, or draining) says nothing ran:
    the call is sent again and the other replica decides it, even for a handler that is
    not retry_safe. Before, half the calls failed and a deny policy denied them."""
    refuser = await connect()
    refusal = encode(
        HookReply(handler="gate", error=WireError(code=code, message="no", retryable=True))
    )
    refused = 0

    async def refuse(msg: Any) -> None:
        nonlocal refused
        refused += 1
        await msg.respond(refusal)

    w = HookWorker(await connect())

    @w.handler(event, failure_policy="deny", timeout_s=5.0)
    async def gate(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w, HookDispatcher(await connect()) as d:
        await refuser.subscribe(
            handler_subject(event, "gate"), queue=handler_queue_group("gate"), cb=refuse
        )
        await refuser.flush()
        results = [await d.emit(event, {"n": n}) for n in range(50)]
    denied = [r for r in results if r.action == "deny"]
    assert refused > 0 and w.handled + len(denied) == 50
    assert len(denied) <= 2, [r.failures for r in denied]  # 1 in 256 per call


# -- hedges reach another replica --------------------------------------------------------------
def _replica(who: str, seen: dict[str, list[tuple[str, int]]], stuck: asyncio.Event) -> Any:
    """Handlers ``gate`` and ``audit`` of one replica, noting each call it takes in
    ``seen[who]``; the ``stalled`` replica never finishes one until `stuck` is set."""

    async def gate(ev: str, data: dict[str, Any]) -> dict[str, str]:
        seen[who].append(("gate", data["n"]))
        if who == "stalled":
            await stuck.wait()
        return {"action": "continue"}

    async def audit(ev: str, data: dict[str, Any]) -> None:
        seen[who].append(("audit", data["n"]))
        if who == "stalled":
            await stuck.wait()

    return gate, audit


async def test_hedge_goes_to_another_instance_than_the_stalled_one(connect, event):
    """Two worker instances of the same handlers; one never finishes a call (a hung loop).
    Every call it takes of the retry_safe ``gate`` is hedged to the instance that answered
    recently, never back to the stalled one (before, the queue group picked again at random
    and half the hedges landed on the stalled replica); the ``audit`` handler, not
    retry_safe, is still sent exactly once per call and its stalled calls time out."""
    stuck = asyncio.Event()  # set only at the end: the stalled instance hangs until then
    seen: dict[str, list[tuple[str, int]]] = {"stalled": [], "healthy": []}
    workers = {"stalled": HookWorker(await connect()), "healthy": HookWorker(await connect())}
    for who, w in workers.items():
        gate, audit = _replica(who, seen, stuck)
        w.add_handler(
            event, gate, priority=1, failure_policy="deny", timeout_s=1.0, retry_safe=True
        )
        w.add_handler(event, audit, priority=2, failure_policy="ignore", timeout_s=0.3)
    async with workers["stalled"], workers["healthy"], HookDispatcher(await connect()) as d:
        n = 0
        while not seen["healthy"]:  # until the healthy instance has answered once
            await d.emit(event, {"n": n})
            n += 1
        first = n
        results = [await d.emit(event, {"n": n}) for n in range(first, first + 24)]
        stuck.set()
    assert [r.action for r in results] == ["continue"] * 24, [r.failures for r in results]
    stalled = [(h, m) for h, m in seen["stalled"] if m >= first]
    healthy = [(h, m) for h, m in seen["healthy"] if m >= first]
    gates_stalled = [m for h, m in stalled if h == "gate"]
    assert gates_stalled, "no call reached the stalled instance: the fault never happened"
    # each call the stalled instance took was hedged to the healthy one, not back to it
    assert len(gates_stalled) == len(set(gates_stalled)), sorted(gates_stalled)
    assert set(gates_stalled) <= {m for h, m in healthy if h == "gate"}
    # not retry_safe: one request per call, wherever it landed; a stalled one times out
    audits = sorted(m for h, m in stalled + healthy if h == "audit")
    assert audits == list(range(first, first + 24))
    audit_stalled = {m for h, m in stalled if h == "audit"}
    for m, r in zip(range(first, first + 24), results, strict=True):
        kinds = [(f.handler, f.kind, f.policy) for f in r.failures]
        assert kinds == ([("audit", "timeout", "ignore")] if m in audit_stalled else []), kinds
    instances = {workers["stalled"].instance, workers["healthy"].instance}
    assert len(instances) == 2 and "" not in instances


async def _until_interest(nc: Any, subject: str) -> None:
    """Wait until a request from `nc` on `subject` reaches a subscriber (no 503): under
    load the server may briefly not see a subscription flushed on another connection."""
    while True:
        try:
            await nc.request(subject, b"probe", timeout=0.05)
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.01)
        except nats.errors.TimeoutError:
            return
        else:
            return


async def test_hedge_to_a_gone_instance_falls_back_to_the_queue_group(connect, event):
    """The instance that answered last has shut down; a replica that never answers is the
    only one left. The hedge to the gone instance gets "no responders": the instance is
    forgotten, the next requests go to the queue group, and the call ends as the stalled
    replica's ``timeout`` under the deny policy, not as ``no_responders``."""
    w = HookWorker(await connect())

    @w.handler(event, failure_policy="deny", timeout_s=1.0, retry_safe=True)
    async def slow(ev: str, data: dict[str, Any]) -> None:
        return None

    stalled, dnc = await connect(), await connect()
    seen: list[EventEnvelope] = []

    async def record(msg: Any) -> None:  # and never answer
        with contextlib.suppress(WireFormatError):  # a probe
            seen.append(decode(msg.data, EventEnvelope))

    subject = handler_subject(event, "slow")
    await w.start()
    async with HookDispatcher(dnc) as d:
        assert [r.name for r in d.routes(event)] == ["slow"]
        await _until_interest(dnc, subject)
        first = await d.emit(event, {})  # the worker answers: its instance is known
        await w.shutdown()
        await stalled.subscribe(subject, queue=handler_queue_group("slow"), cb=record)
        await stalled.flush()
        await _until_interest(dnc, subject)
        result = await d.emit(event, {})
    assert first.action == "continue" and first.failures == []
    assert [(f.kind, f.policy) for f in result.failures] == [("timeout", "deny")], (
        result.failures,
        [e.attempt for e in seen],
    )
    attempts = [e.attempt for e in seen]
    assert attempts[0] == 1 and 2 not in attempts and len(attempts) >= 2, attempts


async def test_a_replaced_workers_first_call_goes_to_the_queue_group_at_once(connect, event, otel):
    """A call timed out with no answer at all: the handler's queue subject is suspect, and
    a call's first request goes to the instance seen alive since. That worker is then
    replaced (shut down; a new instance starts). The next call's first request meets "no
    responders" on the old instance's subject: the request goes to the queue group at once,
    within the same budget, and the new instance decides it — not a wait of the whole
    timeout ending in a ``timeout`` the deny policy turns into a deny. Its ``send`` span
    shows both requests (only the second could run the handler) and who answered."""
    release = asyncio.Event()

    async def gate(ev: str, data: dict[str, Any]) -> dict[str, str]:
        if data.get("stall"):  # hung past its cut, as in a blocking call: no reply at all
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
        return {"action": "continue"}

    def worker(nc: Any) -> HookWorker:
        w = HookWorker(nc)
        w.add_handler(event, gate, name="gate", timeout_s=10.0, failure_policy="deny")
        return w

    old = worker(await connect())
    await old.start()
    async with HookDispatcher(await connect()) as d:
        stalled = await d.emit(event, {"stall": True}, timeout_s=0.5)
        release.set()  # its late reply is dropped
        (failure,) = stalled.failures
        assert failure.kind == "timeout" and failure.message.startswith("no reply within"), (
            f"the fault never happened: the stalled call was answered ({failure.message})"
        )
        # answered by the old instance since the stall: the target of a call's first request
        assert (await d.emit(event, {})).failures == []
        await old.shutdown()
        async with worker(await connect()) as new:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            result = await d.emit(event, {"n": 1})
            took = loop.time() - t0
    assert result.action == "continue" and result.failures == [], result.failures
    assert took < 5.0, f"{took:.2f}s: the call waited for the gone instance"
    send = [s for s in otel.spans() if s.name == f"send {event} gate"][-1]  # the last call's
    assert send.attributes[tn.REQUESTS] == 2, "the first request did not go to the old instance"
    assert send.attributes[tn.WORKER_INSTANCE] == new.instance != old.instance
