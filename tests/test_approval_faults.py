"""Approvals under faults and races: answers that land at the deadline, grant reads during
an outage.

- An answer that wins the compare-and-set is applied whatever the clock says: many calls
  are answered right when their timeout fires (on the first write after the pending one,
  or at the deadline give or take a few ms); every call's decision must match its record's
  final state (resolved -> the answer, cancelled -> the default), and the next identical
  call is asked anew, never decided by the stale answer.
- A grant read inside an emit retries through an outage of the nats-server within the
  approval's own timeout: a stored "Allow always" still allows once the server is back.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import nats
import pytest
from _emitted import in_background
from conftest import Connect, reconnecting
from nats.aio.client import Client as NATS
from test_approvals import Approver, asker, spawn_emit

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import (
    APPROVALS_BUCKET,
    AlreadySettledError,
    HookResult,
    suspension_key,
)

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

TIMEOUT_S = 0.4
"""Each racing approval's own timeout."""


async def answer_at_the_deadline(
    approver: Approver, nc: NATS, label: str, *, on_write: bool, offset_s: float
) -> None:
    """Answer "Allow" right when the approval's timeout fires: on the first write to its
    record after the pending one (`on_write`: the waiter giving up), else at its deadline
    plus `offset_s` seconds. Losing to the timeout (`AlreadySettledError`) is fine."""
    got = await approver.client.get_approval(label)
    assert got is not None
    record, revision = got
    if on_write:
        kv = await nc.jetstream().key_value(APPROVALS_BUCKET)
        watcher = await kv.watch(suspension_key(label))
        try:
            with anyio.fail_after(TIMEOUT_S + 10):
                while True:
                    entry = await watcher.updates(timeout=TIMEOUT_S + 10)
                    if entry is not None and (entry.revision or 0) > revision:
                        break
        finally:
            await watcher.stop()
    else:
        await anyio.sleep(max(0.0, record.created_at + TIMEOUT_S + offset_s - time.time()))
    try:
        await approver.client.answer_approval(label, "Allow", approver="tester", agent_id=None)
    except AlreadySettledError:
        pass


async def test_an_answer_at_the_deadline_decides_exactly_as_the_record_says(
    connect: Connect, approver: Approver, event: str
) -> None:
    nc = await connect()
    d = HookDispatcher(nc)
    d.register(event, asker(approval_timeout=TIMEOUT_S, approval_default="deny"))
    base = f"race-{uuid.uuid4().hex[:8]}"
    outcomes = {"resolved": 0, "cancelled": 0}
    async with d:
        for i in range(24):
            session = f"{base}-{i}"
            call = {"tool_name": "bash", "session_id": session, "command": f"deploy {i}"}
            async with anyio.create_task_group() as tg:
                out = spawn_emit(tg, d, event, dict(call))
                part = await approver.pending(session)
                await answer_at_the_deadline(
                    approver, approver.nc, part.label,
                    on_write=i % 2 == 0, offset_s=((i // 2) % 6 - 3) * 0.005,
                )  # fmt: skip
                r = await out.wait()
            got = await approver.client.get_approval(part.label)
            assert got is not None
            final = got[0]
            assert final.status in ("resolved", "cancelled")
            outcomes[final.status] += 1
            if final.status == "resolved":
                assert (r.action, r.reason) == ("continue", "tester chose 'Allow'"), i
            else:
                assert r.action == "deny", i
                assert r.reason is not None and "timed out" in r.reason, i

            # the same call content again is a new call: asked anew, never the stale answer
            async with anyio.create_task_group() as tg:
                again = spawn_emit(tg, d, event, dict(call))
                fresh = await approver.pending(session)
                assert fresh.label != part.label
                await approver.client.answer_approval(
                    fresh.label, "Deny", approver="tester", agent_id=fresh.agent_id
                )
                r2 = await again.wait()
            assert (r2.action, r2.reason) == ("deny", "tester chose 'Deny'"), i
    print(f"answers at the deadline: {outcomes}")


async def test_a_grant_read_retries_through_a_server_outage(
    embedded_server: EmbeddedNatsServer, event: str
) -> None:
    port = int(embedded_server.url.rpartition(":")[2])

    nc = await reconnecting(embedded_server.url)
    restarted: EmbeddedNatsServer | None = None
    session = f"outage-{uuid.uuid4().hex[:8]}"
    asked = anyio.Event()
    ask = asker(approval_options=["Allow always", "Deny"], approval_timeout=30.0)

    async def guard(ev: str, data: dict[str, Any]) -> Any:
        asked.set()
        return await ask(ev, data)

    try:
        d = HookDispatcher(nc)
        d.register(event, guard, name="guard")
        d.set_default_fields(session_id=session, agent_id="a1")
        async with d:
            # a human answers "Allow always" (the grant is stored), then the server goes
            nc2 = await nats.connect(embedded_server.url)
            try:
                async with ApprovalsClient(nc2) as other:
                    approver = await Approver(other, nc2).open()
                    async with anyio.create_task_group() as tg:
                        out = spawn_emit(tg, d, event, {"tool_name": "bash"})
                        part = await approver.pending(session)
                        await other.answer_approval(
                            part.label, "Allow always", approver="tester", agent_id=part.agent_id
                        )
                        assert (await out.wait()).action == "continue"
                    await approver.close()
            finally:
                await nc2.close()

            asked = anyio.Event()
            embedded_server.kill()  # keeps its data folder
            async with anyio.create_task_group() as tg:
                out = spawn_emit(tg, d, event, {"tool_name": "bash"})
                with anyio.fail_after(10):
                    await asked.wait()  # the emit now reads the grant, with no server
                await anyio.sleep(1.0)  # the outage itself
                restarted = EmbeddedNatsServer(embedded_server.data_dir, port=port)
                restarted.start()
                r = await out.wait(timeout_s=30)
        assert r.action == "continue", r.reason
        assert r.reason is not None and "allowed always" in r.reason
    finally:
        await nc.close()
        if restarted is not None:
            restarted.stop()


@contextlib.asynccontextmanager
async def outliving(server: EmbeddedNatsServer) -> AsyncIterator[tuple[HookDispatcher, str]]:
    """A dispatcher (not started) on a connection to `server` that keeps reconnecting (it
    outlives the server), and a fresh event name; both closed on exit."""
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    d = HookDispatcher(nc)
    try:
        yield d, f"test:{uuid.uuid4().hex[:8]}"
    finally:
        await d.close()
        with contextlib.suppress(Exception):
            await nc.close()


@pytest.mark.parametrize("default", ["deny", "allow"])
async def test_an_unreachable_approval_store_denies_within_the_deadline(
    embedded_server: EmbeddedNatsServer, default: str
) -> None:
    """JetStream gone while a handler asks: whether anybody answered is unknown, so the
    emit is denied within its deadline whatever the approval's default, with the failure on
    the result (never a raw error, never a hang, never an allow)."""
    async with outliving(embedded_server) as (d, event):

        @d.register(event)
        async def gate(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="ask_user", approval_prompt="go?", approval_default=default)

        await d.start()
        embedded_server.stop()
        started = time.monotonic()
        result = await d.emit(event, {"session_id": "s", "tool_name": "bash"}, timeout_s=2.0)
        elapsed = time.monotonic() - started
    assert result.action == "deny", result
    assert result.reason == "approval unavailable: the suspension store could not be reached"
    assert [(f.handler, f.kind, f.policy) for f in result.failures] == [("gate", "error", "deny")]
    assert elapsed < 10, elapsed  # bounded by the emit's deadline, not the store's 15 s retries


async def test_an_approval_that_cannot_be_closed_at_its_timeout_denies_whatever_its_default(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """An approval is pending when JetStream goes away; its timeout comes, and its close
    (the cancel that makes a later answer decide nothing) cannot be stored. A human may have
    answered meanwhile, unseen: the call is denied, whatever `approval_default` says, as
    when the store cannot be reached at the ask. Before, an `allow` default allowed it."""
    async with outliving(embedded_server) as (d, event):

        @d.register(event)
        async def gate(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(
                action="ask_user", approval_prompt="go?", approval_timeout=1.0,
                approval_default="allow",
            )  # fmt: skip

        await d.start()
        d.approvals.records.records.deadline_s = 2.0  # each try of the store gives up sooner
        events = await d.hook_events()
        try:
            async with anyio.create_task_group() as tg:
                data = {"session_id": "s", "tool_name": "bash"}
                out = in_background(tg, lambda: d.emit(event, data, timeout_s=40))
                with anyio.fail_after(10):
                    async for e in events:
                        if e.hook.status == "pending":
                            break
                embedded_server.stop()
                result = await out.wait(timeout_s=60)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()
    assert result.action == "deny", result
    assert result.reason is not None and "could not be closed" in result.reason, result.reason
