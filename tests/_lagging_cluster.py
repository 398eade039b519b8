"""A 3-node cluster whose third node, ``n3``, can be made to lag: every route connection
of ``n3`` passes through a TCP forwarder that can hold its bytes back for a while, in
order, both ways. No fault: ``n3`` stays a member of every group, only late, as a replica
on a slow link (or a busy machine) is.

    cluster = LaggingCluster(tmp_path / "c").start()
    await cluster.wait_ready()
    cluster.lag_s = 3.0      # from now on n3 hears everything 3 s late, and answers so

A write acknowledged by the other two is then on ``n3`` only 3 s later, and whatever
``n3`` answers by itself meanwhile (a direct get from a client connected to it: any
replica answers, its own server's first) is as old as that.

The routes: ``n3`` solicits ``n1`` and ``n2`` through a forwarder each, advertises a
forwarder to its own cluster port, and ``n1`` / ``n2`` route to each other directly and to
``n3`` through that forwarder. ``n1`` and ``n2`` advertise a port nobody listens on, so a
route opened from gossip before the configured ones are up fails rather than bypassing the
forwarders; `wait_ready` checks that every route ``n3`` has goes through one.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import anyio
from _cluster import Cluster, Node, free_ports, wait_for

__all__ = ["LaggingCluster"]


class _Forwarder:
    """A TCP forwarder from a free local port to `target`, holding every chunk back by its
    owner's `lag_s` (read when the chunk arrives), in order."""

    def __init__(self, owner: LaggingCluster, target: int) -> None:
        self._owner = owner
        self.target = target
        self.port = free_ports(1)[0]
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self.local_ports: set[int] = set()
        """Local ports of the forwarder's own connections to `target` (what the target's
        ``/routez`` shows as the remote end of a route that came through here)."""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        try:
            sreader, swriter = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            cwriter.close()
            return
        self.local_ports.add(swriter.get_extra_info("sockname")[1])
        self._writers += [cwriter, swriter]
        for reader, writer in ((creader, swriter), (sreader, cwriter)):
            task = asyncio.create_task(self._pump(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if not chunk:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(chunk)
                await writer.drain()

        sending = asyncio.create_task(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((loop.time() + self._owner.lag_s, chunk))
            queue.put_nowait((0.0, b""))
            await sending
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sending.cancel()
            with contextlib.suppress(Exception):
                writer.close()


class _LaggingNode(Node):
    advertise_port: int | None = None

    def config_text(self, cluster: str) -> str:
        text = super().config_text(cluster)
        if self.advertise_port is None:
            return text
        return text.replace(
            f"listen: 127.0.0.1:{self.cluster_port}",
            f"listen: 127.0.0.1:{self.cluster_port}\n  advertise: 127.0.0.1:{self.advertise_port}",
        )


class LaggingCluster(Cluster):
    """`Cluster` of three whose node ``n3`` lags by `lag_s` seconds (0 at first).

    Start it inside a running event loop: the forwarders are asyncio servers of that loop
    (`start` schedules them; `wait_ready` waits for them and for the cluster)."""

    def __init__(self, base: Path | None = None) -> None:
        super().__init__(base, size=3)
        self.nodes = [_LaggingNode(**{f: getattr(n, f) for f in _NODE_FIELDS}) for n in self.nodes]
        n1, n2, n3 = self.nodes
        self.lag_s = 0.0
        self._to_n1 = _Forwarder(self, n1.cluster_port)
        self._to_n2 = _Forwarder(self, n2.cluster_port)
        self._to_n3 = _Forwarder(self, n3.cluster_port)
        self._forwarders = [self._to_n1, self._to_n2, self._to_n3]
        n1.routes = [n2.cluster_port, self._to_n3.port]
        n2.routes = [n1.cluster_port, self._to_n3.port]
        n3.routes = [self._to_n1.port, self._to_n2.port]
        n3.advertise_port = self._to_n3.port
        # n1 and n2 advertise a port nobody listens on: a route opened from gossip (before
        # the configured one is up) fails instead of bypassing the forwarders
        n1.advertise_port, n2.advertise_port = free_ports(2)

    @property
    def lagging(self) -> Node:
        return self.nodes[2]

    def start(self) -> LaggingCluster:
        loop = asyncio.get_running_loop()
        self._starting = [loop.create_task(f.start()) for f in self._forwarders]
        return self

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Start the forwarders and the nodes; wait until the cluster is ready and every
        route of ``n3`` goes through a forwarder.

        Raises:
            AssertionError: a route of ``n3`` bypasses the forwarders.
        """
        await asyncio.gather(*self._starting)
        super().start()
        await super().wait_ready(timeout_s)
        routes = await wait_for(self._n3_routes, timeout_s)
        through = {f.port for f in self._forwarders[:2]} | self._to_n3.local_ports
        direct = [r for r in routes if r.get("port") not in through]
        assert not direct, f"routes of n3 that bypass the forwarders: {direct}"

    async def _n3_routes(self) -> list[dict[str, Any]]:
        routez = await anyio.to_thread.run_sync(self.lagging.http_json, "/routez")
        routes = list(routez.get("routes") or [])
        names = {r.get("remote_name") for r in routes}
        return routes if {"n1", "n2"} <= names else []

    async def close(self) -> None:
        """Stop the nodes and the forwarders."""
        self.stop()
        for f in self._forwarders:
            await f.close()


_NODE_FIELDS = ("name", "port", "cluster_port", "http_port", "base", "routes")
