"""An asyncio TCP proxy between NATS clients and a nats-server that can lose or delay
server-to-client messages: the fault a JetStream publish ack lost in flight (a stream
leader moving, a connection cut after the write) looks like to the client.

Both directions are parsed as the NATS protocol (``MSG`` / ``HMSG`` / ``PUB`` / ``HPUB``
frames with their payloads, every other op a line). Server-to-client, one delivered message
can be dropped whole without breaking the stream:

    proxy = NatsProxy(server_url)
    await proxy.start()
    nc = await nats.connect(proxy.url)
    proxy.drop_next(1, lambda m: m.is_pub_ack("KV_hookbus_suspensions"))
    ...   # the next ack of a write to that bucket never reaches the client

A dropped ack means the server stored the write and the client does not know: its
publish times out.

Client-to-server, every op line is recorded in order (`client_ops`), and an op can be held
back (`hold_next_client_op`): it and everything the client sends after it reach the server
late, in order, as when the server is slow to read one connection.

`latency_s` delays every frame, both ways, by that many seconds, in order and without
holding back the frames behind it: a link between sites (a one-way delay), no fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

__all__ = ["Delivered", "NatsProxy"]


@dataclass(frozen=True)
class Delivered:
    """A message the server delivers to a client (one ``MSG`` or ``HMSG`` frame)."""

    subject: str
    reply: str | None
    headers: bytes
    payload: bytes

    def is_pub_ack(self, stream: str | None = None) -> bool:
        """Whether this is a JetStream publish ack (of `stream`, if given)."""
        if not self.payload.startswith(b"{") or b'"seq"' not in self.payload:
            return False
        try:
            body = json.loads(self.payload)
        except ValueError:
            return False
        if not isinstance(body, dict) or "seq" not in body or "stream" not in body:
            return False
        return stream is None or body.get("stream") == stream


@dataclass
class _Rule:
    count: int
    match: Callable[[Delivered], bool]
    delay_s: float = 0.0
    """0: drop the message; else deliver it this many seconds late (in order)."""


@dataclass
class NatsProxy:
    """A TCP proxy on 127.0.0.1 (free port) in front of `upstream` (``nats://host:port``)."""

    upstream: str
    port: int = 0
    dropped: list[Delivered] = field(default_factory=list)
    delayed: list[Delivered] = field(default_factory=list)
    client_ops: list[bytes] = field(default_factory=list)
    """Every op line clients sent through the proxy, in order (without payloads)."""
    _rules: list[_Rule] = field(default_factory=list)
    _holds: list[tuple[bytes, float]] = field(default_factory=list)
    _server: asyncio.base_events.Server | None = None
    _conns: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)
    latency_s: float = 0.0
    """One-way delay added to every frame in both directions, seconds."""

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> NatsProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(BaseException):
                await t
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def __aenter__(self) -> NatsProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def drop_next(self, count: int, match: Callable[[Delivered], bool]) -> None:
        """Drop the next `count` server-to-client messages that `match`."""
        self._rules.append(_Rule(count, match))

    def delay_next(self, count: int, match: Callable[[Delivered], bool], delay_s: float) -> None:
        """Deliver the next `count` matching messages `delay_s` seconds late."""
        self._rules.append(_Rule(count, match, delay_s))

    def hold_next_client_op(self, prefix: bytes, delay_s: float) -> None:
        """Forward the next client op starting with `prefix` (e.g. ``b"SUB "``), and all that
        follows it on that connection, `delay_s` seconds late."""
        self._holds.append((prefix, delay_s))

    def cut(self) -> None:
        """Close every connection through the proxy (the clients see their server lost
        and reconnect through it: new connections are still accepted)."""
        for w in list(self._writers):
            w.close()

    def clear(self) -> None:
        self._rules.clear()
        self._holds.clear()

    # -- plumbing ----------------------------------------------------------------------
    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        up = urlparse(self.upstream)
        try:
            sreader, swriter = await asyncio.open_connection(up.hostname, up.port)
        except OSError:
            cwriter.close()
            self._conns.discard(task)
            return
        self._writers.update((cwriter, swriter))
        to_client, to_server = _Late(cwriter, self), _Late(swriter, self)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._client_to_server(creader, to_server))  # type: ignore[arg-type]
                tg.create_task(self._server_to_client(sreader, to_client))  # type: ignore[arg-type]
        except BaseException:
            pass
        finally:
            to_client.stop()
            to_server.stop()
            for w in (cwriter, swriter):
                w.close()
                self._writers.discard(w)
            self._conns.discard(task)

    async def _client_to_server(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            line = await reader.readuntil(b"\r\n")
            self.client_ops.append(line)
            op = line[:5].upper()
            frame = line
            if op.startswith(b"PUB ") or op.startswith(b"HPUB "):
                frame += await reader.readexactly(int(line.split()[-1]) + 2)
            for hold in self._holds:
                if line.startswith(hold[0]):
                    self._holds.remove(hold)
                    await asyncio.sleep(hold[1])  # the fault itself: a late read
                    break
            writer.write(frame)
            await writer.drain()

    def _verdict(self, msg: Delivered) -> _Rule | None:
        for rule in self._rules:
            if rule.count > 0 and rule.match(msg):
                rule.count -= 1
                if rule.count == 0:
                    self._rules.remove(rule)
                return rule
        return None

    async def _server_to_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            line = await reader.readuntil(b"\r\n")
            op = line[:5].upper()
            if not (op.startswith(b"MSG ") or op.startswith(b"HMSG ")):
                writer.write(line)
                await writer.drain()
                continue
            parts = line.decode().split()
            if parts[0].upper() == "MSG":
                subject, reply = parts[1], (parts[3] if len(parts) == 5 else None)
                hdr_size, total = 0, int(parts[-1])
            else:
                subject, reply = parts[1], (parts[3] if len(parts) == 6 else None)
                hdr_size, total = int(parts[-2]), int(parts[-1])
            body = await reader.readexactly(total + 2)
            msg = Delivered(subject, reply, body[:hdr_size], body[hdr_size:total])
            rule = self._verdict(msg)
            if rule is None:
                writer.write(line + body)
                await writer.drain()
            elif rule.delay_s <= 0:
                self.dropped.append(msg)
            else:
                self.delayed.append(msg)
                await asyncio.sleep(rule.delay_s)  # the fault itself: late delivery
                writer.write(line + body)
                await writer.drain()


class _Late:
    """A stream writer whose writes reach the peer `proxy.latency_s` seconds after they are
    made, in order (written at once while the latency is 0)."""

    def __init__(self, writer: asyncio.StreamWriter, proxy: NatsProxy) -> None:
        self._writer = writer
        self._proxy = proxy
        self._queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._pump = asyncio.ensure_future(self._run())

    def write(self, data: bytes) -> None:
        self._queue.put_nowait((self._loop.time() + self._proxy.latency_s, data))

    async def drain(self) -> None:
        return None

    def stop(self) -> None:
        self._pump.cancel()

    async def _run(self) -> None:
        while True:
            at, data = await self._queue.get()
            wait = at - self._loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._writer.write(data)
            await self._writer.drain()
