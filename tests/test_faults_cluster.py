"""Fault tests on a 3-node JetStream cluster: losing the meta leader and the handlers
bucket's stream leader under steady emit load, then getting them back.

The decision is asserted, not only "no crash": every emit gets a decision by its deadline,
a fail-closed handler never fails open (a `deny`-policy failure denies, with the failure
recorded and `decided_by` naming the handler), and a worker started during the election
registers (it retries instead of giving up).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import anyio
import pytest
from _cluster import Cluster, wait_for
from _fleet import Load, steady_load
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HANDLERS_BUCKET, HookResult
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

HANDLERS_STREAM = f"KV_{HANDLERS_BUCKET}"


async def guard_handler(event: str, data: dict[str, Any]) -> HookResult:
    if "rm -rf" in str(data.get("tool_input", {}).get("command", "")):
        return HookResult(action="deny", reason="destructive")
    return HookResult(action="continue")


async def audit_handler(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="continue")


async def start_new_worker(nc: NATS, event: str, name: str, timeout_s: float) -> float:
    """Start a worker declaring a new handler; returns the seconds `start` took.

    Raises whatever `start` raises, or TimeoutError after `timeout_s`.
    """
    w = HookWorker(nc, bucket_replicas=3)
    w.add_handler(event, audit_handler, name=name, priority=50, timeout_s=2.0)
    started = time.monotonic()
    with anyio.fail_after(timeout_s):
        await w.start()
    return time.monotonic() - started


@pytest.mark.timeout(240)  # its own waits (elections, registrations) add up past 60 s
async def test_meta_and_stream_leader_loss_under_load(cluster: Cluster) -> None:
    event = f"faults:{uuid.uuid4().hex[:10]}"
    guard, audit = f"guard_{uuid.uuid4().hex[:6]}", f"audit_{uuid.uuid4().hex[:6]}"
    conns: list[NATS] = []
    try:
        nc_w, nc_d, nc_new = [await cluster.connect() for _ in range(3)]
        conns += [nc_w, nc_d, nc_new]
        worker = HookWorker(nc_w, bucket_replicas=3)
        worker.add_handler(
            event, guard_handler, name=guard, priority=10, timeout_s=2.0, failure_policy="deny"
        )
        worker.add_handler(event, audit_handler, name=audit, priority=20, timeout_s=2.0)
        async with worker, HookDispatcher(nc_d, bucket_replicas=3) as d:
            await wait_for(lambda: _has_routes(d, event, {guard, audit}))
            load, stop = Load(), anyio.Event()
            registered: list[str] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(steady_load, d, event, guard, load, stop, 6)
                await wait_for(lambda: _at_least(load, 50))

                # 1. the meta leader dies, and comes back
                meta = await wait_for(cluster.meta_leader)
                cluster.node(meta).kill()
                await wait_for(lambda: _new_meta_leader(cluster, meta), timeout_s=25)
                cluster.node(meta).start()
                await cluster.wait_ready()
                before = load.decided
                await wait_for(lambda: _at_least(load, before + 50))

                # 2. the handlers bucket's stream leader dies; a new worker registers meanwhile
                leader = await cluster.stream_leader(nc_d, HANDLERS_STREAM)
                cluster.node(leader).kill()
                name = f"late_{uuid.uuid4().hex[:6]}"
                try:
                    took = await start_new_worker(nc_new, event, name, timeout_s=20)
                    registered.append(f"{name} in {took:.1f}s")
                except Exception as exc:  # reported below, after the load is stopped
                    registered.append(f"FAILED: {type(exc).__name__}: {exc}")
                cluster.node(leader).start()
                await cluster.wait_ready()
                # 3. after the election, another worker registers
                name2 = f"after_{uuid.uuid4().hex[:6]}"
                try:
                    await start_new_worker(nc_new, event, name2, timeout_s=20)
                    await wait_for(lambda: _has_routes(d, event, {name2}), timeout_s=20)
                    registered.append(f"{name2} routed")
                except Exception as exc:
                    registered.append(f"FAILED after: {type(exc).__name__}: {exc}")
                before, behind = load.decided, load.behind
                await wait_for(lambda: _at_least(load, before + 50))
                stop.set()
    finally:
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()
    assert not [r for r in registered if r.startswith("FAILED")], registered
    assert load.decided > 150
    assert load.undecided == [], f"{len(load.undecided)} undecided: {sorted(set(load.undecided))}"
    assert load.wrong == [], f"{len(load.wrong)} wrong: {sorted(set(load.wrong))[:5]}"
    # denied unasked while an election outlasted an emit's wait, never once caught up
    assert load.behind == behind, f"{load.behind - behind} denied behind after recovery"


async def _has_routes(d: HookDispatcher, event: str, names: set[str]) -> bool:
    return names <= {r.name for r in d.routes(event)}


async def _at_least(load: Load, n: int) -> bool:
    return load.decided + len(load.undecided) >= n


async def _new_meta_leader(cluster: Cluster, old: str) -> bool:
    leader = await cluster.meta_leader()
    return leader is not None and leader != old
