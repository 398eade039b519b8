"""Fault tests on a fleet of real processes (``hookbus worker`` / ``hookbus dispatcher``)
and on the KV protocol under lost acks, a skewed clock and approvals that end at the
deadline. Every test asserts the decision each call got, not only that nothing crashed.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
from _cluster import wait_for
from _fleet import Fleet, HandlerConf, Load, check_decision, steady_load
from _proxy import NatsProxy
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import (
    SUSPENSIONS_BUCKET,
    AlreadySettledError,
    EmitReply,
    EmitRequest,
    HookEvent,
    HookPart,
    HookResult,
    decode,
    emit_service_subject,
    encode,
)
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

SUSPENSIONS_STREAM = f"KV_{SUSPENSIONS_BUCKET}"


def names() -> tuple[str, str]:
    return f"faults:{uuid.uuid4().hex[:10]}", f"guard_{uuid.uuid4().hex[:6]}"


@pytest.fixture
async def fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with Fleet(nats_url, tmp_path) as f:
        yield f


async def routed(d: HookDispatcher, event: str, name: str) -> None:
    """Wait until the dispatcher routes `name` (declared by a worker process)."""
    with anyio.fail_after(10):
        while name not in {r.name for r in d.routes(event)}:
            await d.refresh()


async def run_load(d: HookDispatcher, event: str, guard: str, fault: Any, after: int) -> Load:
    """Steady load; `fault()` runs once `after` emits are done; then as many again."""
    load, stop = Load(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(steady_load, d, event, guard, load, stop, 8)
        await wait_for(lambda: _done(load, after), timeout_s=30, interval_s=0.05)
        await fault()
        target = 2 * after + load.decided + len(load.undecided)
        await wait_for(lambda: _done(load, target), timeout_s=30, interval_s=0.05)
        stop.set()
    return load


async def _done(load: Load, n: int) -> bool:
    return load.decided + len(load.undecided) >= n


async def replica_fault_under_load(
    fleet: Fleet, nc: NATS, guard: HandlerConf, fault: str, after: int
) -> Load:
    """Two worker replicas serving the fail-closed `guard`, a dispatcher on `nc` routed to
    it, steady load (`run_load`); once `after` emits are done, the first replica is
    ``"kill"``-ed (SIGKILL) or ``"pause"``-d (SIGSTOP, resumed when the load is over)."""
    a = await fleet.worker([guard])
    await fleet.worker([guard])
    async with HookDispatcher(nc) as d:
        await routed(d, guard.event, guard.name)

        async def hit() -> None:
            getattr(a, fault)()

        try:
            return await run_load(d, guard.event, guard.name, hit, after=after)
        finally:
            if fault == "pause":
                a.resume()


# -- 2. a worker replica SIGKILLed under load ------------------------------------------------
async def test_worker_replica_killed_under_load(fleet: Fleet, nc: NATS) -> None:
    event, guard = names()
    conf = HandlerConf(event, guard, priority=10, failure_policy="deny", timeout_s=1.0)
    load = await replica_fault_under_load(fleet, nc, conf, "kill", after=300)
    assert load.undecided == [], sorted(set(load.undecided))
    assert load.wrong == [], sorted(set(load.wrong))[:5]


# -- a replica paused (SIGSTOP): latency, not decisions -------------------------------------
async def test_stalled_replica_costs_latency_not_decisions(fleet: Fleet, nc: NATS) -> None:
    event, guard = names()
    conf = HandlerConf(
        event, guard, priority=10, failure_policy="deny", timeout_s=2.0, retry_safe=True
    )
    load = await replica_fault_under_load(fleet, nc, conf, "pause", after=200)
    assert load.undecided == [], sorted(set(load.undecided))
    assert load.wrong == [], sorted(set(load.wrong))[:5]
    # the healthy replica was there: a harmless call must not be denied by a timeout
    # (the request is hedged on the other replica within the caller's budget)
    assert load.failed_closed == 0, f"{load.failed_closed} calls denied by a stalled replica"


# -- 3. SIGTERM drain under load: worker and dispatcher service -----------------------------
async def test_sigterm_drain_answers_every_request(fleet: Fleet, nc: NATS) -> None:
    event, guard = names()
    slow, asker = f"slow_{uuid.uuid4().hex[:6]}", f"ask_{uuid.uuid4().hex[:6]}"
    worker = await fleet.worker(
        [
            HandlerConf(event, guard, priority=10, failure_policy="deny", timeout_s=5.0),
            HandlerConf(event, slow, priority=20, timeout_s=5.0, sleep_s=0.5),
            # an approval nobody answers: the drain must not wait its 300 s
            HandlerConf(event, asker, priority=5, tool_filter=["approve"], ask=True),
        ]
    )
    service = await fleet.dispatcher()
    answers: list[str] = []

    async def call(tool: str, command: str) -> None:
        req = EmitRequest(
            data={"tool_name": tool, "tool_input": {"command": command}},
            session_id=f"s-{uuid.uuid4().hex[:8]}",
        )
        try:
            msg = await nc.request(emit_service_subject(event), encode(req), timeout=40)
        except Exception as exc:
            answers.append(f"no answer: {type(exc).__name__}")
            return
        reply = decode(msg.data, EmitReply)
        if reply.result is not None:
            destructive = "rm -rf" in command
            why = check_decision(reply.result, destructive, guard)
            answers.append(f"wrong: {why}" if why else "result")
        elif reply.error is not None and reply.error.retryable:
            answers.append("retryable")
        else:
            answers.append(f"non-retryable error: {reply.error}")

    started = time.monotonic()
    async with HookDispatcher(nc, approvals=False) as watcher, anyio.create_task_group() as tg:
        events = await watcher.hook_events()
        for i in range(60):
            tg.start_soon(call, "bash", "rm -rf /x" if i % 2 else "ls")
        for _ in range(3):
            tg.start_soon(call, "approve", "ls")
        pending: set[str] = set()
        with anyio.fail_after(10):  # the approvals are waiting: the service is mid-work
            async for ev in events:
                if ev.hook.status == "pending" and ev.hook.metadata.get("handler") == asker:
                    pending.add(ev.hook.label)
                    if len(pending) == 3:
                        break
        await events.aclose()
        service.terminate()
        worker.terminate()
        status = [await service.wait_exit(35), await worker.wait_exit(35)]
    took = time.monotonic() - started
    assert status == [0, 0], (service.tail(), worker.tail())
    assert fleet.left_running() == []
    bad = [a for a in answers if a not in ("result", "retryable")]
    assert bad == [], bad
    assert len(answers) == 63
    assert took < 30, f"drain took {took:.1f}s: not below Kubernetes' 30 s grace"


# -- 4. lost KV acks (a proxy drops the JetStream publish ack of a write) --------------------
@pytest.fixture
async def proxy(nats_url: str) -> AsyncIterator[NatsProxy]:
    async with NatsProxy(nats_url.split(",")[0]) as p:
        yield p


class Choice(msgspec.Struct):
    value: str


def suspension_ack(m: Any) -> bool:
    return bool(m.is_pub_ack(SUSPENSIONS_STREAM))


@contextlib.asynccontextmanager
async def agent_and_resolver(
    proxy: NatsProxy, connect: Connect, *, proxied: str
) -> AsyncIterator[tuple[HookDispatcher, HookDispatcher]]:
    """``(d, r)``: an agent's dispatcher and a resolver's (another process's), approvals
    off, each on a connection of its own; the `proxied` one (``"agent"`` or
    ``"resolver"``) connects through `proxy`, whose acks the test drops."""
    direct = await connect()
    through_proxy = await nats.connect(proxy.url, max_reconnect_attempts=2)
    agent_nc, resolver_nc = (
        (through_proxy, direct) if proxied == "agent" else (direct, through_proxy)
    )
    try:
        async with (
            HookDispatcher(agent_nc, approvals=False) as d,
            HookDispatcher(resolver_nc, approvals=False) as r,
        ):
            yield d, r
    finally:
        await through_proxy.close()


async def test_lost_ack_consuming_a_preregistered_resolution(
    proxy: NatsProxy, connect: Connect
) -> None:
    label = f"lost-ack {uuid.uuid4().hex}"
    async with agent_and_resolver(proxy, connect, proxied="agent") as (d, r):
        await r.resolve_hook(label, Choice("yes"))  # pre-registered
        proxy.drop_next(1, suspension_ack)  # the consume's ack is lost
        with anyio.fail_after(20):
            got = await d.hook(label, Choice, timeout_s=15)
        assert got == Choice("yes")
        assert len(proxy.dropped) == 1, "the fault was not injected"
        # consumed exactly once: a new hook on the label waits (nobody resolves it)
        with pytest.raises(TimeoutError):
            await d.hook(label, Choice, timeout_s=1)


async def test_lost_ack_of_the_winning_resolve(proxy: NatsProxy, connect: Connect) -> None:
    label = f"lost-ack {uuid.uuid4().hex}"
    async with agent_and_resolver(proxy, connect, proxied="resolver") as (d, r):
        events = await d.hook_events()
        got: list[Choice] = []
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                got.append(await d.hook(label, Choice, timeout_s=20))

            tg.start_soon(wait)
            seen: list[str] = []
            with anyio.fail_after(20):
                async for ev in events:
                    if ev.hook.label == label:
                        seen.append(ev.hook.status)
                        if ev.hook.status == "pending":
                            proxy.drop_next(1, suspension_ack)
                            await r.resolve_hook(label, Choice("go"))  # must not raise
                        if ev.hook.status == "resolved":
                            break
        await events.aclose()
        assert len(proxy.dropped) == 1, "the fault was not injected"
        assert got == [Choice("go")]
        assert seen == ["pending", "resolved"]


async def test_lost_ack_of_hook_creation(proxy: NatsProxy, connect: Connect) -> None:
    label = f"lost-ack {uuid.uuid4().hex}"
    async with agent_and_resolver(proxy, connect, proxied="agent") as (d, r):
        proxy.drop_next(1, suspension_ack)  # the pending record's ack is lost
        got: list[Choice] = []
        async with anyio.create_task_group() as tg:

            async def wait() -> None:
                got.append(await d.hook(label, Choice, timeout_s=20))

            tg.start_soon(wait)
            with anyio.fail_after(20):
                await wait_for(_dropped(proxy), interval_s=0.05)
                while True:  # resolve once the record is pending (the agent reconciles)
                    got_record = await r.suspensions.get(label)
                    if got_record is not None and got_record[0].status == "pending":
                        break
                    await anyio.sleep(0.05)
                await r.resolve_hook(label, Choice("ok"))
        assert got == [Choice("ok")]  # no DuplicateSuspensionError against itself


def _dropped(proxy: NatsProxy) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return bool(proxy.dropped)

    return check


# -- 5. a worker whose wall clock is off ---------------------------------------------------
@pytest.mark.parametrize("skew_s", [120.0, -120.0])
async def test_skewed_clock_worker_answers(fleet: Fleet, nc: NATS, skew_s: float) -> None:
    event, guard = names()
    await fleet.worker(
        [HandlerConf(event, guard, priority=10, failure_policy="deny", timeout_s=2.0)],
        skew_s=skew_s,
    )
    async with HookDispatcher(nc) as d:
        await routed(d, event, guard)
        harmless = await d.emit(event, {"tool_name": "bash", "tool_input": {"command": "ls"}})
        bad = await d.emit(event, {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}})
    assert (harmless.action, harmless.failures) == ("continue", [])
    assert (bad.action, bad.reason, bad.decided_by, bad.failures) == (
        "deny",
        "destructive",
        guard,
        [],
    )


# -- 6. approvals that time out, are cancelled, or are answered at the deadline ------------
class Approvals:
    """An approver on its own connection, reading hook events of one session."""

    def __init__(self, client: ApprovalsClient, session: str) -> None:
        self.client, self.session = client, session
        self.stream: Any = None
        self.pending: list[HookPart] = []

    async def __aenter__(self) -> Approvals:
        self.stream = await self.client.events()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stream.aclose()

    async def next_pending(self, timeout_s: float = 10) -> HookPart:
        with anyio.fail_after(timeout_s):
            while True:
                ev: HookEvent = await self.stream.__anext__()
                h = ev.hook
                if h.status == "pending" and h.metadata.get("session_id") == self.session:
                    self.pending.append(h)
                    return h


@pytest.fixture
async def asking(nc: NATS, connect: Connect) -> AsyncIterator[Any]:
    """(agent dispatcher, approver's client, event, session, serve(timeout, default))."""
    event = f"faults:{uuid.uuid4().hex[:10]}"
    session = f"session-{uuid.uuid4().hex[:10]}"
    settings: dict[str, Any] = {}

    async def ask(event_: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user",
            approval_prompt=f"run {data.get('tool_name')}?",
            approval_timeout=settings["timeout"],
            approval_default=settings["default"],
        )

    w = HookWorker(await connect())
    w.add_handler(event, ask, name="asker", timeout_s=2.0, failure_policy="deny")
    async with w, HookDispatcher(nc) as d, ApprovalsClient(await connect()) as approver:
        d.set_default_fields(session_id=session, agent_id="agent-a")
        await routed(d, event, "asker")
        yield d, approver, event, session, settings


DATA = {"tool_name": "bash", "tool_input": {"command": "ls"}}


async def test_timed_out_approval_asks_anew(asking: Any) -> None:
    d, approver, event, session, settings = asking
    settings.update(timeout=1.0, default="allow")
    async with Approvals(approver, session) as a:
        first = await d.emit(event, dict(DATA))
        assert first.action == "continue"  # the default applied
        async with anyio.create_task_group() as tg:
            second: list[HookResult] = []

            async def emit() -> None:
                second.append(await d.emit(event, dict(DATA)))

            tg.start_soon(emit)
            await a.next_pending()  # asked again, not decided by the first call's record
        assert second[0].action == "continue"
        assert len(a.pending) == 1


async def test_cancelled_approval_denies_that_call_only(asking: Any) -> None:
    d, approver, event, session, settings = asking
    settings.update(timeout=10.0, default="allow")
    async with Approvals(approver, session) as a:
        results: list[HookResult] = []
        async with anyio.create_task_group() as tg:

            async def emit() -> None:
                results.append(await d.emit(event, dict(DATA)))

            tg.start_soon(emit)
            pending = await a.next_pending()
            await approver.cancel_approval(
                pending.label, reason="client went away", agent_id=pending.agent_id
            )
        assert results[0].action == "deny"
        async with anyio.create_task_group() as tg:
            tg.start_soon(emit)
            again = await a.next_pending()  # the next identical call asks anew
            assert again.label != pending.label or again.hook_id != pending.hook_id
            await approver.answer_approval(
                again.label, "Allow", approver="tester", agent_id=again.agent_id
            )
        assert results[1].action == "continue"


async def test_answer_at_the_deadline_decides_its_call(asking: Any) -> None:
    d, approver, event, session, settings = asking
    settings.update(timeout=1.0, default="deny")
    outcomes: list[tuple[bool, str]] = []
    results: list[HookResult] = []
    async with Approvals(approver, session) as a:

        async def emit() -> None:
            results.append(await d.emit(event, dict(DATA)))

        for offset in (-0.03, -0.01, 0.0, 0.01, 0.03):
            async with anyio.create_task_group() as tg:
                tg.start_soon(emit)
                pending = await a.next_pending()
                asked_at = time.monotonic()
                await anyio.sleep(max(0.0, 1.0 + offset - (time.monotonic() - asked_at)))
                try:
                    await approver.answer_approval(
                        pending.label, "Allow", approver="tester", agent_id=pending.agent_id
                    )
                    won = True
                except AlreadySettledError:
                    won = False
            outcomes.append((won, results[-1].action))
        # a won answer is applied whatever the clock says; a lost one leaves the default
        assert all(action == ("continue" if won else "deny") for won, action in outcomes), outcomes
        # and no stale answer decides the next identical call: it is asked anew
        async with anyio.create_task_group() as tg:
            tg.start_soon(emit)
            await a.next_pending()
        assert results[-1].action == "deny"  # nobody answered: the default
