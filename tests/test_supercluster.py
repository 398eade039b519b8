"""hookbus on a NATS supercluster: two clusters (``east``, ``west``) of three nats-servers
joined by gateways, one JetStream across both (no domains), on 127.0.0.1
(tests/_supercluster.py; the configs laid out as deploy/supercluster ships them).

- The operator places the buckets in ``east`` (``hookbus auth provision --placement-cluster
  east``) from a process connected to ``west``: JetStream reports them in ``east``.
- An agent connected to ``west`` with a worker in ``east``: allow, deny, an approval and a
  suspension answered from other connections, decided as on one server.
- A stalled replica in the agent's cluster (a worker process SIGSTOPped 5 s, another in
  ``east``): every ``retry_safe`` call still gets the handler's real answer; a
  non-retry_safe fail-closed guard fails closed for a handful of calls at most; nothing
  wrong, nothing undecided.
- The other cluster lost (every ``east`` node SIGKILLed 3 s, a guard served only there):
  the guard fails closed throughout, never open, and decides again soon after the restart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from _sites import EVENT, asked_and_allowed, hooked_and_resolved, site_worker
from _supercluster import EAST, WEST, Supercluster, outage_run, stall_run, stream_cluster
from nats.aio.client import Client as NATS

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import (
    APPROVALS_BUCKET,
    HANDLERS_BUCKET,
    LEASES_BUCKET,
    SUSPENSIONS_BUCKET,
)
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

BUCKETS = (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET, LEASES_BUCKET)
RM = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}
LS = {"tool_name": "bash", "tool_input": {"command": "ls"}}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKBUS_", "NATS_"))}
    return {**env, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def supercluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supercluster]:
    """One supercluster for the tests that do not damage it, its buckets provisioned R3 in
    ``east`` by the operator from a process connected to ``west``."""
    sc = Supercluster(tmp_path_factory.mktemp("supercluster"))
    sc.start()
    try:
        anyio.run(sc.wait_ready, backend="asyncio")
        done = subprocess.run(
            [sys.executable, "-m", "hookbus.cli", "auth", "provision", "--url", sc.url(WEST),
             "--replicas", "3", "--placement-cluster", EAST],
            capture_output=True, text=True, env=_env(), stdin=subprocess.DEVNULL, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        yield sc
    finally:
        sc.stop()


async def test_buckets_placed_in_east_from_a_process_in_west(
    supercluster: Supercluster, conns: list[NATS]
) -> None:
    nc = await supercluster.connect(WEST)
    conns.append(nc)
    assert nc.connected_url is not None and nc.connected_url.port in {
        n.port for n in supercluster.cluster_nodes(WEST)
    }
    east = {n.name for n in supercluster.cluster_nodes(EAST)}
    for bucket in BUCKETS:
        stream = f"KV_{bucket}"
        assert await stream_cluster(nc, stream) == EAST, stream
        info = await nc.jetstream(timeout=5).stream_info(stream)
        assert info.config.placement is not None and info.config.placement.cluster == EAST
        assert info.cluster is not None
        holders = {info.cluster.leader, *(r.name for r in info.cluster.replicas or [])}
        assert holders == east, (stream, holders)


@pytest.fixture
async def east_worker(supercluster: Supercluster, conns: list[NATS]) -> AsyncIterator[HookWorker]:
    """A worker in ``east``: a deny-policy guard on `EVENT` (denies ``rm -rf``) and a
    handler asking the user on `ASK_EVENT`."""
    nc = await supercluster.connect(EAST)
    conns.append(nc)
    worker = site_worker(nc)

    async with worker:
        yield worker


async def test_an_agent_in_west_decides_with_a_worker_in_east_as_on_one_server(
    supercluster: Supercluster, conns: list[NATS], east_worker: HookWorker
) -> None:
    async def connect_west() -> NATS:
        nc = await supercluster.connect(WEST)
        conns.append(nc)
        return nc

    d = HookDispatcher(await connect_west(), agent_id="west-agent")
    other = HookDispatcher(await connect_west(), approvals=False)
    async with d, other:
        with anyio.fail_after(10):
            while "security" not in d.list_handlers(EVENT).get(EVENT, []):
                await d.refresh()
        r = await d.emit(EVENT, RM)
        assert r.action == "deny" and r.decided_by == "security" and not r.failures, r
        ok = await d.emit(EVENT, LS)
        assert ok.action == "continue" and not ok.failures, ok

        # a suspension: hooked by the agent in west, resolved from another connection
        got = await hooked_and_resolved(d, other, "west-agent", 15)
        assert got == [{"ok": True}]

        # an approval: asked by the worker in east, answered by an approver in west
        approver = await ApprovalsClient.open(await connect_west())
        try:
            allowed = await asked_and_allowed(d, approver, 15)
            assert allowed.action == "continue", allowed
        finally:
            await approver.close()


async def test_a_stalled_replica_in_the_agents_cluster_costs_latency_not_decisions(
    supercluster: Supercluster, tmp_path: Path
) -> None:
    started = time.monotonic()
    out = await stall_run(supercluster, tmp_path, stall_s=5.0)
    hedged, guard = out.hedged, out.guard
    in_stall_hedged, in_stall_guard = out.in_stall(hedged), out.in_stall(guard)
    print(
        f"\n{hedged.summary()} ({len(in_stall_hedged)} during the stall)"
        f"\n{guard.summary()} ({len(in_stall_guard)} during the stall,"
        f" {sum(not ok for *_, ok in in_stall_guard)} of them failed closed)"
        f"\nwest worker stopped: {out.stopped}; run {time.monotonic() - started:.1f}s"
        "\nguard failed closed (start+duration, s from the stall's start): "
        + ", ".join(f"{a - out.stall_start:+.2f}+{b - a:.2f}" for a, b, ok in guard.log if not ok)
    )
    assert out.stopped, "the west worker was not stopped"
    for tally in (hedged, guard):
        assert not tally.wrong, tally.wrong[:5]
        assert not tally.undecided, tally.undecided[:5]
    assert hedged.emits >= 200 and guard.emits >= 100, (hedged.emits, guard.emits)
    # retry_safe: a stalled local replica costs latency, never the handler's own answer
    assert hedged.answered == hedged.emits and hedged.failed_closed == 0, hedged.summary()
    # not retry_safe: the first call(s) fail closed, then requests go to the live instance
    assert guard.failed_closed <= 5, guard.summary()


async def test_the_other_cluster_lost_fails_closed_and_recovers(tmp_path: Path) -> None:
    sc = Supercluster(tmp_path / "sc")
    sc.start()
    try:
        await sc.wait_ready()
        out = await outage_run(sc, tmp_path / "fleet", outage_s=3.0)
    finally:
        sc.stop()
    guard = out.guard
    during = out.in_outage()
    recovered = "never" if out.recovered_s is None else f"{out.recovered_s:.2f}s"
    print(
        f"\n{guard.summary()}; during the outage {len(during)} emits,"
        f" {sum(ok for *_, ok in during)} answered by the guard; failed closed for"
        f" {out.fail_closed_s:.2f}s; recovered {recovered} after the restart"
    )
    assert not guard.wrong, guard.wrong[:5]
    assert not guard.undecided, guard.undecided[:5]
    assert during and not any(ok for *_, ok in during), "the outage was not felt"
    assert out.recovered_s is not None and out.recovered_s < 10, out.recovered_s
