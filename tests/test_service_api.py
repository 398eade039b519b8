"""The dispatcher service on the NATS services API (``nats.micro``): what ``nats micro ls``,
``nats micro info hookbus-dispatcher`` and ``nats micro stats hookbus-dispatcher`` read.

A real nats-server (the session's), real `DispatcherService` replicas and plain NATS
requests on the ``$SRV`` subjects, parsed by nats-py's own services API types. Other
tests may run dispatcher services on the same server, so each test reaches its replicas
by their instance ids.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import anyio
import nats.errors
import pytest
from nats.aio.client import Client as NATS
from nats.micro.service import ServiceInfo, ServicePing, ServiceStats

from hookbus.dispatcher import DispatcherService, HookDispatcher, live_dispatchers
from hookbus.schemas import (
    COLLECT_SERVICE_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    DISPATCHER_SERVICE_NAME,
    EMIT_SERVICE_WILDCARD,
    HookResult,
    collect_service_subject,
    emit_service_subject,
)

pytestmark = pytest.mark.anyio

SLEEP_S = 0.05


async def _service(connect: Any, event: str, **options: Any) -> DispatcherService:
    """A started service whose one in-process handler on `event` sleeps 50 ms."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)

    async def slow(ev: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(SLEEP_S)
        return HookResult(action="continue")

    d.register(event, slow, name="slow")
    service = DispatcherService(d, snc, **options)
    await service.start()
    return service


async def _ask(nc: NATS, subject: str) -> dict[str, Any]:
    msg = await nc.request(subject, b"", timeout=5)
    return dict(json.loads(msg.data))


async def _scatter(nc: NATS, subject: str, wait_s: float = 0.5) -> list[dict[str, Any]]:
    """Every answer to one request on `subject` within `wait_s` (a `nats micro ls`)."""
    inbox = nc.new_inbox()
    got: list[dict[str, Any]] = []

    async def on_reply(msg: Any) -> None:
        got.append(json.loads(msg.data))

    sub = await nc.subscribe(inbox, cb=on_reply)
    await nc.publish(subject, b"", reply=inbox)
    await anyio.sleep(wait_s)
    await sub.unsubscribe()
    return got


async def test_info_names_the_two_endpoints(connect: Any, event: str) -> None:
    service = await _service(connect, event)
    try:
        sid = service.service_id
        assert sid
        nc = await connect()
        raw = await _ask(nc, f"$SRV.INFO.{DISPATCHER_SERVICE_NAME}.{sid}")
        info = ServiceInfo.from_dict(raw)
    finally:
        await service.stop()
    assert raw["type"] == "io.nats.micro.v1.info_response"
    assert (info.name, info.id) == (DISPATCHER_SERVICE_NAME, sid)
    assert info.version.count(".") >= 2  # a semantic version
    assert {e.name: (e.subject, e.queue_group) for e in info.endpoints} == {
        "emit": (EMIT_SERVICE_WILDCARD, DISPATCHER_QUEUE_GROUP),
        "emit_and_collect": (COLLECT_SERVICE_WILDCARD, DISPATCHER_QUEUE_GROUP),
    }
    emit = next(e for e in info.endpoints if e.name == "emit")
    assert emit.metadata["subject_pattern"] == "hookbus.v1.emit.<agent>.<event>"
    assert (emit.metadata["request"], emit.metadata["reply"]) == ("EmitRequest", "EmitReply")
    assert info.metadata["max_concurrency"] == "512" and info.metadata["audit"] == "off"


async def test_ping_of_every_service_lists_each_replica(connect: Any, event: str) -> None:
    """``$SRV.PING`` (what ``nats micro ls`` sends) is answered by every replica."""
    one = await _service(connect, event)
    two = await _service(connect, event)
    ids = {one.service_id, two.service_id}
    assert None not in ids and len(ids) == 2
    try:
        nc = await connect()
        pings = [ServicePing.from_dict(p) for p in await _scatter(nc, "$SRV.PING")]
        by_kind = await _scatter(nc, f"$SRV.PING.{DISPATCHER_SERVICE_NAME}")
    finally:
        await one.stop()
        await two.stop()
    assert ids <= {p.id for p in pings if p.name == DISPATCHER_SERVICE_NAME}
    assert ids <= {p["id"] for p in by_kind}


async def test_stats_count_requests_errors_and_processing_time(connect: Any, event: str) -> None:
    service = await _service(connect, event)
    agent = await connect()
    try:
        sid = service.service_id
        for _ in range(3):
            await agent.request(emit_service_subject(event, "a1"), b'{"data": {}}', timeout=5)
        bad = await agent.request(emit_service_subject(event, "a1"), b"not json", timeout=5)
        assert json.loads(bad.data)["error"]["code"] == "bad_request"
        for _ in range(2):
            await agent.request(
                collect_service_subject(event, "a1"), b'{"timeout_s": 1}', timeout=5
            )
        raw = await _ask(agent, f"$SRV.STATS.{DISPATCHER_SERVICE_NAME}.{sid}")
    finally:
        await service.stop()
    stats = ServiceStats.from_dict(raw)
    assert raw["type"] == "io.nats.micro.v1.stats_response" and stats.id == sid
    by_name = {e.name: e for e in stats.endpoints}
    emit, collect = by_name["emit"], by_name["emit_and_collect"]
    assert (emit.num_requests, emit.num_errors) == (4, 1)
    assert emit.last_error is not None and emit.last_error.startswith("bad_request: ")
    assert (collect.num_requests, collect.num_errors) == (2, 0)
    # three emits slept 50 ms each; the bad one returned at once: at least 150 ms in all
    assert emit.processing_time >= 3 * SLEEP_S * 1e9
    assert emit.average_processing_time == emit.processing_time // 4
    assert emit.data == {"in_flight": 0, "answered": 4, "draining": False}


async def test_busy_refusals_are_counted_as_errors(connect: Any, event: str) -> None:
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    gate = asyncio.Event()
    entered = asyncio.Event()

    async def gated(ev: str, data: dict[str, Any]) -> HookResult:
        entered.set()
        await gate.wait()
        return HookResult(action="continue")

    d.register(event, gated, name="gated")
    service = DispatcherService(d, snc, max_concurrency=1)
    await service.start()
    agent = await connect()
    subject = emit_service_subject(event, "a1")
    try:
        first = asyncio.create_task(agent.request(subject, b'{"data": {}}', timeout=10))
        await entered.wait()
        refused = json.loads((await agent.request(subject, b'{"data": {}}', timeout=5)).data)
        during = await _ask(agent, f"$SRV.STATS.{DISPATCHER_SERVICE_NAME}.{service.service_id}")
        gate.set()
        await first
    finally:
        gate.set()
        await service.stop()
    assert refused["error"]["code"] == "busy"
    emit = next(e for e in during["endpoints"] if e["name"] == "emit")
    assert (emit["num_requests"], emit["num_errors"]) == (2, 1)
    assert emit["last_error"].startswith("busy: ")
    assert emit["data"]["in_flight"] == 1  # the gated one, still running


async def test_a_stopped_replica_no_longer_answers(connect: Any, event: str) -> None:
    service = await _service(connect, event)
    sid = service.service_id
    nc = await connect()
    await _ask(nc, f"$SRV.PING.{DISPATCHER_SERVICE_NAME}.{sid}")
    await service.stop()
    assert service.service_id is None
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request(f"$SRV.PING.{DISPATCHER_SERVICE_NAME}.{sid}", b"", timeout=2)


async def test_live_dispatchers_reads_every_replica_with_its_counts(
    connect: Any, event: str
) -> None:
    one = await _service(connect, event)
    two = await _service(connect, event, max_concurrency=7)
    ids = [str(one.service_id), str(two.service_id)]
    agent = await connect()
    try:
        await agent.request(emit_service_subject(event, "a1"), b'{"data": {}}', timeout=5)
        found = {r.service_id: r for r in await live_dispatchers(agent, timeout_s=0.5)}
    finally:
        await one.stop()
        await two.stop()
    assert set(ids) <= set(found)
    mine = [found[i] for i in ids]
    assert sorted(r.metadata["max_concurrency"] for r in mine) == ["512", "7"]
    emits = [next(e for e in r.endpoints if e.name == "emit") for r in mine]
    assert sum(e.requests for e in emits) == 1  # the queue group gave it to one of them
    served = next(e for e in emits if e.requests == 1)
    assert served.errors == 0 and served.average_ms >= SLEEP_S * 1000
    assert all(e.subject == EMIT_SERVICE_WILDCARD for e in emits)


async def test_hookbus_services_lists_dispatchers_and_workers(
    connect: Any, nats_url: str, event: str
) -> None:
    from hookbus.workers import HookWorker

    service = await _service(connect, event)
    sid = service.service_id
    worker = HookWorker(await connect())

    @worker.handler(event, name="remote_guard")
    async def remote_guard(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue")

    try:
        async with worker:
            agent = await connect()
            await agent.request(emit_service_subject(event, "a1"), b'{"data": {}}', timeout=5)
            args = [sys.executable, "-m", "hookbus.cli", "services", "--url", nats_url]
            with anyio.fail_after(30):
                as_json = await anyio.run_process([*args, "--json"], check=False)
                table = await anyio.run_process(args, check=False)
            handlers = await anyio.run_process(
                [sys.executable, "-m", "hookbus.cli", "handlers", "--url", nats_url],
                check=False,
            )
    finally:
        await service.stop()
    assert as_json.returncode == 0, as_json.stderr.decode()
    body = json.loads(as_json.stdout)
    [mine] = [d for d in body["dispatchers"] if d["service_id"] == sid]
    emit = next(e for e in mine["endpoints"] if e["name"] == "emit")
    assert emit["requests"] == 1 and emit["subject"] == EMIT_SERVICE_WILDCARD
    workers = [w for w in body["workers"] if w["service_id"] == worker.instance]
    assert workers and {"event": event, "name": "remote_guard"} in workers[0]["handlers"]

    text = table.stdout.decode()
    assert table.returncode == 0, table.stderr.decode()
    assert DISPATCHER_SERVICE_NAME in text and "emit_and_collect" in text
    assert "remote_guard" in text and "Traceback" not in table.stderr.decode()

    assert handlers.returncode == 0, handlers.stderr.decode()
    assert "dispatcher services: " in handlers.stderr.decode()
    assert f"{sid}" in handlers.stderr.decode()
