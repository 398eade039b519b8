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
  every node of both sides doing so, each cluster is linked to the other both ways), and a JetStream meta leader (``/jsz``);
- `Supercluster.servers(cluster)` / `Supercluster.url(cluster)`: a cluster's client URLs;
- `SuperNode.kill` (SIGKILL), `SuperNode.pause` / `SuperNode.resume` (SIGSTOP / SIGCONT),
  `SuperNode.restart`;
- `Supercluster.connect(cluster)`: a client reconnecting forever within that cluster.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import nats
from _cluster import Node, free_ports, wait_for
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import order_flushes

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

    def write_config(self) -> None:
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.routes)
        gateways = "\n".join(
            f"    {{ name: {name}, urls: [ "
            + ", ".join(f'"nats://127.0.0.1:{p}"' for p in ports)
            + " ] }"
            for name, ports in self.gateways.items()
        )
        store = self.base / self.name / "jetstream"
        # what provisioning reserves (every bucket's max_bytes, the audit stream's): several
        # GiB; a limit, not an allocation (see tests/test_placement.py)
        self.config_file.write_text(
            f"""
server_name: {self.name}
listen: 127.0.0.1:{self.port}
http: 127.0.0.1:{self.http_port}

jetstream {{
  store_dir: "{store}"
  max_memory_store: 256MB
  max_file_store: 64GB
}}

cluster {{
  name: {self.cluster}
  listen: 127.0.0.1:{self.cluster_port}
  routes: [ {routes} ]
}}

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


class Supercluster:
    """Two clusters of `size` nats-servers each (`EAST`, `WEST`), gateways joining them,
    JetStream on every node, on free loopback ports (kept across restarts).

    Args:
        base: folder for configs, stores and logs; a temporary one (removed on `stop`)
            when None.
        size: nodes per cluster.
    """

    def __init__(self, base: Path | None = None, *, size: int = 3) -> None:
        self._own = base is None
        self.base = base or Path(tempfile.mkdtemp(prefix="hookbus-supercluster-"))
        self.base.mkdir(parents=True, exist_ok=True)
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

    def node(self, name: str) -> SuperNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def start(self) -> Supercluster:
        shutil.copy(DEPLOY / "common.conf", self.base / "common.conf")
        for n in self.nodes:
            n.start()
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.resume()
        for n in self.nodes:
            n.stop()
        if self._own:
            shutil.rmtree(self.base, ignore_errors=True)

    def gateways_connected(self) -> bool:
        """Every running node has its outbound gateway to every other cluster with a running
        node (both sides' nodes do: the clusters are linked both ways)."""
        live = {n.cluster for n in self.nodes if n.running and not n.paused}
        for n in self.nodes:
            if n.running and not n.paused and not n.gateways_up(live - {n.cluster}):
                return False
        return True

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Every running node healthy, gateways connected both ways, a meta leader.

        Raises:
            TimeoutError: not ready within `timeout_s` (the nodes' logs say why).
        """
        with anyio.fail_after(timeout_s):
            for n in self.nodes:
                if n.running and not n.paused:
                    await n.wait_healthy(timeout_s)

            async def gateways() -> bool:
                return await anyio.to_thread.run_sync(self.gateways_connected)

            await wait_for(gateways, timeout_s)
            await wait_for(self.meta_leader, timeout_s)

    async def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as a running node reports it, or None."""
        for n in self.nodes:
            if not n.running or n.paused:
                continue
            try:
                jsz = await anyio.to_thread.run_sync(n.http_json, "/jsz")
            except (OSError, ValueError):
                continue
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader and self.node(leader).running:
                return str(leader)
        return None

    async def connect(self, cluster: str | None = None, **kwargs: Any) -> NATS:
        """A client connected to `cluster`'s nodes (every node when None), reconnecting
        forever within them."""
        options: dict[str, Any] = {
            "servers": self.servers(cluster),
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.2,
            "connect_timeout": 2,
        }
        options.update(kwargs)
        conn = await nats.connect(**options)
        order_flushes(conn)
        return conn

    def __enter__(self) -> Supercluster:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def stream_cluster(nc: NATS, stream: str) -> str | None:
    """The cluster holding `stream` (``$JS.API.STREAM.INFO.<stream>``), or None."""
    with contextlib.suppress(Exception):
        info = await nc.jetstream(timeout=5).stream_info(stream)
        return info.cluster.name if info.cluster else None
    return None
