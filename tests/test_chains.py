"""Chain requests and speculative pure handlers, against a real nats-server.

A run of adjacent remote handlers served by one worker process goes as one chain request;
the outcomes, their order, ``result.failures`` and who ran must be those of one request per
handler. Handlers here record their calls before they answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from _serving import emit_during_shutdown, serving
from conftest import Connect
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.declarations import derive_declaration
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    SUBJECT_PREFIX,
    ChainStep,
    EventEnvelope,
    HandlerDeclaration,
    HookResult,
    chain_subject,
    decode,
    encode,
    handler_key,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def requests_seen(nc: NATS) -> AsyncIterator[list[str]]:
    """The subjects of every request sent on hookbus's subjects while inside."""
    seen: list[str] = []

    async def note(msg: Msg) -> None:
        if msg.reply:
            seen.append(msg.subject)

    sub = await nc.subscribe(f"{SUBJECT_PREFIX}.>", cb=note)
    await nc.flush()
    try:
        yield seen
    finally:
        await sub.unsubscribe()


async def kinds(seen: list[str], n: int, since: int = 0) -> list[str]:
    """The kind (``chain``, ``handler``, ``collect``) of each request seen from index
    `since` on, once `n` have arrived (the spy's copies come on a connection of their own:
    bounded wait) and a moment for any more.

    The spy subscribes before any dispatcher connects: a subscription made while another
    connection already publishes on the subject was seen to miss its next publishes."""
    await _until(lambda: len(seen) - since >= n)
    await asyncio.sleep(0.05)
    return [s.split(".")[2] for s in seen[since:]]


def recorder(calls: list[str], name: str, result: Any = None) -> Callable[..., Awaitable[Any]]:
    async def handler(event: str, data: dict[str, Any]) -> Any:
        calls.append(name)
        return result(data) if callable(result) else result

    handler.__name__ = name
    return handler


def modify(key: str, value: Any) -> Callable[[dict[str, Any]], HookResult]:
    return lambda data: HookResult(action="modify", data={**data, key: value})


async def emit_both_ways(
    connect: Connect,
    event: str,
    data: dict[str, Any],
    handlers: list[tuple[Any, ...]],
    calls: list[str],
) -> tuple[list[HookResult], list[list[str]]]:
    """Emit once with chains and once without, to one worker serving `handlers` (which
    record into `calls`); returns the results and the calls made, per way."""
    results, made = [], []
    async with serving(await connect(), *handlers):
        for chains in (True, False):
            calls.clear()
            async with HookDispatcher(await connect(), chains=chains) as d:
                results.append(await d.emit(event, data))
            made.append(list(calls))
    return results, made


def same(a: HookResult, b: HookResult) -> None:
    """Two results equal but for the timestamp each emit stamped."""
    for r in (a, b):
        for d in (r.data, r.chained_data):
            if d is not None:
                d.pop("timestamp", None)
    assert a == b


async def test_three_handlers_of_one_process_cost_one_request(connect: Connect, event: str) -> None:
    calls: list[str] = []
    handlers = [
        (event, recorder(calls, "a", modify("a", 1)), {"priority": 1}),
        (event, recorder(calls, "b", modify("b", 2)), {"priority": 2}),
        (event, recorder(calls, "c", None), {"priority": 3}),
    ]
    async with requests_seen(await connect()) as seen, serving(await connect(), *handlers):
        async with HookDispatcher(await connect()) as d:
            r = await d.emit(event, {"tool_name": "bash"})
            assert await kinds(seen, 1) == ["chain"]
        mark = len(seen)
        async with HookDispatcher(await connect(), chains=False) as d:
            r2 = await d.emit(event, {"tool_name": "bash"})
            assert await kinds(seen, 3, mark) == ["handler", "handler", "handler"]
    assert calls == ["a", "b", "c", "a", "b", "c"]
    assert r.data is not None and (r.data["a"], r.data["b"]) == (1, 2)
    assert r.modified_by == ["a", "b"] and r.decided_by == "b"
    same(r, r2)


async def test_a_large_event_is_chained_as_one_request_per_handler_chains_it(
    connect: Connect, event: str
) -> None:
    """Data large enough to be copied by walking it: each step still gets a copy of its
    own (an in-place edit is seen by no later step), a modify's data (sent as the JSON it
    was checked with) is what the next step sees, and the results are one request's per
    handler."""
    calls: list[str] = []
    views: list[Any] = []
    text = "a line of a file the agent wrote\n" * 2048  # about 68 KB

    def first(data: dict[str, Any]) -> HookResult:
        views.append(msgspec.json.encode(data))
        data["tool_input"]["seen_by"] = "first"  # its own copy: part of its modify
        return HookResult(action="modify", data={**data, "first": [1, {"n": 2.5}]})

    def second(data: dict[str, Any]) -> None:
        views.append(msgspec.json.encode(data))
        data["tool_input"]["content"] = "edited in place"  # its own copy: seen by nobody
        data["first"].append("edited")

    def third(data: dict[str, Any]) -> HookResult:
        views.append(msgspec.json.encode(data))
        return HookResult(action="modify", data={**data, "third": True})

    handlers = [
        (event, recorder(calls, "first", first), {"priority": 1}),
        (event, recorder(calls, "second", second), {"priority": 2}),
        (event, recorder(calls, "third", third), {"priority": 3}),
    ]
    data = {"tool_name": "write", "tool_input": {"path": "/tmp/f", "content": text}}
    results, made = await emit_both_ways(connect, event, data, handlers, calls)
    assert made == [["first", "second", "third"]] * 2
    chained, alone = views[:3], views[3:]
    assert [msgspec.json.decode(v).get("timestamp") is not None for v in views] == [True] * 6
    for seen in (chained, alone):
        second_saw, third_saw = msgspec.json.decode(seen[1]), msgspec.json.decode(seen[2])
        assert second_saw == third_saw, "an in-place edit leaked to the next step"
        assert second_saw["tool_input"] == {"path": "/tmp/f", "content": text, "seen_by": "first"}
        assert second_saw["first"] == [1, {"n": 2.5}]
    result = results[0]
    assert result.data is not None and result.data["third"] is True
    assert result.data["tool_input"]["content"] == text
    assert result.modified_by == ["first", "third"]
    same(results[0], results[1])


async def test_deny_in_the_middle_stops_the_chain_in_the_worker(
    connect: Connect, event: str
) -> None:
    calls: list[str] = []
    deny = HookResult(action="deny", reason="no")
    results, made = await emit_both_ways(
        connect,
        event,
        {},
        [
            (event, recorder(calls, "a", modify("x", 1)), {"priority": 1}),
            (event, recorder(calls, "b", deny), {"priority": 2}),
            (event, recorder(calls, "c"), {"priority": 3}),
        ],
        calls,
    )
    assert made == [["a", "b"], ["a", "b"]]  # c never ran, either way
    assert results[0].action == "deny" and results[0].decided_by == "b"
    assert results[0].chained_data is not None and results[0].chained_data["x"] == 1
    same(*results)


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_failures_in_a_chain_are_judged_by_each_policy(
    connect: Connect, event: str, policy: str
) -> None:
    calls: list[str] = []
    never = asyncio.Event()

    async def stuck(ev: str, data: dict[str, Any]) -> None:
        calls.append("stuck")
        await never.wait()

    async def raises(ev: str, data: dict[str, Any]) -> None:
        calls.append("raises")
        raise RuntimeError("boom")

    results, made = await emit_both_ways(
        connect,
        event,
        {},
        [
            (event, stuck, {"priority": 1, "timeout_s": 0.3}),
            (event, raises, {"priority": 2, "failure_policy": policy}),
            (event, recorder(calls, "last"), {"priority": 3}),
        ],
        calls,
    )
    expected = ["stuck", "raises"] + (["last"] if policy == "ignore" else [])
    assert made == [expected, expected]
    r = results[0]
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [
        ("stuck", "timeout", "ignore"),
        ("raises", "error", policy),
    ]
    assert r.action == ("continue" if policy == "ignore" else "deny")
    for a, b in zip(results[0].failures, results[1].failures, strict=True):
        assert (a.handler, a.kind, a.policy) == (b.handler, b.kind, b.policy)


async def test_tool_filters_in_a_chain_see_the_chained_data(connect: Connect, event: str) -> None:
    calls: list[str] = []
    results, made = await emit_both_ways(
        connect,
        event,
        {"tool_name": "bash"},
        [
            (event, recorder(calls, "rename", modify("tool_name", "write")), {"priority": 1}),
            (event, recorder(calls, "on_bash"), {"priority": 2, "tool_filter": ["bash"]}),
            (event, recorder(calls, "on_write"), {"priority": 3, "tool_filter": ["wr*"]}),
        ],
        calls,
    )
    assert made == [["rename", "on_write"], ["rename", "on_write"]]
    same(*results)


async def test_a_parallel_group_filtered_to_one_step_runs_that_step(
    connect: Connect, event: str
) -> None:
    """A parallel group after sequential steps, with all but one of its steps filtered out
    by the data: the one left runs (not a step before it), in a chain as one by one."""
    calls: list[str] = []
    deny = HookResult(action="deny", reason="only p2 says no")
    results, made = await emit_both_ways(
        connect,
        event,
        {"tool_name": "bash"},
        [
            (event, recorder(calls, "first", modify("x", 1)), {"priority": 1}),
            (event, recorder(calls, "second"), {"priority": 2}),
            (event, recorder(calls, "p1"), {"priority": 3, "parallel": True, "tool_filter": ["w"]}),
            (event, recorder(calls, "p2", deny), {"priority": 4, "parallel": True}),
            (event, recorder(calls, "after"), {"priority": 5}),
        ],
        calls,
    )  # fmt: skip
    assert made == [["first", "second", "p2"], ["first", "second", "p2"]]
    assert results[0].action == "deny" and results[0].decided_by == "p2"
    assert results[0].reason == "only p2 says no"
    same(*results)


async def test_parallel_steps_run_together_and_a_parallel_modify_is_denied(
    connect: Connect, event: str
) -> None:
    both = asyncio.Barrier(2)  # each waits for the other: they must run at once

    async def p1(ev: str, data: dict[str, Any]) -> None:
        async with asyncio.timeout(5):
            await both.wait()

    async def p2(ev: str, data: dict[str, Any]) -> HookResult:
        async with asyncio.timeout(5):
            await both.wait()
        return HookResult(action="modify", data={"sneaky": True})

    calls: list[str] = []
    async with (
        requests_seen(await connect()) as seen,
        serving(
            await connect(),
            (event, p1, {"priority": 1, "parallel": True}),
            (event, p2, {"priority": 2, "parallel": True}),
            (event, recorder(calls, "after"), {"priority": 3}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {})
        assert await kinds(seen, 1) == ["chain"]
    assert r.action == "deny" and r.decided_by == "p2" and calls == []
    assert [(f.handler, f.kind) for f in r.failures] == [("p2", "bad_reply")]


async def test_each_parallel_step_runs_in_a_task_and_context_of_its_own(
    connect: Connect, event: str
) -> None:
    """A parallel group in one worker, as `asyncio.gather` runs coroutines: each handler
    in a task of its own (an ``asyncio.timeout`` it arms cuts itself, not its neighbours)
    and a context of its own (a context variable one sets is not seen by another), whether
    it returns at once or waits; the slow one's timeout is its own failure."""
    mark: contextvars.ContextVar[str] = contextvars.ContextVar("mark")
    tasks: dict[str, asyncio.Task[Any] | None] = {}
    seen: dict[str, str | None] = {}

    async def at_once(ev: str, data: dict[str, Any]) -> None:
        tasks["at_once"] = asyncio.current_task()
        mark.set("at_once")

    async def waits(ev: str, data: dict[str, Any]) -> None:
        tasks["waits"] = asyncio.current_task()
        mark.set("waits")
        await asyncio.sleep(0.2)  # past the moment `cut`'s own timeout fires
        seen["waits"] = mark.get(None)

    async def cut(ev: str, data: dict[str, Any]) -> None:
        tasks["cut"] = asyncio.current_task()
        seen["cut"] = mark.get(None)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.05):  # its own: cuts this handler only
                await asyncio.sleep(10)
        await asyncio.sleep(10)  # then past its step's timeout

    async with (
        serving(
            await connect(),
            (event, at_once, {"priority": 1, "parallel": True}),
            (event, waits, {"priority": 2, "parallel": True}),
            (event, cut, {"priority": 3, "parallel": True, "timeout_s": 0.5}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {})
    assert r.action == "continue"
    assert [(f.handler, f.kind) for f in r.failures] == [("cut", "timeout")]
    assert seen == {"waits": "waits", "cut": None}
    ran_in = list(tasks.values())
    assert len(ran_in) == 3 and None not in ran_in and len({id(t) for t in ran_in}) == 3


async def test_a_set_with_no_live_process_falls_back_to_one_request_per_handler(
    nc: NATS, connect: Connect, event: str
) -> None:
    """Declarations naming a handler set nobody serves as a chain (an older worker, say):
    the chain finds no responders, nothing ran, each handler is called alone."""
    calls: list[str] = []
    async with serving(
        await connect(),
        (event, recorder(calls, "a", modify("a", 1)), {"priority": 1}),
        (event, recorder(calls, "b"), {"priority": 2}),
    ):
        kv = await nc.jetstream().key_value(handlers_bucket_config().bucket)
        for name in ("a", "b"):
            decl = decode((await kv.get(handler_key(event, name))).value, HandlerDeclaration)
            decl = derive_declaration(decl)
            await kv.put(
                handler_key(event, name),
                encode(msgspec.structs.replace(decl, handler_set=["a", "b", "gone"])),
            )
        async with HookDispatcher(await connect()) as d:
            await _until(lambda: all(r.handler_set == {"a", "b", "gone"} for r in d.routes(event)))
            r = await d.emit(event, {})
    assert calls == ["a", "b"]
    assert r.failures == [] and r.data is not None and r.data["a"] == 1


async def test_a_chain_naming_a_handler_the_process_does_not_serve_runs_nothing(
    nc: NATS, connect: Connect, event: str
) -> None:
    calls: list[str] = []
    async with serving(await connect(), (event, recorder(calls, "a"), {})) as w:
        envelope = EventEnvelope(id="0" * 32, event=event, data={}, chain=[])
        subject = chain_subject(event, w.handler_set_id)
        envelope.chain = [  # "a" is served; "x" is not
            *(ChainStep(handler=n) for n in ("a", "x"))
        ]
        reply = await nc.request(subject, encode(envelope), timeout=5)
    assert b'"bad_request"' in reply.data and b"not served" in reply.data
    assert calls == []


async def test_pure_handlers_are_called_at_once_and_folded_in_order(
    connect: Connect, event: str
) -> None:
    """Three pure handlers in three processes: the first waits until the last has been
    called (impossible one by one); a modify by the first makes the later ones run again
    on the new data; the fold is in priority order."""
    last_called = asyncio.Event()
    seen: list[tuple[str, Any]] = []

    async def first(ev: str, data: dict[str, Any]) -> HookResult:
        seen.append(("first", data.get("v")))
        async with asyncio.timeout(5):
            await last_called.wait()
        return HookResult(action="modify", data={**data, "v": "new"})

    async def second(ev: str, data: dict[str, Any]) -> HookResult:
        seen.append(("second", data.get("v")))
        return HookResult(action="inject_context", context_injection=f"saw {data.get('v')}")

    async def third(ev: str, data: dict[str, Any]) -> None:
        seen.append(("third", data.get("v")))
        last_called.set()

    async with (
        serving(await connect(), (event, first, {"priority": 1, "pure": True})),
        serving(await connect(), (event, second, {"priority": 2, "pure": True})),
        serving(await connect(), (event, third, {"priority": 3, "pure": True})),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {"v": "old"})
    assert sorted(seen[:3]) == [("first", "old"), ("second", "old"), ("third", "old")]
    assert sorted(seen[3:]) == [("second", "new"), ("third", "new")]  # called again
    assert r.action == "inject_context" and r.context_injection == "saw new"
    assert r.chained_data is not None and r.chained_data["v"] == "new"


async def test_a_deny_among_pure_handlers_wins_in_order(connect: Connect, event: str) -> None:
    """The first pure handler denies only once the second has denied too (they run at
    once): the fold is in priority order, not in the order the answers came."""
    second_denied = asyncio.Event()

    async def first(ev: str, data: dict[str, Any]) -> HookResult:
        async with asyncio.timeout(5):
            await second_denied.wait()
        return HookResult(action="deny", reason="first no")

    async def second(ev: str, data: dict[str, Any]) -> HookResult:
        second_denied.set()
        return HookResult(action="deny", reason="second no")

    async with (
        serving(await connect(), (event, first, {"priority": 1, "pure": True})),
        serving(await connect(), (event, second, {"priority": 2, "pure": True})),
        HookDispatcher(await connect(), approvals=False) as d,
    ):
        r = await d.emit(event, {})
    assert (r.action, r.decided_by, r.reason) == ("deny", "first", "first no")


# -- helpers -----------------------------------------------------------------------------


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not check():  # noqa: ASYNC110  (the routing table has no change event)
            await asyncio.sleep(0.01)


async def test_a_parallel_group_across_processes_asks_each_on_its_own_subject(
    connect: Connect, event: str
) -> None:
    """A parallel group of three handlers in three processes: one request per handler, on
    its own subject (its reply is bound to it), every time; a handler outside the group
    never hears it."""
    calls: list[str] = []
    async with (
        requests_seen(await connect()) as seen,
        serving(await connect(), (event, recorder(calls, "p1"), {"priority": 1, "parallel": True})),
        serving(await connect(), (event, recorder(calls, "p2"), {"priority": 2, "parallel": True})),
        serving(
            await connect(),
            (event, recorder(calls, "p3", HookResult(action="deny", reason="p3")),
             {"priority": 3, "parallel": True}),
        ),
        serving(await connect(), (event, recorder(calls, "after"), {"priority": 4})),
        HookDispatcher(await connect()) as d,
    ):  # fmt: skip
        first = await d.emit(event, {})
        assert await kinds(seen, 3) == ["handler"] * 3
        calls.clear()
        r = await d.emit(event, {})
        assert await kinds(seen, 3, 3) == ["handler"] * 3
    assert sorted(calls) == ["p1", "p2", "p3"]
    assert r.action == first.action == "deny" and r.decided_by == first.decided_by == "p3"


async def test_in_process_pure_handlers_are_called_at_once(event: str) -> None:
    """Pure in-process handlers too: the first waits until the second has started."""
    second_started = asyncio.Event()
    d = HookDispatcher()

    @d.register(event, priority=1, pure=True)
    async def first(ev: str, data: dict[str, Any]) -> None:
        async with asyncio.timeout(5):
            await second_started.wait()

    @d.register(event, priority=2, pure=True)
    async def second(ev: str, data: dict[str, Any]) -> HookResult:
        second_started.set()
        return HookResult(action="deny", reason="second")

    r = await d.emit(event, {})
    assert r.action == "deny" and r.decided_by == "second"


async def test_a_chain_is_traced_as_the_one_message_it_is(
    nc: NATS, connect: Connect, event: str
) -> None:
    """With tracing on, a chain is one ``send <event> <handlers>`` span under the emit (the
    handlers it asked, the outcomes the fold read, one request, the worker instance that
    answered) with the worker's one handling span as its child; no span names a handler
    subject that carried no message."""
    from _otel_harness import Otel, children, reset_globals

    from hookbus.schemas import telemetry as tn

    reset_globals()
    otel = Otel()
    otel.install()
    try:
        deny = HookResult(action="deny", reason="no")
        async with (
            serving(
                await connect(),
                (event, recorder([], "first", modify("x", 1)), {"priority": 1}),
                (event, recorder([], "guard", deny), {"priority": 2}),
                (event, recorder([], "never"), {"priority": 3}),
            ) as worker,
            HookDispatcher(await connect()) as d,
        ):
            r = await d.emit(event, {})
            instance = worker.instance
        assert r.action == "deny"
        emit = otel.emit_span(event)
        spans = otel.spans(emit.context.trace_id)
        (send,) = children(spans, emit)
        assert send.name == f"send {event} first,guard,never"
        assert list(send.attributes[tn.CHAIN_HANDLERS]) == ["first", "guard", "never"]
        assert list(send.attributes[tn.CHAIN_OUTCOMES]) == ["modify", "deny"]
        assert send.attributes[tn.REQUESTS] == 1
        assert send.attributes[tn.WORKER_INSTANCE] == instance
        (process,) = children(spans, send)
        assert process.name == f"process {event} first,guard,never"
    finally:
        otel.shutdown()
        reset_globals()


async def test_a_chain_cut_by_shutdown_answers_what_ran_and_what_was_cut(
    connect: Connect, event: str
) -> None:
    """The grace period ends while a chain's second step runs: the first step's result
    stands, the second fails as ``unavailable`` under its own policy, the third never ran."""
    running = asyncio.Event()
    calls: list[str] = []

    async def stuck(ev: str, data: dict[str, Any]) -> None:
        running.set()
        await asyncio.Event().wait()  # never returns

    w = HookWorker(await connect())
    w.add_handler(event, recorder(calls, "first", modify("x", 1)), priority=1)
    w.add_handler(event, stuck, priority=2, timeout_s=30, failure_policy="deny")
    w.add_handler(event, recorder(calls, "third"), priority=3)
    await w.start()
    r = await emit_during_shutdown(connect, w, event, running)
    assert calls == ["first"]
    assert r.action == "deny" and r.decided_by == "stuck"
    assert r.modified_by == ["first"] and r.chained_data is not None and r.chained_data["x"] == 1
    [failure] = r.failures
    assert (failure.handler, failure.kind, failure.message.split(":")[0]) == (
        "stuck",
        "error",
        "unavailable",
    )
