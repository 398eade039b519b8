"""A replica of a replicated bucket that lags behind its leader, with no fault anywhere:
what it answers by itself must not be taken for what the leader stored.

JetStream serves a direct get from any replica of the stream, followers included (a
follower starts answering once it is about caught up, and goes on when it falls behind
again), so on a 3-node cluster a direct get may say "not found" for a record the leader
stored and acknowledged a moment ago. The lag here is real: every route of node ``n3``
passes through a forwarder that delivers its bytes late (`_lagging_cluster`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import anyio
import nats
import pytest
from _declarations import declaration
from _lagging_cluster import LaggingCluster

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.jetstream import bind_key_value
from hookbus.dispatcher._registry_follow import RegistryFollower
from hookbus.dispatcher._route_table import RoutingTable
from hookbus.schemas import HANDLERS_BUCKET, encode, handler_key

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

STREAM = f"KV_{HANDLERS_BUCKET}"

FOLLOWERS = 8
"""Followers started beside the lagging replica. Each one's direct get is answered by the
lagging replica or, too late for its 5 s page, by another; the snapshot of a follower
that trusted whoever answered was the lagging one's for nearly all of them (a follower
escapes only if the other replicas were drawn for every try made before the lag ends:
about 0.4 each, so all eight with a chance near 0.001)."""

LAG_S = 10.0
"""How late ``n3`` hears (and answers) anything, seconds: its round trip to the others is
longer than a direct get's page (5 s) and a JetStream API request (5 s)."""


async def _leader_elsewhere(admin: Any, not_on: str, stream: str = STREAM) -> str:
    """Move `stream`'s leader off node `not_on` (a lagging leader would lag every write)."""
    js = admin.jetstream()
    with anyio.fail_after(60):
        while True:
            info = await js.stream_info(stream)
            leader = info.cluster.leader if info.cluster else None
            if leader and leader != not_on:
                return str(leader)
            with contextlib.suppress(Exception):
                await admin.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
            await anyio.sleep(1.0)  # an election: no event to wait on


async def _last_seq_on(node: Any, stream: str) -> int:
    """`stream`'s last sequence as `node` holds it (its monitoring endpoint)."""
    jsz = await anyio.to_thread.run_sync(node.http_json, "/jsz?streams=true")
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                return int((detail.get("state") or {}).get("last_seq") or 0)
    raise AssertionError(f"{node.name} holds no replica of {stream}")


async def test_a_registry_snapshot_from_a_replica_behind_the_leader_is_not_taken_as_current(
    tmp_path: Any,
) -> None:
    """A guard is declared (stored by the leader and a second replica, acknowledged) while
    ``n3`` lags; followers connected to ``n3`` start at once. The guard's republished change
    was sent before their subscriptions reached the leader, so only a snapshot can bring
    it. A follower must not call itself current with a snapshot older than what the
    leader had stored when it subscribed: it reads again until one is as new (here, once
    the lag has drained). Before, a follower took the lagging replica's snapshot, said it
    was current, and routed no guard: every emit of the event was allowed until the
    periodic check, up to 36 s later."""
    event = f"test:{uuid.uuid4().hex[:10]}"
    cluster = LaggingCluster(tmp_path / "cluster").start()
    conns: list[Any] = []
    followers: list[RegistryFollower] = []
    try:
        await cluster.wait_ready()
        n1, _, n3 = cluster.nodes
        admin = await nats.connect(n1.url)
        conns.append(admin)
        js = admin.jetstream()
        kv = await js.create_key_value(config=handlers_bucket_config(replicas=3))
        await kv.put(handler_key("other:event", "x"), encode(declaration("other:event", "x")))
        await _leader_elsewhere(admin, n3.name)
        for _ in range(FOLLOWERS):
            conns.append(await nats.connect(n3.url))
        tables = [RoutingTable() for _ in range(FOLLOWERS)]
        followers = [
            RegistryFollower(bind_key_value(c, HANDLERS_BUCKET), t, check_s=600.0)
            for c, t in zip(conns[1:], tables, strict=True)
        ]

        cluster.lag_s = LAG_S
        guard = declaration(event, "guard", failure_policy="deny", timeout_s=0.5)
        await kv.put(handler_key(event, "guard"), encode(guard))  # the leader and one more

        async def lag_ends() -> None:
            await anyio.sleep(LAG_S * 0.8)  # the lag itself: nothing to wait on
            cluster.lag_s = 0.0

        with anyio.fail_after(LAG_S * 6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lag_ends)
                for f in followers:
                    tg.start_soon(lambda f=f: f.start(deadline_s=LAG_S * 5))

        behind = [
            i for i, (f, t) in enumerate(zip(followers, tables, strict=True))
            if f.current and not t.routes(event)
        ]  # fmt: skip
        assert not behind, (
            f"followers {behind} (of {FOLLOWERS}) call themselves current with no route for "
            "the guard the leader stored before they subscribed"
        )
        assert all(t.routes(event) for t in tables)
    finally:
        cluster.lag_s = 0.0
        for f in followers:
            await f.stop()
        for c in conns:
            with contextlib.suppress(Exception):
                await c.close()
        await cluster.close()


READ_LAG_S = 1.5
"""How late ``n3`` hears, seconds, when a read from it must still reach the leader within
nats-py's JetStream request timeout (5 s): a round trip of 3 s."""


async def test_a_grant_revoked_is_not_read_back_from_a_replica_behind_the_leader(
    tmp_path: Any,
) -> None:
    """An "Allow always" grant is revoked (deleted by the leader and a second replica,
    acknowledged) while ``n3`` lags; a dispatcher connected to ``n3`` then looks for it,
    sixteen times at once. Each look must find nothing: a record hookbus decides on is read
    from the stream's leader. Before, the gets were direct gets, which any replica answers:
    in the runs where ``n3`` answered some of them itself (about a third each, when its
    direct get subscription was up), those found the grant, which allowed calls without
    asking anyone until ``n3`` caught up."""
    import time

    from hookbus._core.buckets import approvals_bucket_config
    from hookbus._core.kv import open_bucket
    from hookbus.dispatcher._grants import Grants
    from hookbus.schemas import ApprovalGrant

    cluster = LaggingCluster(tmp_path / "cluster").start()
    conns: list[Any] = []
    try:
        await cluster.wait_ready()
        n1, _, n3 = cluster.nodes
        admin, reader = await nats.connect(n1.url), await nats.connect(n3.url)
        conns += [admin, reader]
        config = approvals_bucket_config(replicas=3)
        writes = Grants(await open_bucket(admin, config))
        stream = f"KV_{config.bucket}"
        await _leader_elsewhere(admin, n3.name, stream)
        reads = Grants(await open_bucket(reader, config))
        grant = ApprovalGrant(
            session_id="s1", event="tool:pre", handler="ask", agent_id="a1", tool="Bash",
            choice="Allow always", label="approval:1", granted_at=time.time(),
            approved_by="p1", expires_at=time.time() + 3600,
        )  # fmt: skip
        scope = ("a1", "s1", "tool:pre", "ask", "Bash")
        await writes.put(grant, budget_s=10)
        assert await reads.find(*scope, budget_s=10) == grant

        cluster.lag_s = READ_LAG_S
        await writes.revoke(grant)
        leader_last = (await admin.jetstream().stream_info(stream)).state.last_seq
        assert await _last_seq_on(n3, stream) < leader_last, "n3 was not behind"
        found = await asyncio.gather(*(reads.find(*scope, budget_s=20) for _ in range(16)))
        assert found == [None] * 16, f"{sum(f is not None for f in found)} of 16 found it"
    finally:
        cluster.lag_s = 0.0
        for c in conns:
            with contextlib.suppress(Exception):
                await c.close()
        await cluster.close()
