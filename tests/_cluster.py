"""A 3-node JetStream cluster on 127.0.0.1 for fault tests and the fault benchmark.

Every node is a real ``nats-server`` process (the binary `hookbus.cli.find_nats_server`
finds: the one in the venv), with its own config file, JetStream store folder and log file
under one base folder. Ports (client, route, monitoring) are picked free once and kept, so
a node restarted after a kill comes back on the same URL with its store.

What the fault tests need from it:

- `Cluster.start` / `Cluster.stop` (also a sync context manager);
- `Node.kill` (SIGKILL), `Node.stop` (SIGTERM), `Node.restart`;
- `Cluster.meta_leader` (the JetStream meta leader, from the ``/jsz`` monitoring endpoint)
  and `Cluster.stream_leader` (a stream's leader, from ``$JS.API.STREAM.INFO.<stream>``);
- `Cluster.wait_ready` / `Node.wait_healthy`: poll ``/healthz`` until every running node
  reports JetStream current (a readiness poll, not a sleep).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import nats
from _ports import free_ports
from nats.aio.client import Client as NATS

from hookbus._core.nats_guard import order_flushes
from hookbus.cli import find_nats_server

__all__ = ["Cluster", "Node", "Servers", "free_ports", "wait_for"]

CLUSTER_NAME = "hookbus-faults"


@dataclass
class Node:
    """One nats-server of the cluster."""

    name: str
    port: int
    cluster_port: int
    http_port: int
    base: Path
    routes: list[int] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.base / f"{self.name}.log"

    @property
    def config_file(self) -> Path:
        return self.base / f"{self.name}.conf"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    max_file_store = "1GB"
    """JetStream's file storage limit of the node (a limit, not an allocation)."""

    @property
    def serving(self) -> bool:
        """Whether the node runs and answers (a paused one does not)."""
        return self.running

    def config_text(self, cluster: str) -> str:
        """The node's config: its ports, JetStream, and cluster `cluster` over its routes."""
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in self.routes)
        store = self.base / self.name / "jetstream"
        return f"""
server_name: {self.name}
listen: 127.0.0.1:{self.port}
http: 127.0.0.1:{self.http_port}

jetstream {{
  store_dir: "{store}"
  max_memory_store: 256MB
  max_file_store: {self.max_file_store}
}}

cluster {{
  name: {cluster}
  listen: 127.0.0.1:{self.cluster_port}
  routes: [ {routes} ]
}}
"""

    def write_config(self) -> None:
        self.config_file.write_text(self.config_text(CLUSTER_NAME))

    def start(self) -> None:
        """Start the process (returns at once; see `wait_healthy`)."""
        if self.running:
            return
        self.write_config()
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(self.config_file), "-l", str(self.log_file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def kill(self) -> None:
        """SIGKILL the node (its store is kept for `restart`)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM the node and wait for it (SIGKILL after 10 s)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def http_json(self, path: str, timeout_s: float = 2.0) -> Any:
        """GET a monitoring endpoint (``/jsz``, ``/healthz``, ...) as JSON.

        Raises:
            OSError: the node does not answer.
        """
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # /healthz answers 503 with a JSON body
            return json.loads(exc.read() or b"{}")

    def healthy(self) -> bool:
        """Whether the node answers ``/healthz`` with ``ok`` (JetStream current)."""
        if not self.running:
            return False
        try:
            return bool(self.http_json("/healthz").get("status") == "ok")
        except (OSError, ValueError):
            return False

    async def wait_healthy(self, timeout_s: float = 20.0) -> None:
        """Poll ``/healthz`` until the node is healthy.

        Raises:
            TimeoutError: not healthy within `timeout_s` (the log file names why).
        """
        with anyio.fail_after(timeout_s):
            while not await anyio.to_thread.run_sync(self.healthy):
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.log_file}")
                await anyio.sleep(0.1)  # readiness poll interval


N = TypeVar("N", bound=Node)


class Servers(Generic[N]):
    """What a cluster and a supercluster share: their nodes (`nodes`, by name with `node`),
    started and stopped together (also a sync context manager), the JetStream meta leader,
    and clients connected to some of them."""

    nodes: list[N]

    def __init__(self, base: Path | None, *, prefix: str) -> None:
        self._own = base is None
        """Whether `base` is a temporary folder of this object's own (removed on `stop`)."""
        self.base = base or Path(tempfile.mkdtemp(prefix=prefix))
        self.base.mkdir(parents=True, exist_ok=True)

    def node(self, name: str) -> N:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    def start(self) -> Self:
        for n in self.nodes:
            n.start()
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        if self._own:
            shutil.rmtree(self.base, ignore_errors=True)

    async def meta_leader(self) -> str | None:
        """Name of the JetStream meta leader as a serving node reports it, or None."""
        for n in self.nodes:
            if not n.serving:
                continue
            try:
                jsz = await anyio.to_thread.run_sync(n.http_json, "/jsz")
            except (OSError, ValueError):
                continue
            leader = (jsz.get("meta_cluster") or {}).get("leader")
            if leader and self.node(leader).running:
                return str(leader)
        return None

    async def _connect(self, servers: list[str], **kwargs: Any) -> NATS:
        """A client connected to `servers`, reconnecting forever within them (so it rides
        through node kills); `kwargs`: more ``nats.connect`` options."""
        options: dict[str, Any] = {
            "servers": servers,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.2,
            "connect_timeout": 2,
        }
        options.update(kwargs)
        conn = await nats.connect(**options)
        order_flushes(conn)  # a test's own "flush, then it is on the server" holds
        return conn

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Cluster(Servers[Node]):
    """Three (or `size`) clustered nats-servers with JetStream, on free loopback ports.

    Args:
        base: folder for configs, stores and logs; a temporary one (removed on `stop`)
            when None.
        size: number of nodes (3: JetStream R3 survives the loss of one).
    """

    def __init__(self, base: Path | None = None, *, size: int = 3) -> None:
        super().__init__(base, prefix="hookbus-cluster-")
        ports = free_ports(3 * size)
        cluster_ports = ports[size : 2 * size]
        self.nodes = [
            Node(
                name=f"n{i + 1}",
                port=ports[i],
                cluster_port=cluster_ports[i],
                http_port=ports[2 * size + i],
                base=self.base,
                routes=[p for j, p in enumerate(cluster_ports) if j != i],
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Comma-separated client URLs of every node (what ``--url`` takes)."""
        return ",".join(n.url for n in self.nodes)

    @property
    def servers(self) -> list[str]:
        """Client URLs of every node (what ``nats.connect(servers=...)`` takes)."""
        return [n.url for n in self.nodes]

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node is healthy and a meta leader is elected."""
        with anyio.fail_after(timeout_s):
            for n in self.nodes:
                if n.running:
                    await n.wait_healthy(timeout_s)
        await wait_for(self.meta_leader, timeout_s)

    async def stream_leader(self, nc: NATS, stream: str, timeout_s: float = 10.0) -> str:
        """Name of `stream`'s leader (``$JS.API.STREAM.INFO.<stream>``), retried through
        an election until `timeout_s`.

        Raises:
            TimeoutError: no leader reported in time.
        """
        js = nc.jetstream(timeout=2)
        with anyio.fail_after(timeout_s):
            while True:
                with contextlib.suppress(Exception):
                    info = await js.stream_info(stream)
                    leader = info.cluster.leader if info.cluster else None
                    if leader and self.node(leader).running:
                        return str(leader)
                await anyio.sleep(0.1)

    async def connect(self, **kwargs: Any) -> NATS:
        """A client connected to the cluster (every node in its server list; reconnects
        forever, so it rides through node kills)."""
        return await self._connect(kwargs.pop("servers", self.servers), **kwargs)


async def wait_for(predicate: Any, timeout_s: float = 20.0, interval_s: float = 0.1) -> Any:
    """Poll an async `predicate()` until it returns a truthy value; return it.

    Raises:
        TimeoutError: still falsy after `timeout_s`.
    """
    with anyio.fail_after(timeout_s):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(interval_s)
