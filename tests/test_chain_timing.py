"""Chains decide as one by one with ordinary handlers and no fault: the worker times its steps.

Each case runs the same handlers three ways against a real nats-server: chains on
(``HookDispatcher(nc)``), one request per handler (``chains=False``), and registered in
process; the worker is a process of its own (``hookbus worker``), so a handler that holds
its event loop holds only the worker's. Every run of a handler is announced (`_paced`), so
"ran once" is counted, not assumed.

- a handler that awaits only on some inputs (a cache miss) after an earlier handler that
  returns at once: the earlier one's modify stands, nothing fails, nothing runs twice, also
  through the ``hookbus dispatcher`` service;
- a handler that computes without awaiting for longer than an earlier one's timeout, on a
  chain's very first call;
- a handler whose result holds an object JSON cannot carry: it is converted as in process
  (amplifier-core's ``str()``), and every other handler's answer stands;
- a worker whose link to the server delays every message by 0.3 s each way (a hop between
  sites): the same decisions, no step run twice;
- a replica paused while idle, resumed after chains were sent to it: it runs none of those
  stale chains' steps (the dispatcher has called them on their own);
- a peer repeating a chain's progress reply cannot re-arm a step past its timeout.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _fleet import WORKER_READY, Fleet, Proc
from _paced import SECRET, behaviour, worker_module
from _proxy import NatsProxy
from conftest import Connect
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HookReply,
    HookResult,
    chain_subject,
    emit_service_subject,
    encode,
    handler_set_id,
)

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

TESTS = str(Path(__file__).resolve().parent)
COMMAND = f"export KEY={SECRET}"
QUIET_S = 1.0
"""Seconds a test waits, once every expected run was announced, for a run repeated."""


def h(name: str, kind: str, priority: int, timeout_s: float, policy: str = "ignore") -> dict:
    return {
        "name": name, "kind": kind, "priority": priority, "timeout_s": timeout_s,
        "failure_policy": policy,
    }  # fmt: skip


@pytest.fixture
async def fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    async with Fleet(nats_url, tmp_path) as f:
        yield f


async def paced_workers(
    fleet: Fleet, event: str, handlers: list[dict], replicas: int = 1
) -> list[Proc]:
    path = fleet.workdir / f"paced_{uuid.uuid4().hex[:8]}.py"
    path.write_text(worker_module(event, handlers, TESTS))
    procs = [
        await fleet._spawn(f"paced-{i}", ["worker", f"{path}:worker"], WORKER_READY)
        for i in range(replicas)
    ]
    for p in procs:
        await p.wait_ready()
    return procs


class Runs:
    """Every announced handler run, by (handler, emit tag)."""

    def __init__(self) -> None:
        self.count: collections.Counter[tuple[str, str]] = collections.Counter()
        self._changed = asyncio.Event()

    async def listen(self, nc: NATS, event: str) -> Runs:
        async def note(msg: Msg) -> None:
            name, tag = json.loads(msg.data)
            self.count[(name, tag)] += 1
            self._changed.set()

        await nc.subscribe(f"announce.{event}", cb=note)
        await nc.flush()
        return self

    async def local(self, name: str, tag: str) -> None:
        self.count[(name, tag)] += 1

    async def settle(self, expected: set[tuple[str, str]]) -> None:
        """Wait until every run in `expected` is announced (however busy the machine),
        then `QUIET_S` more for any run announced twice (nothing signals a run that should
        not happen: only a window can let it show)."""
        async with asyncio.timeout(30):
            while not expected <= set(self.count):
                self._changed.clear()
                await self._changed.wait()
        await asyncio.sleep(QUIET_S)


def summary(r: HookResult) -> tuple[Any, ...]:
    data = r.chained_data or {}
    return (
        r.action, r.reason, (data.get("tool_input") or {}).get("command"),
        sorted((f.handler, f.kind) for f in r.failures),
    )  # fmt: skip


async def three_ways(
    connect: Connect, event: str, handlers: list[dict], emits: list[dict], runs: Runs
) -> dict[str, list[tuple[Any, ...]]]:
    """The summaries of `emits` chains on, one by one, and in process (in that order: the
    chains meet a worker that has seen nothing yet). Each emit's data gets ``tag``
    ``<way>-<i>``."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for way, options in (("chains", {}), ("one_by_one", {"chains": False})):
        async with HookDispatcher(await connect(), **options) as d:
            out[way] = [
                summary(await asyncio.wait_for(d.emit(event, {**data, "tag": f"{way}-{i}"}), 30))
                for i, data in enumerate(emits)
            ]
    local = HookDispatcher()
    for spec in handlers:
        local.register(
            event, behaviour(spec["kind"], spec["name"], runs.local), spec["priority"],
            spec["name"], timeout_s=spec["timeout_s"], failure_policy=spec["failure_policy"],
            parallel=spec.get("parallel", False),
        )  # fmt: skip
    out["in_process"] = [
        summary(await local.emit(event, {**data, "tag": f"in_process-{i}"}))
        for i, data in enumerate(emits)
    ]
    return out


async def served_three_ways(
    connect: Connect, fleet: Fleet, event: str, handlers: list[dict], emits: list[dict]
) -> tuple[dict[str, list[tuple[Any, ...]]], Runs]:
    """`handlers` served by a paced worker process: `three_ways` of `emits`, and the runs
    announced meanwhile."""
    runs = await Runs().listen(await connect(), event)
    await paced_workers(fleet, event, handlers)
    return await three_ways(connect, event, handlers, emits, runs), runs


def tool(**extra: Any) -> dict[str, Any]:
    return {"tool_name": "bash", "tool_input": {"command": COMMAND}, **extra}


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_a_handler_that_awaits_only_on_a_cache_miss_keeps_the_earlier_redaction(
    connect: Connect, fleet: Fleet, event: str, policy: str
) -> None:
    handlers = [h("redact", "redact", 1, 1.0, policy), h("audit", "audit", 2, 5.0)]
    out, runs = await served_three_ways(connect, fleet, event, handlers, [tool(), tool(miss=True)])
    redacted = ("continue", None, "export KEY=***", [])
    assert out == {way: [redacted, redacted] for way in out}
    await runs.settle(
        {(n, f"{way}-{i}") for way in out for i in range(2) for n in ("audit", "redact")}
    )
    for way in out:
        for i in range(2):
            assert runs.count[("audit", f"{way}-{i}")] == 1, (way, i, runs.count)
            assert runs.count[("redact", f"{way}-{i}")] == 1, (way, i, runs.count)


async def test_the_same_through_the_dispatcher_service(
    connect: Connect, fleet: Fleet, event: str
) -> None:
    handlers = [h("redact", "redact", 1, 1.0, "deny"), h("audit", "audit", 2, 5.0)]
    runs = await Runs().listen(await connect(), event)
    await paced_workers(fleet, event, handlers)
    await fleet.dispatcher()
    agent = await connect()
    for i, data in enumerate([tool(), tool(miss=True)]):
        body = encode({"data": {**data, "tag": f"service-{i}"}})
        msg = await agent.request(emit_service_subject(event), body, timeout=30)
        result = json.loads(msg.data)["result"]
        assert (result["action"], result["failures"]) == ("continue", [])
        assert result["chained_data"]["tool_input"]["command"] == "export KEY=***"
    await runs.settle({(n, f"service-{i}") for n in ("redact", "audit") for i in range(2)})
    assert runs.count == {
        (name, f"service-{i}"): 1 for name in ("redact", "audit") for i in range(2)
    }


async def test_a_handler_computing_past_an_earlier_timeout_on_the_first_call(
    connect: Connect, fleet: Fleet, event: str
) -> None:
    handlers = [h("redact", "redact", 1, 1.0, "deny"), h("scan", "scan", 2, 5.0)]
    out, runs = await served_three_ways(connect, fleet, event, handlers, [tool()])
    assert out == {way: [("continue", None, "export KEY=***", [])] for way in out}
    await runs.settle({("scan", f"{way}-0") for way in out})
    assert all(runs.count[("scan", f"{way}-0")] == 1 for way in out), runs.count


@pytest.mark.parametrize("scan_first", [False, True], ids=["guard_first", "scan_first"])
async def test_a_parallel_neighbour_computing_does_not_time_out_the_guard(
    connect: Connect, fleet: Fleet, event: str, scan_first: bool
) -> None:
    """Two parallel handlers of one worker process, called one by one: ``guard`` denies at
    once (its failures ignored), ``scan`` computes 1.5 s without awaiting. Were the guard
    timed out (after 1 s), its failure ignored would let the call through.

    The guard first: its answer must leave the process when the guard returns, not when the
    scan lets the event loop run again. The scan first: its request reaches the worker
    first, so the guard's is not started before the scan lets the event loop run (1.5 s,
    past the guard's 1 s). The worker times the guard from its start, as a process running
    both would; the dispatcher, with no news, must wait for a request of the same process
    while a neighbour of the same emit may hold its loop (the neighbour's timeout)."""
    guard = {**h("guard", "deny", 2 if scan_first else 1, 1.0, "ignore"), "parallel": True}
    scan = {**h("scan", "scan", 1 if scan_first else 2, 5.0), "parallel": True}
    handlers = [scan, guard] if scan_first else [guard, scan]
    out, _ = await served_three_ways(connect, fleet, event, handlers, [tool(), tool()])
    denied = ("deny", "guard denies", COMMAND, [])
    assert out == {way: [denied, denied] for way in out}


async def test_an_object_json_cannot_carry_is_converted_as_in_process(
    connect: Connect, fleet: Fleet, event: str
) -> None:
    handlers = [h("h1", "bad", 1, 5.0), h("h2", "allow", 2, 5.0), h("h3", "deny", 3, 5.0)]
    out, _ = await served_three_ways(connect, fleet, event, handlers, [tool()])
    denied = ("deny", "h3 denies", COMMAND, [])
    assert out == {way: [denied] for way in out}


async def test_a_worker_behind_a_slow_link_runs_no_step_twice(
    connect: Connect, nats_url: str, tmp_path: Path, event: str
) -> None:
    handlers = [
        h("redact", "redact", 1, 1.0, "deny"), h("scan", "scan", 2, 5.0),
        h("audit", "audit", 3, 5.0),
    ]  # fmt: skip
    runs = await Runs().listen(await connect(), event)
    async with NatsProxy(nats_url, latency_s=0.3) as proxy, Fleet(proxy.url, tmp_path) as far:
        await paced_workers(far, event, handlers)
        emits = [tool(), tool(miss=True)]
        out = await three_ways(connect, event, handlers, emits, runs)
        redacted = ("continue", None, "export KEY=***", [])
        assert out == {way: [redacted, redacted] for way in out}
        await runs.settle(
            {(s["name"], f"{w}-{i}") for s in handlers for w in out for i in range(2)}
        )
    assert set(runs.count.values()) == {1}, runs.count
    assert len(runs.count) == 3 * 2 * len(handlers)


async def test_a_replica_paused_before_it_reads_runs_no_step_of_a_stale_chain(
    connect: Connect, fleet: Fleet, event: str
) -> None:
    handlers = [h("h1", "allow", 1, 1.0), h("h2", "deny", 2, 1.0)]
    runs = await Runs().listen(await connect(), event)
    a, _b = await paced_workers(fleet, event, handlers, replicas=2)
    async with HookDispatcher(await connect()) as d:
        await d.emit(event, tool(tag="warm"))  # the declarations are read
        a.pause()
        try:
            for i in range(6):
                await asyncio.wait_for(d.emit(event, tool(tag=f"paused-{i}")), 30)
        finally:
            a.resume()
        await asyncio.sleep(3.0)  # the window in which a resumed replica could run a stale chain
        await runs.settle(set())
    twice = {key: n for key, n in runs.count.items() if n > 1}
    assert twice == {}
    assert a.alive and not a.tracebacks()


async def test_a_repeated_progress_reply_cannot_re_arm_a_step(
    connect: Connect, fleet: Fleet, event: str
) -> None:
    """A peer on the chain subject that says "h1 is running" every 0.2 s: the emit ends
    one timeout (1 s) and the grace after the first such report, not when the peer stops."""
    handlers = [h("h1", "allow", 1, 1.0), h("h2", "allow", 2, 1.0)]
    [worker] = await paced_workers(fleet, event, handlers)
    async with HookDispatcher(await connect()) as d:
        await d.emit(event, tool(tag="warm"))
        subject = chain_subject(event, handler_set_id(["h1", "h2"]))
        worker.pause()  # its subscription stays: the peer answers, the worker never does
        peer = await connect()
        stop = asyncio.Event()

        async def repeat(msg: Msg) -> None:
            while not stop.is_set():
                report = HookReply(handler="set", chain=[], running=["h1"], running_for_s=0.0)
                await peer.publish(msg.reply, encode(report))
                await asyncio.sleep(0.2)

        async def answer(msg: Msg) -> None:
            tasks.add(asyncio.ensure_future(repeat(msg)))

        tasks: set[asyncio.Future[None]] = set()
        await peer.subscribe(subject, cb=answer)
        await peer.flush()
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(d.emit(event, tool(tag="rogue")), 30)
        finally:
            stop.set()
            worker.resume()
        took = time.monotonic() - started
    assert ("h1", "timeout") in [(f.handler, f.kind) for f in result.failures]
    assert took < 6.0, took  # 1 s + the grace, then h2 alone (1 s at most); not 11 s
