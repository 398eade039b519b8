"""A lost leaf link never gives a wrong decision.

A hub nats-server (JetStream, domain ``hub``) and a leaf without JetStream on 127.0.0.1; the
leaf reaches the hub's leafnode port through a TCP relay this test owns (the hub does not
advertise its own leafnode URL, so the leaf cannot go around it), so the link alone can be
cut (every link connection closed, the port refusing) and restored, both servers running.
A worker at the hub serves a fail-closed guard (``failure_policy="deny"``: deny ``rm -rf``,
else continue); an agent at the leaf (``js_domain="hub"``) emits all along,
alternating ``rm -rf /`` and ``ls``.

While the link is down the guard cannot be reached: each call must be denied with the
guard's failure recorded (fail closed), or raise a hookbus error, within its bound; never
``continue`` for ``rm -rf /``, never a ``deny`` of ``ls`` without that failure. After the
link is back, both commands are decided by the guard itself again within seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _fleet import check_decision
from _sites import SitePorts, hub_and_leaf, wait_linked
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError, HookResult
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

EVENT = "tool:pre"
GUARD = "site_guard"
HANDLER_TIMEOUT_S = 1.0
EMIT_BOUND_S = 4.0
"""An emit must return or raise within this (the guard's timeout, a retry and slack)."""
CUT_S = 3.0
RECOVERY_BOUND_S = 10.0
"""After the link is restored, both commands decided by the guard within this."""


class Relay:
    """A TCP relay on 127.0.0.1:`port` to `upstream_port`; `cut` closes every connection
    through it and stops listening, `restore` listens again on the same port."""

    def __init__(self, port: int, upstream_port: int) -> None:
        self.port, self.upstream_port = port, upstream_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0

    async def restore(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


async def relayed(ports: SitePorts) -> tuple[Relay, NATS, NATS, HookWorker]:
    """The leaf linked to the hub through a `Relay` on the leaf's remote port: the relay, a
    connection at the hub, one at the leaf (reconnecting without end), and a worker at the
    hub (JetStream domain ``hub``; not started)."""
    relay = Relay(ports.remote, ports.link)
    await relay.restore()
    await anyio.to_thread.run_sync(wait_linked, ports.leaf_log)
    hub_nc = await nats.connect(ports.hub_url)
    leaf_nc = await nats.connect(ports.leaf_url, max_reconnect_attempts=-1)
    return relay, hub_nc, leaf_nc, HookWorker(hub_nc, js_domain="hub")


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[SitePorts]:
    """A hub and a leaf whose remote is a relay port: nothing listens there until the test
    starts its relay."""
    with hub_and_leaf(tmp_path, relay=True) as ports:
        yield ports


async def test_a_lost_leaf_link_never_gives_a_wrong_decision(
    servers: SitePorts,
) -> None:
    relay, hub_nc, leaf_nc, worker = await relayed(servers)

    @worker.handler(EVENT, name=GUARD, failure_policy="deny", timeout_s=HANDLER_TIMEOUT_S)
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
            return HookResult(action="deny", reason="rm -rf is not allowed")
        return HookResult(action="continue")

    wrong: list[str] = []
    undecided: list[str] = []
    errors: list[str] = []
    failed_closed = 0
    decided = 0
    slowest = 0.0
    log: list[tuple[float, bool]] = []
    """(monotonic end, decided by the guard itself) of every emit."""

    async def one(d: HookDispatcher, i: int) -> None:
        nonlocal failed_closed, decided, slowest
        destructive = i % 2 == 0
        data = {"tool_name": "bash", "tool_input": {"command": "rm -rf /" if destructive else "ls"}}
        started = time.monotonic()
        try:
            with anyio.fail_after(EMIT_BOUND_S):
                result = await d.emit(EVENT, data)
        except TimeoutError:
            undecided.append(f"emit {i}: no answer within {EMIT_BOUND_S}s")
            return
        except HookbusError as exc:
            errors.append(f"emit {i}: {type(exc).__name__}: {exc}")
            log.append((time.monotonic(), False))
            return
        slowest = max(slowest, time.monotonic() - started)
        decided += 1
        why = check_decision(result, destructive, GUARD)
        if why:
            wrong.append(f"emit {i}: {why}")
        guard_failed = any(f.handler == GUARD for f in result.failures)
        if not destructive and result.action == "deny":
            failed_closed += 1
        log.append((time.monotonic(), not guard_failed))

    async with worker, HookDispatcher(leaf_nc, agent_id="site-agent", js_domain="hub") as d:
        for i in range(4):  # linked: the guard decides
            await one(d, i)
        assert not wrong and not errors and failed_closed == 0, (wrong, errors)

        stop = anyio.Event()
        count = 0

        async def emitter() -> None:
            nonlocal count
            while not stop.is_set():
                await one(d, count)
                count += 1
                await anyio.sleep(0.02)

        async with anyio.create_task_group() as tg:
            tg.start_soon(emitter)
            await anyio.sleep(1.0)
            await relay.cut()
            cut_at = time.monotonic()
            await anyio.sleep(CUT_S)
            connections = relay.connections
            await relay.restore()
            restored_at = time.monotonic()
            await anyio.sleep(RECOVERY_BOUND_S)
            stop.set()

    await leaf_nc.close()
    await hub_nc.close()
    await relay.cut()

    during = [ok for end, ok in log if cut_at + 0.5 < end < restored_at]
    # from the restore on: the last emit that the guard did not decide
    last_bad = max((end for end, ok in log if end > restored_at and not ok), default=restored_at)
    recovery_s = last_bad - restored_at
    print(
        f"\nemits {count} (decided {decided}, hookbus errors {len(errors)}), wrong {len(wrong)},"
        f" undecided {len(undecided)}, failed closed {failed_closed},"
        f" slowest {slowest:.2f}s, recovery {recovery_s:.2f}s after the link was restored;"
        f" while cut: {len(during)} emits, {sum(during)} decided by the guard"
    )
    assert not wrong, wrong[:5]
    assert not undecided, undecided[:5]
    assert during and not any(during), "the link cut was not felt: the guard still answered"
    assert relay.connections > connections, "the leaf did not link again"
    assert recovery_s < RECOVERY_BOUND_S - 2, f"still failing {recovery_s:.1f}s after restore"
    tail = [ok for end, ok in log if end > last_bad]
    assert len(tail) >= 20 and all(tail)
