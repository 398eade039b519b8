"""A stalled replica the queue group keeps choosing, for a handler that may not be sent
twice (not ``retry_safe``): each call is sent once, so a call the paused replica took fails
closed by its policy; the calls after it must reach the live replica.

A 3-node cluster on 127.0.0.1; replica A on the agent's node (SIGSTOPped), replica B on
another node. In one cluster the queue group picks either replica (about half the harmless
calls were denied during the stall before the dispatcher steered away from a suspect queue
subject: 78 of 150). Across a supercluster's gateways it picks the local one every time;
tests/test_supercluster.py covers that, and hedging there.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import nats
import pytest
from _cluster import Cluster, wait_for
from _fleet import Fleet, HandlerConf, Load, steady_load
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

STALL_LOAD = 300
"""Emits made while replica A is paused (after a warm-up that A answers alone)."""


async def _load_while_paused(
    cluster: Cluster, tmp_path: Path, conf: HandlerConf
) -> tuple[Load, Load]:
    """(warm-up load, load while replica A is paused) against `conf`'s guard."""
    near, far = cluster.nodes[0].url, cluster.nodes[1].url
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
    async with Fleet(near, tmp_path / "a") as fleet_a, Fleet(far, tmp_path / "b") as fleet_b:
        a = await fleet_a.worker([conf])
        await fleet_b.worker([conf])
        nc: NATS = await nats.connect(near)
        try:
            async with HookDispatcher(nc) as d:
                with anyio.fail_after(20):
                    while conf.name not in {r.name for r in d.routes(conf.event)}:
                        await d.refresh()
                warm = await _run(d, conf, 100)
                a.pause()
                try:
                    paused = await _run(d, conf, STALL_LOAD)
                finally:
                    a.resume()
        finally:
            await nc.close()
    return warm, paused


async def _run(d: HookDispatcher, conf: HandlerConf, n: int) -> Load:
    load, stop = Load(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(steady_load, d, conf.event, conf.name, load, stop, 8)
        await wait_for(lambda: _at_least(load, n), timeout_s=60, interval_s=0.05)
        stop.set()
    return load


async def _at_least(load: Load, n: int) -> bool:
    return load.decided + len(load.undecided) >= n


def _names() -> tuple[str, str]:
    return f"stall:{uuid.uuid4().hex[:10]}", f"guard_{uuid.uuid4().hex[:6]}"


async def test_a_plain_guard_fails_closed_only_until_a_live_replica_is_known(
    cluster: Cluster, tmp_path: Path
) -> None:
    event, guard = _names()
    conf = HandlerConf(event, guard, priority=10, failure_policy="deny", timeout_s=1.0)
    warm, paused = await _load_while_paused(cluster, tmp_path, conf)
    assert warm.failed_closed == 0 and warm.wrong == [] and warm.undecided == []
    assert paused.undecided == [], sorted(set(paused.undecided))
    assert paused.wrong == [], sorted(set(paused.wrong))[:5]
    # never sent twice: the calls in flight when A stopped, and those sent before the
    # discovery answered, fail closed (deny, the policy); then every call reaches B
    harmless = STALL_LOAD // 2
    assert paused.failed_closed <= 24, (
        f"{paused.failed_closed} of about {harmless} harmless calls denied by the stall"
    )
