"""The worker runtime: replicas, drain, idempotent shutdown, the registry declaration,
restarts and the concurrency bound. Every test talks to a real nats-server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anyio
import pytest
from _serving import emit_during_shutdown, stopped_twice_at_once

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HANDLERS_BUCKET,
    BadRequestError,
    HandlerDeclaration,
    HookResult,
    collect_subject,
    decode,
    handler_key,
    handler_queue_group,
    handler_subject,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


async def test_replicas_share_the_load(connect, event):
    """Two instances of one handler on two connections: one queue group, both serve."""
    replicas = [HookWorker(await connect()), HookWorker(await connect())]
    served: list[int] = [0, 0]

    for i, w in enumerate(replicas):

        def make(i: int):  # one function per replica, same handler name
            async def audit(ev: str, data: dict[str, Any]) -> HookResult:
                served[i] += 1
                return HookResult(action="modify", data={**data, "replica": i})

            return audit

        w.add_handler(event, make(i), name="audit")

    for w in replicas:
        await w.start()
    async with HookDispatcher(await connect()) as d:
        results = await asyncio.gather(*(d.emit(event, {"n": n}) for n in range(200)))
    for w in replicas:
        await w.shutdown()

    assert all(r.failures == [] and r.action == "continue" for r in results)
    assert [r.data["n"] for r in results] == list(range(200))
    assert replicas[0].handled > 0 and replicas[1].handled > 0
    assert replicas[0].handled + replicas[1].handled == 200
    assert served == [replicas[0].handled, replicas[1].handled]
    by_replica = [sum(1 for r in results if r.data["replica"] == i) for i in (0, 1)]
    assert by_replica == served


async def test_drain_answers_everything(connect, event):
    """shutdown() while requests are in flight: those finish within the grace period, the
    rest are answered ``unavailable`` (never silence, never a timeout)."""
    total, bound = 60, 100
    w = HookWorker(await connect(), max_concurrency=bound)
    started = 0
    enough_started = asyncio.Event()

    @w.handler(event, timeout_s=30)
    async def slow(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        nonlocal started
        started += 1
        if started >= 10:
            enough_started.set()
        await asyncio.sleep(0.05)  # the handler's work
        return {"action": "modify", "data": {**data, "served": True}}

    await w.start()
    dnc = await connect()
    async with HookDispatcher(dnc) as d:
        emits = [asyncio.create_task(d.emit(event, {"i": i})) for i in range(total)]
        await enough_started.wait()
        await w.shutdown(grace_s=10)
        results = await asyncio.gather(*emits)
        after = await d.emit(event, {"i": -1})

    served = [r for r in results if not r.failures]
    assert len(served) == w.handled >= 10
    for r in served:
        assert r.action == "continue" and r.data["served"] is True
    for r in results:
        assert [f.kind for f in r.failures] in ([], ["error"], ["no_responders"]), r.failures
    # once drained, the worker takes nothing more: the declaration answers no_responders
    assert [(f.kind, f.policy) for f in after.failures] == [("no_responders", "ignore")]


@pytest.mark.parametrize("retry_safe", [False, True])
async def test_drain_has_a_deadline(connect, event, retry_safe):
    """A handler still running when the grace period ends is cancelled and its call is
    answered ``unavailable`` at once (the dispatcher does not wait out the 30 s timeout);
    requests arriving meanwhile are refused, and the next emit finds no replica."""
    w = HookWorker(await connect())
    running = asyncio.Event()

    @w.handler(event, timeout_s=30, failure_policy="deny", retry_safe=retry_safe)
    async def stuck(ev: str, data: dict[str, Any]) -> None:
        running.set()
        await asyncio.Event().wait()  # never returns

    await w.start()
    result = await emit_during_shutdown(connect, w, event, running)
    assert result.action == "deny"
    [failure] = result.failures
    if retry_safe:  # cancelled mid-run, safe to retry: sent again, and no replica is left
        assert failure.kind == "no_responders", failure
    else:  # may have done part of its work: never sent twice
        assert (failure.kind, failure.message.split(":")[0]) == ("error", "unavailable")
    assert w.handled == 1


async def test_shutdown_is_idempotent_and_concurrent_calls_wait(connect, event):
    w = HookWorker(await connect())
    release = asyncio.Event()
    running = asyncio.Event()

    @w.handler(event, timeout_s=30)
    async def gate(ev: str, data: dict[str, Any]) -> None:
        running.set()
        await release.wait()

    await w.start()
    async with HookDispatcher(await connect()) as d:
        emit = asyncio.create_task(d.emit(event, {}))
        await running.wait()
        await stopped_twice_at_once(w.shutdown, release, "a request was still being handled")
        result = await emit
    await w.shutdown()  # a third time, after the fact
    assert result.failures == [] and result.action == "continue"
    assert w.handled == 1
    with anyio.fail_after(5):
        await w.run()  # a stopped worker's run() returns at once


async def test_shutdown_of_a_worker_never_started():
    w = HookWorker()
    await w.shutdown()
    await w.shutdown()


async def test_run_returns_after_shutdown(nc, connect, event):
    w = HookWorker()

    @w.handler(event)
    async def noop(ev: str, data: dict[str, Any]) -> None:
        return None

    async with anyio.create_task_group() as tg:
        tg.start_soon(w.run, nc)
        async with HookDispatcher(await connect()) as d:
            # run() has no ready signal of its own: wait until the declaration is routed
            with anyio.fail_after(10):
                while not d.list_handlers(event)[event]:
                    await d.refresh()
            r = await d.emit(event, {})
        await w.shutdown()  # run() returns, the task group exits
    assert r.failures == [] and w.handled == 1


async def test_sync_handler(nc, connect, event):
    w = HookWorker(nc)
    threads: list[int] = []

    @w.handler(event)
    def inject(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        threads.append(threading.get_ident())
        return {"action": "inject_context", "context_injection": f"{ev} {data['x']}"}

    async with w, HookDispatcher(await connect()) as d:
        r = await d.emit(event, {"x": 7})
    assert r.action == "inject_context"
    assert r.context_injection == f"{event} 7"
    assert [(i.hook_name, i.content) for i in r.context_injections] == [("inject", f"{event} 7")]
    # a sync handler runs off the event loop (it may block)
    assert threads and threads[0] != threading.get_ident()


async def test_an_object_whose_call_is_async_runs_on_the_loop_in_a_worker_and_in_process(
    nc, connect, event
):
    """One rule decides which handlers are async, for workers and in-process dispatchers
    alike: an object with an ``async def __call__`` is awaited on the event loop, never
    sent to a thread."""
    threads: list[int] = []

    class Guard:
        async def __call__(self, ev: str, data: dict[str, Any]) -> None:
            threads.append(threading.get_ident())

    w = HookWorker(nc)
    w.add_handler(event, Guard(), name="remote_guard", timeout_s=5.0)
    local = HookDispatcher()
    local.register(event, Guard(), name="local_guard", timeout_s=5.0)
    async with w, HookDispatcher(await connect()) as d:
        r = await d.emit(event, {})
    assert r.failures == [] and (await local.emit(event, {})).failures == []
    assert threads == [threading.get_ident()] * 2


async def test_decorator_returns_the_function_unchanged(event):
    w = HookWorker()

    async def f(ev: str, data: dict[str, Any]) -> None:
        return None

    def g(ev: str, data: dict[str, Any]) -> None:
        return None

    assert w.handler(event)(f) is f
    assert w.handler(event, name="other", priority=3)(g) is g
    assert [s.declaration.name for s in w.handlers] == ["f", "other"]
    assert [s.fn for s in w.handlers] == [f, g]


async def test_duplicate_handler_name_per_event(event):
    w = HookWorker()

    @w.handler(event)
    async def security(ev: str, data: dict[str, Any]) -> None:
        return None

    async def other(ev: str, data: dict[str, Any]) -> None:
        return None

    with pytest.raises(ValueError, match="security"):
        w.handler(event)(security)
    with pytest.raises(ValueError, match="already registered"):
        w.handler(event, name="security")(other)
    w.handler(event + "-2")(security)  # same name, another event: fine


async def test_bad_declarations_rejected(event):
    w = HookWorker()

    async def h(ev: str, data: dict[str, Any]) -> None:
        return None

    with pytest.raises(BadRequestError, match="event name"):
        w.handler("")(h)
    with pytest.raises(ValueError, match="timeout_s"):
        w.handler(event, timeout_s=0)(h)
    with pytest.raises(ValueError, match="max_concurrency"):
        HookWorker(max_concurrency=0)


async def test_handlers_cannot_be_added_once_serving(nc, event):
    w = HookWorker(nc)

    @w.handler(event)
    async def first(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w:

        async def late(ev: str, data: dict[str, Any]) -> None:
            return None

        with pytest.raises(ValueError, match="before the worker starts"):
            w.handler(event)(late)


async def test_declaration_in_the_registry_bucket(nc, event):
    w = HookWorker(nc)

    @w.handler(
        event,
        priority=7,
        name="sec urity",
        tool_filter=["bash*", "write_*"],
        timeout_s=2.5,
        failure_policy="deny",
        parallel=True,
    )
    async def security(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w:
        kv = await nc.jetstream().key_value(HANDLERS_BUCKET)
        entry = await kv.get(handler_key(event, "sec urity"))
    decl = decode(entry.value, HandlerDeclaration)
    assert decl == HandlerDeclaration(
        event=event,
        name="sec urity",
        priority=7,
        tool_filter=["bash*", "write_*"],
        timeout_s=2.5,
        failure_policy="deny",
        parallel=True,
        subject=handler_subject(event, "sec urity"),
        collect_subject=collect_subject(event),
        queue_group=handler_queue_group("sec urity"),
        handler_set=["sec urity"],  # every handler this process serves (chains)
    )
    # the declaration outlives the instance: still there after shutdown
    assert (await kv.get(handler_key(event, "sec urity"))).value == entry.value


async def test_unregister_deletes_the_declarations(nc, event):
    import nats.js.errors

    async def no_opinion(ev: str, data: dict[str, Any]) -> None:
        return None

    w = HookWorker(nc)
    for name in ("one", "two"):
        w.add_handler(event, no_opinion, name=name)
    async with w:
        pass
    await w.unregister()
    kv = await nc.jetstream().key_value(HANDLERS_BUCKET)
    for name in ("one", "two"):
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await kv.get(handler_key(event, name))


async def test_a_restarted_worker_serves_the_same_declaration(connect, event):
    def make_worker(nc: Any, tag: str) -> HookWorker:
        w = HookWorker(nc)

        @w.handler(event, failure_policy="deny")
        async def guard(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="modify", data={**data, "by": tag})

        return w

    first = make_worker(await connect(), "first")
    await first.start()
    async with HookDispatcher(await connect()) as d:
        r1 = await d.emit(event, {})
        await first.shutdown()
        r_down = await d.emit(event, {})
        second = make_worker(await connect(), "second")
        await second.start()
        r2 = await d.emit(event, {})
        await second.shutdown()

    assert r1.data["by"] == "first" and r1.failures == []
    # no live replica: the declaration answers "no responders" at once, policy deny
    assert r_down.action == "deny" and r_down.decided_by == "guard"
    assert [(f.kind, f.policy) for f in r_down.failures] == [("no_responders", "deny")]
    assert r2.action == "continue" and r2.data["by"] == "second" and r2.failures == []
    assert (first.handled, second.handled) == (1, 1)


@pytest.mark.parametrize("bound", [1, 3])
async def test_concurrency_bound_is_respected(connect, event, bound):
    """Over `max_concurrency` (all handlers together) a request is refused at once with a
    retryable ``busy`` (the dispatcher tries again, then the policy decides): never more
    than `bound` run at once, and nothing waits into a timeout."""
    w = HookWorker(await connect(), max_concurrency=bound)
    running = 0
    peak = 0

    async def work(ev: str, data: dict[str, Any]) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.01)  # the handler's work
        finally:
            running -= 1

    # two handlers: the bound is per worker process, over all its handlers
    w.add_handler(event, work, name="a", timeout_s=30)
    w.add_handler(event, work, name="b", timeout_s=30, parallel=True)
    w.add_handler(event, work, name="c", timeout_s=30, parallel=True)
    async with w, HookDispatcher(await connect()) as d:
        results = await asyncio.gather(*(d.emit(event, {}) for _ in range(30)))
    failures = [f for r in results for f in r.failures]
    assert all(f.kind == "error" and f.message.startswith("busy") for f in failures), failures
    assert w.handled == 90 - len(failures)
    assert w.refused >= len(failures) > 0
    assert peak == bound


async def test_overload_is_refused_quickly_and_capacity_still_served(connect, event):
    """At about 3x a worker's capacity the excess is refused with ``busy`` (judged by the
    policy at once), not queued into timeouts: every emit is decided by a served result or
    a busy refusal, and the served ones run at the worker's capacity."""
    capacity, work_s, n = 8, 0.05, 24 * 8
    w = HookWorker(await connect(), max_concurrency=capacity)

    @w.handler(event, timeout_s=1.0, failure_policy="deny")
    async def gate(ev: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(work_s)

    async with w, HookDispatcher(await connect()) as d:
        t0 = asyncio.get_running_loop().time()
        sem = asyncio.Semaphore(3 * capacity)  # 3x the worker's concurrency, steadily

        async def agent(i: int):
            async with sem:
                start = asyncio.get_running_loop().time()
                r = await d.emit(event, {"i": i})
                return r, asyncio.get_running_loop().time() - start

        out = await asyncio.gather(*(agent(i) for i in range(n)))
        elapsed = asyncio.get_running_loop().time() - t0
    served = [t for r, t in out if r.action == "continue"]
    refused = [(r, t) for r, t in out if r.action == "deny"]
    for r, _ in refused:
        [f] = r.failures
        assert (f.kind, f.message.split(":")[0]) == ("error", "busy"), f
    assert len(served) + len(refused) == n and served
    print(
        f"\noverload 3x: {len(served)}/{n} served in {elapsed:.2f}s"
        f" (capacity {capacity / work_s:.0f}/s, goodput {len(served) / elapsed:.0f}/s),"
        f" {len(refused)} refused, slowest refusal {max((t for _, t in refused), default=0):.3f}s"
    )


async def test_handlers_that_suspend_many_times_run_to_their_result_or_their_timeout(
    connect, event
):
    """An async handler is awaited as written: one that suspends again and again returns
    its result (in a chain of this worker's handlers too), and one that never finishes is
    cut at its own timeout by the worker (its reply says so), with its cleanup run."""
    w = HookWorker(await connect())
    cleaned: list[str] = []

    @w.handler(event, priority=1)
    async def stepper(ev: str, data: dict[str, Any]) -> HookResult:
        for i in range(5):
            await asyncio.sleep(0.001)
            await asyncio.sleep(0)
            data = {**data, "steps": i + 1}
        return HookResult(action="modify", data=data)

    @w.handler(event, priority=2, timeout_s=0.3)
    async def looper(ev: str, data: dict[str, Any]) -> HookResult:
        try:
            while True:  # noqa: ASYNC110 - suspends on nothing to cancel: the cut is thrown in
                await asyncio.sleep(0)
        finally:
            cleaned.append(ev)

    await w.start()
    try:
        async with HookDispatcher(await connect()) as d:
            r = await d.emit(event, {"n": 1})
    finally:
        await w.shutdown()
    assert r.data is not None and (r.data["n"], r.data["steps"]) == (1, 5)
    [failure] = r.failures
    assert (failure.handler, failure.kind) == ("looper", "timeout")
    assert "ran past" in failure.message  # the worker's own cut, not the dispatcher's wait
    assert cleaned == [event]
