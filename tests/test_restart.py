"""Restarts: suspensions live in JetStream KV, not in any process.

- The agent's process is killed (SIGKILL) while its hook is pending; the hook is resolved
  while no agent runs; a new process entering the same run gets the resolution at once,
  and no second ``pending`` event is published.
- The dispatcher service (``hookbus dispatcher``, a subprocess) is killed while an
  approval it asked for is pending; the agent retries the same emit request against a new
  service and gets the decision without a second prompt.
- The nats-server itself restarts while a hook waits: the waiter still gets the resolution.

Each test has a private nats-server (`embedded_server`). Child processes print one line per
step; the tests wait for those lines and for hook events, never for a fixed time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import pytest
from anyio.abc import Process, TaskGroup
from anyio.streams.text import TextReceiveStream
from conftest import reconnecting
from nats.aio.client import Client as NATS
from nats.js.api import StorageType

from hookbus._core.buckets import leases_bucket_config
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import AnswerNotAppliedError, ApprovalsClient, HookDispatcher
from hookbus.schemas import (
    APPROVALS_BUCKET,
    LEASES_BUCKET,
    SUSPENSIONS_BUCKET,
    EmitReply,
    EmitRequest,
    HookEvent,
    HookPart,
    HookResult,
    decode,
    emit_service_subject,
    encode,
    suspension_event_subject,
    suspension_key,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

AGENT = Path(__file__).with_name("_agent_proc.py")


class Grant(msgspec.Struct):  # the same shape as _agent_proc.Grant
    approved: bool
    by: str = ""


# -- child processes ---------------------------------------------------------------------------
class Child:
    """A subprocess whose stdout and stderr lines are collected as they come."""

    def __init__(self, proc: Process, name: str) -> None:
        self.proc, self.name = proc, name
        self.out: list[str] = []
        self.err: list[str] = []
        self._open = 2
        self._changed = anyio.Event()

    async def pump(self, stream: Any, lines: list[str]) -> None:
        buf = ""
        async for chunk in TextReceiveStream(stream):
            buf += chunk
            *done, buf = buf.split("\n")
            lines.extend(done)
            self._notify()
        if buf:
            lines.append(buf)
        self._open -= 1
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def expect(self, prefix: str, *, stderr: bool = False, timeout_s: float = 30) -> str:
        """The first line starting with `prefix` (waits for it)."""
        lines = self.err if stderr else self.out
        with anyio.fail_after(timeout_s):
            while True:
                for line in lines:
                    if line.startswith(prefix):
                        return line
                if self._open == 0:
                    raise AssertionError(
                        f"{self.name} ended without {prefix!r}:\n" + "\n".join(self.out + self.err)
                    )
                await self._changed.wait()

    async def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the child."""
        self.proc.kill()
        await self.proc.wait()

    async def wait(self, timeout_s: float = 30) -> int:
        with anyio.fail_after(timeout_s):
            return await self.proc.wait()


class Children:
    """Starts children in a task group (for their pumps) and kills any left at exit."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self._all: list[Child] = []

    async def start(self, name: str, *cmd: str) -> Child:
        proc = await anyio.open_process(
            [sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        child = Child(proc, name)
        assert proc.stdout is not None and proc.stderr is not None
        self._tg.start_soon(child.pump, proc.stdout, child.out)
        self._tg.start_soon(child.pump, proc.stderr, child.err)
        self._all.append(child)
        return child

    async def agent(self, url: str, run_id: str, label: str) -> Child:
        return await self.start("agent", str(AGENT), url, run_id, label)

    async def service(self, url: str) -> Child:
        """``hookbus dispatcher``; returns once it serves (its ready line on stderr)."""
        child = await self.start("dispatcher", "-m", "hookbus.cli", "dispatcher", "--url", url)
        await child.expect("dispatcher serving", stderr=True)
        return child

    async def close(self) -> None:
        for child in self._all:
            if child.proc.returncode is None:
                await child.kill()


@pytest.fixture
async def children() -> AsyncIterator[Children]:
    async with anyio.create_task_group() as tg:
        kids = Children(tg)
        try:
            yield kids
        finally:
            await kids.close()


# -- hook events -----------------------------------------------------------------------------
class Events:
    def __init__(self, stream: Any, nc: NATS) -> None:
        self._stream, self._nc = stream, nc
        self.seen: list[HookPart] = []

    async def next(self, pred: Any, timeout_s: float = 30) -> HookPart:
        with anyio.fail_after(timeout_s):
            for part in self.seen:
                if pred(part):
                    return part
            while True:
                part = (await self._stream.__anext__()).hook
                self.seen.append(part)
                if pred(part):
                    return part

    async def settle(self) -> list[HookPart]:
        """All events received once everything published so far has arrived: the children
        drained their connections before exiting, and the server delivers in order."""
        await self._nc.flush()
        sentinel = f"sentinel {uuid.uuid4().hex}"
        await self._nc.publish(
            suspension_event_subject(sentinel, "pending"),
            encode(HookEvent(hook=HookPart(hook_id="-", label=sentinel, status="pending"))),
        )
        await self.next(lambda h: h.label == sentinel)
        return [h for h in self.seen if h.label != sentinel]


class Observer:
    """The test's own "process": a dispatcher (approvals off), the hook event log and an
    approver's client."""

    def __init__(
        self, d: HookDispatcher, nc: NATS, events: Events, approvals: ApprovalsClient
    ) -> None:
        self.d, self.nc, self.events, self.approvals = d, nc, events, approvals


@pytest.fixture
async def observer(embedded_server: EmbeddedNatsServer) -> AsyncIterator[Observer]:
    nc = await nats.connect(embedded_server.url)
    try:
        d = HookDispatcher(nc, approvals=False)
        async with d, ApprovalsClient(nc) as approvals:
            stream = await d.hook_events()
            try:
                yield Observer(d, nc, Events(stream, nc), approvals)
            finally:
                await stream.aclose()
    finally:
        await nc.close()


def pending_of(label: str) -> Any:
    return lambda h: h.label == label and h.status == "pending"


# -- the agent process is killed -------------------------------------------------------------
async def test_agent_killed_while_pending_resumes_in_a_new_process_without_a_second_prompt(
    embedded_server: EmbeddedNatsServer, observer: Observer, children: Children
) -> None:
    url, run_id, label = embedded_server.url, f"run-{uuid.uuid4().hex}", "deploy: prod ✓"
    first = await children.agent(url, run_id, label)
    part = await observer.events.next(pending_of(label))
    assert part.metadata == {"agent": "restart-test"}
    await first.kill()
    got = await observer.d.suspensions.get(label)
    assert got is not None
    record = got[0]
    assert record.status == "pending" and record.run_id == run_id
    assert record.attached, "a killed waiter never detached"

    await observer.d.resolve_hook(
        label, Grant(approved=True, by="while no agent ran")
    )  # no agent runs

    second = await children.agent(url, run_id, label)
    line = await second.expect("resolved ")
    assert json.loads(line.removeprefix("resolved ")) == {
        "approved": True,
        "by": "while no agent ran",
    }
    assert await second.wait() == 0
    seen = [h for h in await observer.events.settle() if h.label == label]
    assert [h.status for h in seen] == ["pending", "resolved"], "one prompt only"
    assert await observer.d.suspensions.get(label) is None, "the finished run removed its hook"


async def test_agent_killed_then_resumed_before_the_resolution_waits_for_it(
    embedded_server: EmbeddedNatsServer, observer: Observer, children: Children
) -> None:
    url, run_id, label = embedded_server.url, f"run-{uuid.uuid4().hex}", "resume first"
    first = await children.agent(url, run_id, label)
    await observer.events.next(pending_of(label))
    await first.kill()

    kv = await observer.nc.jetstream().key_value(SUSPENSIONS_BUCKET)
    watcher = await kv.watch(suspension_key(label))
    try:
        with anyio.fail_after(10):
            current = await watcher.updates()
        assert current is not None and current.revision is not None
        second = await children.agent(url, run_id, label)
        with anyio.fail_after(30):  # the second process re-attaches: a new revision
            while (
                e := await watcher.updates(timeout=30)
            ) is None or e.revision == current.revision:
                pass
    finally:
        await watcher.stop()
    assert second.proc.returncode is None
    await observer.d.resolve_hook(label, Grant(approved=False, by="later"))
    line = await second.expect("resolved ")
    assert json.loads(line.removeprefix("resolved ")) == {"approved": False, "by": "later"}
    assert await second.wait() == 0
    seen = [h for h in await observer.events.settle() if h.label == label]
    assert [h.status for h in seen] == ["pending", "resolved"]


# -- the dispatcher service is killed mid-wait -------------------------------------------------
async def ask_worker(nc: NATS, event: str) -> HookWorker:
    w = HookWorker(nc)

    async def guard(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="Run it?", approval_timeout=120)

    w.add_handler(event, guard)
    return w


async def emit_request(nc: NATS, event: str, session: str) -> EmitReply:
    """The agent's plain NATS request (long timeout: a human answers it). The retry is the
    same call: it carries the same idempotency key (one per test session)."""
    body = EmitRequest(
        data={"tool_name": "bash", "command": "make deploy"},
        session_id=session,
        idempotency_key=f"deploy-{session}",
    )
    msg = await nc.request(emit_service_subject(event), encode(body), timeout=60)
    return decode(msg.data, EmitReply)


@pytest.mark.parametrize(
    "answer_first", [True, False], ids=["answer-then-retry", "retry-then-answer"]
)
async def test_dispatcher_service_killed_mid_approval_loses_nothing(
    embedded_server: EmbeddedNatsServer,
    observer: Observer,
    children: Children,
    event: str,
    answer_first: bool,
) -> None:
    url, session = embedded_server.url, f"session-{uuid.uuid4().hex[:8]}"
    worker_nc, agent_nc = await nats.connect(url), await nats.connect(url)
    try:
        async with await ask_worker(worker_nc, event):
            service = await children.service(url)
            async with anyio.create_task_group() as tg:
                tg.start_soon(emit_request, agent_nc, event, session)  # never answered
                part = await observer.events.next(
                    lambda h: h.status == "pending" and h.metadata.get("session_id") == session
                )
                assert part.metadata["prompt"] == "Run it?"
                await service.kill()
                tg.cancel_scope.cancel()  # the agent gives up on that request

            if answer_first:  # answered while no dispatcher service runs: recorded only
                with pytest.raises(AnswerNotAppliedError):
                    await observer.approvals.answer_approval(
                        part.label, "Allow", approver="tester", agent_id=part.agent_id,
                        wait_s=0.5,
                    )  # fmt: skip
                await children.service(url)
                reply = await emit_request(agent_nc, event, session)  # the retry
            else:  # the retry reaches a new service first, then the answer comes
                await children.service(url)
                kv = await observer.nc.jetstream().key_value(APPROVALS_BUCKET)
                watcher = await kv.watch(suspension_key(part.label))
                replies: list[EmitReply] = []
                replied, taken_up = anyio.Event(), anyio.Event()

                async def retry() -> None:
                    replies.append(await emit_request(agent_nc, event, session))
                    replied.set()

                async def watch_taken_up() -> None:
                    """The new service re-attaches to the approval: a new revision."""
                    first = None
                    while True:
                        e = await watcher.updates(timeout=60)
                        if e is None:
                            continue
                        if first is None:
                            first = e.revision
                        elif e.revision != first:
                            taken_up.set()
                            return

                try:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(retry)
                        with anyio.fail_after(30):
                            async with anyio.create_task_group() as race:

                                async def on(ev: anyio.Event) -> None:
                                    await ev.wait()
                                    race.cancel_scope.cancel()

                                race.start_soon(watch_taken_up)
                                race.start_soon(on, replied)
                                race.start_soon(on, taken_up)
                        if not replied.is_set():
                            await observer.approvals.answer_approval(
                                part.label, "Allow", approver="tester", agent_id=part.agent_id
                            )
                finally:
                    await watcher.stop()
                (reply,) = replies
    finally:
        await worker_nc.close()
        await agent_nc.close()

    assert reply.error is None, reply.error
    assert reply.result is not None
    assert reply.result.action == "continue" and reply.result.decided_by == "guard"
    approvals = [
        h for h in await observer.events.settle()
        if h.metadata.get("session_id") == session and h.status == "pending"
    ]  # fmt: skip
    assert len(approvals) == 1, "no second prompt"


# -- the nats-server restarts mid-wait -------------------------------------------------------
READS_SUBJECT = f"$JS.API.STREAM.MSG.GET.KV_{SUSPENSIONS_BUCKET}"
"""Where a read of a suspension record is requested: from the stream's leader, a message get
naming the record's subject in its body (`hookbus._core.leader_reads`)."""


async def next_read_of(sub: Any, label: str, timeout_s: float) -> None:
    """Wait for the next read of `label`'s record among the requests `sub` hears."""
    subject = f"$KV.{SUSPENSIONS_BUCKET}.{suspension_key(label)}".encode()
    with anyio.fail_after(timeout_s):
        while subject not in (await sub.next_msg(timeout=timeout_s)).data:
            pass


async def restart_while_waiting(
    server: EmbeddedNatsServer, *, steady: bool, outage_s: float = 0.0
) -> None:
    """A hook waits; the nats-server is killed and restarted (same port and data); a
    resolution written afterwards must still wake the waiter.

    steady: restart once the waiter is in its wait loop, shown by its first periodic read
        of the record (the read that backs the KV watch); else right after its pending event.
    outage_s: seconds the server stays down (the outage itself, not a wait for a signal).
    """
    port = int(server.url.rpartition(":")[2])

    async def quiet(exc: Exception) -> None:  # refused reconnects while the server is down
        pass

    opts: dict[str, Any] = {
        "max_reconnect_attempts": -1, "reconnect_time_wait": 0.1, "error_cb": quiet,
    }  # fmt: skip
    nc = await nats.connect(server.url, **opts)
    restarted: EmbeddedNatsServer | None = None
    label = f"survives a restart {uuid.uuid4().hex[:6]}"
    try:
        d = HookDispatcher(nc, approvals=False)
        async with d:
            result: list[Grant] = []
            reads = await nc.subscribe(READS_SUBJECT)
            stream = await d.hook_events()
            async with anyio.create_task_group() as tg:

                async def wait() -> None:
                    result.append(await d.hook(label, Grant))

                tg.start_soon(wait)
                with anyio.fail_after(10):
                    async for e in stream:
                        if e.hook.label == label and e.hook.status == "pending":
                            break
                    await stream.aclose()
                    if steady:
                        await next_read_of(reads, label, 5)  # hook()'s look before creating
                        await next_read_of(reads, label, 5)  # the first periodic read
                await reads.unsubscribe()

                server.kill()  # keeps its data folder
                await anyio.sleep(outage_s)
                restarted = EmbeddedNatsServer(server.data_dir, port=port)
                restarted.start()
                nc2 = await nats.connect(restarted.url)
                try:
                    other = HookDispatcher(nc2, approvals=False)
                    async with other:
                        await other.resolve_hook(label, Grant(approved=True, by="after restart"))
                finally:
                    await nc2.close()
            assert result == [Grant(approved=True, by="after restart")]
    finally:
        await nc.close()
        if restarted is not None:
            restarted.stop()


async def test_a_waiter_survives_a_nats_server_restart_mid_wait(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """A watch can stall after a server loss; the periodic read covers it."""
    await restart_while_waiting(embedded_server, steady=True)


async def test_a_waiter_survives_a_nats_server_restart_right_after_its_pending_event(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """The restart lands while the waiter sets up its KV watch (or just after): a
    transient JetStream error there must not end the wait either."""
    await restart_while_waiting(embedded_server, steady=False)


async def test_a_waiter_survives_an_outage_longer_than_a_jetstream_request_timeout(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """The server is down for longer than nats-py's JetStream request timeout (5 s): the
    waiter's periodic reads fail meanwhile, and the wait must go on (a hook with no
    `timeout_s` is not a `SuspensionTimeoutError`)."""
    await restart_while_waiting(embedded_server, steady=True, outage_s=6.5)


@pytest.mark.parametrize("older_memory_bucket", [False, True])
async def test_approvals_flow_after_a_nats_server_restart_under_a_running_dispatcher(
    embedded_server: EmbeddedNatsServer, event: str, older_memory_bucket: bool
) -> None:
    """An agent's dispatcher asks for an approval; the nats-server (JetStream with a store
    folder) is killed and restarted under it. Every bucket survives (file storage): the
    approval in flight is answered and allows, and a new approval is asked and answered
    as before (not denied 15 s later for a lost waiter lease). With the leases bucket an
    older hookbus made in memory, it is lost at the restart and made again (file storage)
    by the next lease written."""
    port = int(embedded_server.url.rpartition(":")[2])
    if older_memory_bucket:
        setup = await nats.connect(embedded_server.url)
        try:
            config = leases_bucket_config()
            config.storage = StorageType.MEMORY
            await setup.jetstream().create_key_value(config)
        finally:
            await setup.close()

    nc = await reconnecting(embedded_server.url)
    restarted: EmbeddedNatsServer | None = None

    async def ask(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_options=["Allow", "Deny"], approval_timeout=60
        )

    try:
        d = HookDispatcher(nc, agent_id="a1")
        d.register(event, ask, name="guard")
        async with d, anyio.create_task_group() as tg:
            results: dict[str, HookResult] = {}

            async def emit(name: str) -> None:
                data = {"tool_name": name}
                results[name] = await d.emit(event, data, idempotency_key=name, timeout_s=12)

            events = await d.hook_events()
            tg.start_soon(emit, "in-flight")
            with anyio.fail_after(10):
                async for e in events:
                    if e.hook.status == "pending" and e.hook.metadata.get("tool_name"):
                        in_flight = e.hook.label
                        break
            await events.aclose()

            embedded_server.kill()  # keeps its data folder
            restarted = EmbeddedNatsServer(embedded_server.data_dir, port=port)
            restarted.start()
            nc2 = await nats.connect(restarted.url)
            try:
                # an approver process: it opens the approvals bucket only (a dispatcher
                # would create a lost bucket again, and hide the loss)
                async with ApprovalsClient(nc2) as approver:
                    stream = await approver.events()
                    await approver.answer_approval(
                        in_flight, "Allow", approver="alice", agent_id="a1", wait_s=10
                    )
                    # the dispatcher runs on: its waiter lease is written again (the
                    # heartbeat), into a bucket that must be there after the restart
                    leases = d.suspensions.leases
                    assert leases is not None
                    written = leases._last_put
                    with anyio.fail_after(leases.lease_s + 10):
                        while leases._last_put <= written:  # noqa: ASYNC110 (no event to wait on)
                            await anyio.sleep(0.05)
                    tg.start_soon(emit, "after")
                    with anyio.fail_after(10):
                        async for e in stream:
                            if e.hook.status == "pending" and e.hook.label != in_flight:
                                after = e.hook.label
                                break
                    await stream.aclose()
                    await approver.answer_approval(
                        after, "Allow", approver="alice", agent_id="a1", wait_s=10
                    )
            finally:
                await nc2.close()
        if older_memory_bucket:
            assert restarted is not None
            check = await nats.connect(restarted.url)
            try:
                info = await check.jetstream().stream_info(f"KV_{LEASES_BUCKET}")
                assert info.config.storage == StorageType.FILE
            finally:
                await check.close()
        assert {k: (r.action, r.approved_by) for k, r in results.items()} == {
            "in-flight": ("continue", "alice"), "after": ("continue", "alice"),
        }  # fmt: skip
    finally:
        await nc.close()
        if restarted is not None:
            restarted.stop()
