"""A 2x3-node NATS supercluster on 127.0.0.1 for the supercluster tests and fault benchmark.

Two clusters (`EAST`, `WEST`) of three nats-servers each, JetStream on every node (one
JetStream across both, no domains: NATS's supercluster), gateways joining the clusters.
Every node is `_cluster.Node` (its start / kill / stop / restart, monitoring and
``/healthz`` poll) with a gateway port and a config laid out like the shipped
``deploy/supercluster/<cluster>-n<i>.conf``: the shipped ``common.conf`` (the ping settings
that make a silent gateway fail over in 2 s) is copied beside the generated configs and
included as it is, so the tests run what the deploy folder ships.

What the tests need from it:

- `Supercluster.start` / `Supercluster.stop` (also a sync context manager);
- `Supercluster.wait_ready`: a readiness poll, not a sleep: every running node healthy
  (``/healthz``: JetStream current), gateways connected both ways (``/gatewayz``: each
  running node has its outbound gateway to every other cluster with a running node: with
  every node of both sides doing so, each cluster is linked to the other both ways), and
  a JetStream meta leader (``/jsz``);
- `Supercluster.servers(cluster)` / `Supercluster.url(cluster)`: a cluster's client URLs;
- `SuperNode.kill` (SIGKILL), `SuperNode.pause` / `SuperNode.resume` (SIGSTOP / SIGCONT),
  `SuperNode.restart`;
- `Supercluster.connect(cluster)`: a client reconnecting forever within that cluster.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import anyio
from _cluster import Node, Servers, free_ports, wait_for
from _pacing import paced_lanes
from nats.aio.client import Client as NATS

__all__ = ["CLUSTERS", "DEPLOY", "EAST", "WEST", "SuperNode", "Supercluster"]

EAST, WEST = "east", "west"
CLUSTERS = (EAST, WEST)
DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "supercluster"
"""The shipped configs; `common.conf` is included by every node started here."""


@dataclass
class SuperNode(Node):
    """One nats-server of the supercluster: `_cluster.Node` with a cluster name and a
    gateway, its config written like ``deploy/supercluster/<cluster>-n<i>.conf``."""

    cluster: str = EAST
    gateway_port: int = 0
    gateways: dict[str, list[int]] = field(default_factory=dict)
    """Gateway ports of every cluster's nodes (own cluster included, as shipped)."""
    paused: bool = False

    max_file_store = "64GB"
    """What provisioning reserves (every bucket's max_bytes, the audit stream's): several
    GiB; a limit, not an allocation (see tests/test_placement.py)."""

    @property
    def serving(self) -> bool:
        return self.running and not self.paused

    def write_config(self) -> None:
        gateways = "\n".join(
            f"    {{ name: {name}, urls: [ "
            + ", ".join(f'"nats://127.0.0.1:{p}"' for p in ports)
            + " ] }"
            for name, ports in self.gateways.items()
        )
        self.config_file.write_text(
            self.config_text(self.cluster)
            + f"""
gateway {{
  name: {self.cluster}
  listen: 127.0.0.1:{self.gateway_port}
  gateways: [
{gateways}
  ]
}}

include "common.conf"
"""
        )

    def kill(self) -> None:
        self.resume()
        super().kill()

    def stop(self) -> None:
        self.resume()
        super().stop()

    def pause(self) -> None:
        """SIGSTOP the node (a stalled server: its connections stay open, silent)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def gateways_up(self, clusters: set[str]) -> bool:
        """Whether this node has its outbound gateway to each of `clusters` (``/gatewayz``).

        Each node opens one outbound gateway to one node of every other cluster; inbound
        ones land on whichever node the other side picked, so a node may have none."""
        try:
            gz = self.http_json("/gatewayz")
        except (OSError, ValueError):
            return False
        return clusters <= set((gz.get("outbound_gateways") or {}).keys())


class Supercluster(Servers[SuperNode]):
    """Two clusters of `size` nats-servers each (`EAST`, `WEST`), gateways joining them,
    JetStream on every node, on free loopback ports (kept across restarts).

    Args:
        base: folder for configs, stores and logs; a temporary one (removed on `stop`)
            when None.
        size: nodes per cluster.
    """

    def __init__(self, base: Path | None = None, *, size: int = 3) -> None:
        super().__init__(base, prefix="hookbus-supercluster-")
        n = size * len(CLUSTERS)
        ports = free_ports(4 * n)
        client, route, gw, http = (ports[k * n : (k + 1) * n] for k in range(4))
        gateways = {c: gw[k * size : (k + 1) * size] for k, c in enumerate(CLUSTERS)}
        self.nodes: list[SuperNode] = []
        for k, c in enumerate(CLUSTERS):
            own = range(k * size, (k + 1) * size)
            for i in own:
                self.nodes.append(
                    SuperNode(
                        name=f"{c}-n{i - k * size + 1}",
                        port=client[i],
                        cluster_port=route[i],
                        http_port=http[i],
                        base=self.base,
                        routes=[route[j] for j in own if j != i],
                        cluster=c,
                        gateway_port=gw[i],
                        gateways=gateways,
                    )
                )

    def cluster_nodes(self, cluster: str) -> list[SuperNode]:
        return [n for n in self.nodes if n.cluster == cluster]

    def servers(self, cluster: str | None = None) -> list[str]:
        """Client URLs of `cluster`'s nodes (every node's when None)."""
        return [n.url for n in self.nodes if cluster is None or n.cluster == cluster]

    def url(self, cluster: str | None = None) -> str:
        """Comma-separated client URLs of `cluster`'s nodes (what ``--url`` takes)."""
        return ",".join(self.servers(cluster))

    def start(self) -> Self:
        shutil.copy(DEPLOY / "common.conf", self.base / "common.conf")
        return super().start()

    def stop(self) -> None:
        for n in self.nodes:
            n.resume()
        super().stop()

    def gateways_connected(self) -> bool:
        """Every running node has its outbound gateway to every other cluster with a running
        node (both sides' nodes do: the clusters are linked both ways)."""
        live = {n.cluster for n in self.nodes if n.serving}
        for n in self.nodes:
            if n.serving and not n.gateways_up(live - {n.cluster}):
                return False
        return True

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Every running node healthy, gateways connected both ways, a meta leader.

        Raises:
            TimeoutError: not ready within `timeout_s` (the nodes' logs say why).
        """
        with anyio.fail_after(timeout_s):
            for n in self.nodes:
                if n.serving:
                    await n.wait_healthy(timeout_s)

            async def gateways() -> bool:
                return await anyio.to_thread.run_sync(self.gateways_connected)

            await wait_for(gateways, timeout_s)
            await wait_for(self.meta_leader, timeout_s)

    async def connect(self, cluster: str | None = None, **kwargs: Any) -> NATS:
        """A client connected to `cluster`'s nodes (every node when None), reconnecting
        forever within them."""
        return await self._connect(self.servers(cluster), **kwargs)


async def stream_cluster(nc: NATS, stream: str) -> str | None:
    """The cluster holding `stream` (``$JS.API.STREAM.INFO.<stream>``), or None."""
    with contextlib.suppress(Exception):
        info = await nc.jetstream(timeout=5).stream_info(stream)
        return info.cluster.name if info.cluster else None
    return None


# -- the fault scenarios (tests/test_supercluster.py asserts on them, benchmarks/faults.py
# -- reports them) ---------------------------------------------------------------------------
HANDLER_TIMEOUT_S = 1.0
"""Every scenario handler's timeout, but the stall's ``retry_safe`` one."""
HEDGED_TIMEOUT_S = 2.0
"""The stall's ``retry_safe`` handler's timeout: its hedges go to the other cluster's
instance once the dispatcher has found it (``$SRV.PING``, answers taken for 0.5 s), which
must fit within it also on a machine running two test suites at once (with 1 s, one call
in 212 failed closed there)."""
EMIT_BOUND_S = 6.0
"""An emit must return (or raise a hookbus error) within this: the handler's timeout, a
hedge or a second try, and slack."""


@dataclass
class Tally:
    """Every emit to one handler during a scenario, judged.

    `check_decision` (tests/_fleet.py) judges each decision against the handler's policy
    (deny ``rm -rf``, continue otherwise; ``failure_policy="deny"``)."""

    handler: str
    emits: int = 0
    wrong: list[str] = field(default_factory=list)
    undecided: list[str] = field(default_factory=list)
    """Emits that raised or returned nothing within `EMIT_BOUND_S`."""
    answered: int = 0
    """Decided by the handler's own answer (no failure of it recorded)."""
    failed_closed: int = 0
    """Denied because the handler failed (its failure recorded, policy deny)."""
    harmless_failed_closed: int = 0
    """Of those, the harmless ones (``ls``: the handler itself would have let it continue)."""
    log: list[tuple[float, float, bool]] = field(default_factory=list)
    """(monotonic start, monotonic end, answered by the handler) of every decided emit."""

    def summary(self) -> str:
        return (
            f"{self.handler}: emits {self.emits}, wrong {len(self.wrong)}, undecided"
            f" {len(self.undecided)}, answered {self.answered}, failed closed {self.failed_closed}"
        )


async def emit_judged(d: Any, event: str, tally: Tally, i: int) -> None:
    """One emit, alternating ``rm -rf /data`` and ``ls``, judged into `tally`."""
    from _fleet import check_decision  # the fault tests' judge

    destructive = i % 2 == 0
    data = {"tool_name": "bash", "tool_input": {"command": "rm -rf /data" if destructive else "ls"}}
    tally.emits += 1
    started = time.monotonic()
    try:
        with anyio.fail_after(EMIT_BOUND_S):
            result = await d.emit(event, data)
    except TimeoutError:
        tally.undecided.append(f"emit {i}: no decision within {EMIT_BOUND_S}s")
        return
    except Exception as exc:
        tally.undecided.append(f"emit {i}: raised {type(exc).__name__}: {exc}"[:300])
        return
    why = check_decision(result, destructive, tally.handler)
    if why:
        tally.wrong.append(f"emit {i}: {why}")
    failed = any(f.handler == tally.handler for f in result.failures)
    if failed and result.action == "deny":
        tally.failed_closed += 1
        tally.harmless_failed_closed += not destructive
    elif not failed:
        tally.answered += 1
    tally.log.append((started, time.monotonic(), not failed))


async def emit_lanes(
    d: Any, event: str, tally: Tally, stop: anyio.Event, *, lanes: int, rate_per_s: float
) -> None:
    """Emit to `event` from `lanes` concurrent lanes at `rate_per_s` in all, until `stop`."""
    await paced_lanes(
        functools.partial(emit_judged, d, event, tally), stop, lanes=lanes, rate_per_s=rate_per_s
    )


@dataclass
class StallOutcome:
    hedged: Tally
    """The ``retry_safe`` handler: every call must get its real answer."""
    guard: Tally
    """The non-retry_safe fail-closed guard: a few may fail closed, none fail open."""
    stall_start: float = 0.0
    stall_end: float = 0.0
    stopped: bool = False
    """Whether every thread of the west worker was seen stopped (SIGSTOP took)."""

    def in_stall(self, tally: Tally) -> list[tuple[float, float, bool]]:
        return [e for e in tally.log if e[0] < self.stall_end and e[1] > self.stall_start]


async def _wait_routes(d: Any, routes: dict[str, str]) -> None:
    with anyio.fail_after(20):
        while any(name not in {r.name for r in d.routes(ev)} for ev, name in routes.items()):
            await d.refresh()
            await anyio.sleep(0.05)


async def stall_run(
    sc: Supercluster,
    workdir: Path,
    *,
    stall_s: float = 5.0,
    rate_per_s: float = 50.0,
    lanes: int = 4,
) -> StallOutcome:
    """A replica stalled in the agent's cluster: one worker process in `WEST` and one in
    `EAST`, both serving a ``retry_safe`` handler and a non-retry_safe guard (both
    ``failure_policy="deny"``; timeouts `HEDGED_TIMEOUT_S` and `HANDLER_TIMEOUT_S`); the
    agent's dispatcher connected to `WEST` emits to both all along; the west worker is
    SIGSTOPped for `stall_s`."""
    from _fleet import Fleet, HandlerConf
    from _procs import thread_states

    from hookbus.dispatcher import HookDispatcher

    tag = uuid.uuid4().hex[:8]
    hedged_event, guard_event = f"sc-hedged:{tag}", f"sc-guard:{tag}"
    conf = [
        HandlerConf(hedged_event, "hedged", failure_policy="deny",
                    timeout_s=HEDGED_TIMEOUT_S, retry_safe=True),
        HandlerConf(guard_event, "guard", failure_policy="deny", timeout_s=HANDLER_TIMEOUT_S),
    ]  # fmt: skip
    out = StallOutcome(Tally("hedged"), Tally("guard"))
    (workdir / WEST).mkdir(parents=True, exist_ok=True)
    (workdir / EAST).mkdir(parents=True, exist_ok=True)
    async with (
        Fleet(sc.url(WEST), workdir / WEST) as west,
        Fleet(sc.url(EAST), workdir / EAST) as east,
    ):
        victim = await west.worker(conf)
        await east.worker(conf)
        nc = await sc.connect(WEST)
        try:
            async with HookDispatcher(nc, agent_id=f"agent-{tag}") as d:
                await _wait_routes(d, {hedged_event: "hedged", guard_event: "guard"})
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    for event, tally in ((hedged_event, out.hedged), (guard_event, out.guard)):
                        tg.start_soon(
                            functools.partial(
                                emit_lanes,
                                d,
                                event,
                                tally,
                                stop,
                                lanes=lanes,
                                rate_per_s=rate_per_s,
                            )
                        )
                    await anyio.sleep(1.0)  # healthy: both replicas answer
                    victim.pause()
                    out.stall_start = time.monotonic()
                    await anyio.sleep(0.2)
                    out.stopped = all(s == "T" for s in thread_states(victim.pid))
                    await anyio.sleep(stall_s - 0.2)
                    victim.resume()
                    out.stall_end = time.monotonic()
                    await anyio.sleep(2.0)  # resumed: decisions as before
                    stop.set()
        finally:
            await nc.close()
    return out


@dataclass
class OutageOutcome:
    guard: Tally
    killed_at: float = 0.0
    restarted_at: float = 0.0
    recovered_s: float | None = None
    """From the restart of the killed cluster to the guard deciding again for good (the end
    of the last emit it did not answer); None: never."""
    fail_closed_s: float = 0.0
    """From the first emit failed closed to the end of the last one."""

    def in_outage(self) -> list[tuple[float, float, bool]]:
        """Emits started after the kill (+0.5 s) that ended before the restart."""
        return [
            e for e in self.guard.log if e[0] > self.killed_at + 0.5 and e[1] < self.restarted_at
        ]


async def outage_run(
    sc: Supercluster, workdir: Path, *, outage_s: float = 3.0, rate_per_s: float = 40.0,
    recovery_window_s: float = 12.0, lanes: int = 4,
) -> OutageOutcome:  # fmt: skip
    """The other cluster lost: a fail-closed guard (``failure_policy="deny"``) served only by
    a worker process in `EAST`, the buckets in `WEST` (provisioned there first, R3), the
    agent's dispatcher connected to `WEST` emitting all along; every `EAST` node is
    SIGKILLed, and restarted `outage_s` later."""
    from _fleet import Fleet, HandlerConf, run_cli

    from hookbus.dispatcher import HookDispatcher

    tag = uuid.uuid4().hex[:8]
    event = f"sc-outage:{tag}"
    status, _, err = await run_cli(
        sc.url(WEST), "auth", "provision", "--replicas", "3", "--placement-cluster", WEST
    )
    if status != 0:
        raise RuntimeError(f"provision failed: {err}")
    out = OutageOutcome(Tally("guard"))
    (workdir / EAST).mkdir(parents=True, exist_ok=True)
    async with Fleet(sc.url(EAST), workdir / EAST) as east:
        await east.worker(
            [HandlerConf(event, "guard", failure_policy="deny", timeout_s=HANDLER_TIMEOUT_S)]
        )
        nc = await sc.connect(WEST)
        try:
            async with HookDispatcher(nc, agent_id=f"agent-{tag}") as d:
                await _wait_routes(d, {event: "guard"})
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        functools.partial(
                            emit_lanes,
                            d,
                            event,
                            out.guard,
                            stop,
                            lanes=lanes,
                            rate_per_s=rate_per_s,
                        )
                    )
                    await anyio.sleep(1.0)
                    for n in sc.cluster_nodes(EAST):
                        n.kill()
                    out.killed_at = time.monotonic()
                    await anyio.sleep(outage_s)
                    for n in sc.cluster_nodes(EAST):
                        n.start()
                    out.restarted_at = time.monotonic()
                    await anyio.sleep(recovery_window_s)
                    stop.set()
        finally:
            await nc.close()
    log = out.guard.log
    failed = [e for e in log if not e[2]]
    if failed:
        out.fail_closed_s = max(e[1] for e in failed) - min(e[1] for e in failed)
    last_bad = max((e[1] for e in failed if e[1] > out.restarted_at), default=out.restarted_at)
    tail = [e for e in log if e[1] > last_bad]
    if len(tail) >= 20 and all(e[2] for e in tail):
        out.recovered_s = last_bad - out.restarted_at
    return out
