"""`ApprovalsClient`: an approver's entry point opens the approvals bucket alone, once.

What is observed is the wire: a second connection subscribed to ``$JS.API.>`` on the open
test server sees every JetStream API request, and the approver's requests are told apart
by the inbox prefix of its connection (their reply subjects). Its subscriptions are those
the client library holds for it.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import pytest
from conftest import Connect
from nats.aio.client import Client as NATS
from test_approvals import Agent, asker, spawn_emit

from hookbus.dispatcher import ApprovalsClient, HookDispatcher, _server_clock
from hookbus.schemas import NotConnectedError, SuspensionRecord

pytestmark = pytest.mark.anyio

APPROVALS_STREAM = "KV_hookbus_approvals"


MARKER = "$JS.API.HOOKBUS_TEST_MARKER"
"""A subject under the monitored ones that no JetStream API serves: `ApiRequests.settled`'s
marker."""


class ApiRequests:
    """The JetStream API requests (subjects) whose replies go to inboxes under `prefix`."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.subjects: list[str] = []
        self._markers: dict[str, anyio.Event] = {}

    async def start(self, monitor: NATS) -> ApiRequests:
        async def seen(msg: Any) -> None:
            reply = msg.reply or ""
            if msg.subject == MARKER:
                marker = self._markers.get(reply)
                if marker is not None:
                    marker.set()
            elif reply.startswith(self.prefix + "."):
                self.subjects.append(msg.subject)

        await monitor.subscribe("$JS.API.>", cb=seen)
        await monitor.flush()
        return self

    async def settled(self, *conns: NATS) -> list[str]:
        """The requests so far, once everything `conns` sent has reached the monitor: each
        sends a marker after its requests, and NATS delivers one connection's messages to
        a subscriber in the order they were sent (no wait guessed: a busy machine may hold
        the monitor's copies for any time)."""
        for conn in conns:
            token = f"{self.prefix}.marker-{uuid.uuid4().hex}"
            arrived = self._markers[token] = anyio.Event()
            await conn.publish(MARKER, b"", reply=token)
            await conn.flush()
            with anyio.fail_after(30):
                await arrived.wait()
        return list(self.subjects)

    def stream_infos(self, stream: str) -> int:
        return sum(1 for s in self.subjects if s == f"$JS.API.STREAM.INFO.{stream}")


def subscriptions(nc: NATS) -> list[str]:
    """The subjects `nc` is subscribed to (nats-py keeps them by subscription id)."""
    return [sub.subject for sub in nc._subs.values()]  # type: ignore[attr-defined]


async def pending_of(approvals: ApprovalsClient, session: str, n: int) -> list[SuspensionRecord]:
    """The `n` pending approvals of `session`, once they are all pending."""
    with anyio.fail_after(10):
        while True:
            found = [
                r
                for r in await approvals.pending_approvals()
                if r.metadata.get("session_id") == session
            ]
            if len(found) >= n:
                return found
            await anyio.sleep(0.05)


async def test_an_approver_answers_an_approval_with_the_approvals_bucket_alone(
    connect: Connect, event: str
) -> None:
    nc = await connect()
    async with HookDispatcher(nc) as d:  # the agent's dispatcher asks and decides
        agent = Agent(d, nc, f"session-{uuid.uuid4().hex[:10]}")
        d.register(event, asker(approval_options=["Allow once", "Deny"]))
        prefix = f"_INBOX_approver_{uuid.uuid4().hex[:8]}"
        api = await ApiRequests(prefix).start(await connect())
        approver_nc = await connect(inbox_prefix=prefix)
        async with ApprovalsClient(approver_nc) as approvals, anyio.create_task_group() as tg:
            out = spawn_emit(tg, d, event, {"tool_name": "bash"})
            (record,) = await pending_of(approvals, agent.session, 1)
            got = await approvals.answer_approval(
                record.label, "Allow once", approver="alice", agent_id=record.agent_id
            )
            r = await out.wait()
            subjects = subscriptions(approver_nc)
        requests = await api.settled(approver_nc, nc)
    assert got.choice == "Allow once" and got.answered_by == "alice"
    assert r.action == "continue" and r.approved_by == "alice"
    # the approver's JetStream API requests: the approvals bucket's, nothing else
    assert requests, "the monitor saw none of the approver's requests"
    assert all(s.endswith(APPROVALS_STREAM) or f".{APPROVALS_STREAM}." in s for s in requests), (
        requests
    )
    assert not [s for s in requests if "KV_hookbus_handlers" in s]  # no registry consumer
    # no request inboxes: only the client library's one reply subscription for its requests
    assert len(subjects) == 1 and subjects[0].startswith(prefix + "."), subjects


async def test_a_dispatcher_holds_the_inboxes_an_approvals_client_does_not(
    connect: Connect,
) -> None:
    """The observation above sees a dispatcher's inboxes when there are some."""
    prefix = f"_INBOX_dispatcher_{uuid.uuid4().hex[:8]}"
    nc = await connect(inbox_prefix=prefix)
    async with HookDispatcher(nc, approvals=False):
        assert len(subscriptions(nc)) > 1, subscriptions(nc)


async def test_answering_twenty_approvals_opens_the_approvals_bucket_once(
    connect: Connect, event: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening reads the bucket's stream info; 20 answers read it never again (each is gets,
    from the stream's leader, and one proof write). A listing makes a consumer, which reads
    it too: it is counted apart. Judging an approval's age reads the server's clock, also a
    stream info, once per `SERVER_CLOCK_TTL_S`: held past the test's length here, or a slow
    machine's answers would span a second reading."""
    monkeypatch.setattr(_server_clock, "SERVER_CLOCK_TTL_S", 3600.0)
    nc = await connect()
    async with HookDispatcher(nc, max_pending_approvals=None) as d:
        agent = Agent(d, nc, f"session-{uuid.uuid4().hex[:10]}")
        d.register(event, asker(approval_options=["Allow once", "Deny"], approval_timeout=30))
        prefix = f"_INBOX_approver_{uuid.uuid4().hex[:8]}"
        api = await ApiRequests(prefix).start(await connect())
        approver_nc = await connect(inbox_prefix=prefix)
        async with ApprovalsClient(approver_nc) as approvals, anyio.create_task_group() as tg:
            await api.settled(approver_nc)
            opened = api.stream_infos(APPROVALS_STREAM)
            outs = [spawn_emit(tg, d, event, {"tool_name": "bash", "n": n}) for n in range(20)]
            records = await pending_of(approvals, agent.session, 20)
            await api.settled(approver_nc)
            listed = api.stream_infos(APPROVALS_STREAM)
            answers_from = len(api.subjects)
            for record in records:
                await approvals.answer_approval(
                    record.label, "Allow once", approver="alice", agent_id=record.agent_id
                )
            results = [await out.wait() for out in outs]
        requests = await api.settled(approver_nc)
    assert [r.action for r in results] == ["continue"] * 20
    assert [r.approved_by for r in results] == ["alice"] * 20
    assert opened >= 1  # opening the bucket: its stream info
    answering = requests[answers_from:]
    assert api.stream_infos(APPROVALS_STREAM) == listed  # 20 answers: never again
    gets = ("$JS.API.STREAM.MSG.GET.", "$JS.API.DIRECT.GET.")  # the server clock's: direct
    assert answering and all(s.startswith(gets) for s in answering), answering


async def test_a_client_refuses_calls_before_start_and_after_close(connect: Connect) -> None:
    approvals = ApprovalsClient(await connect())
    with pytest.raises(NotConnectedError):
        await approvals.approval_grants()
    await approvals.start()
    assert isinstance(await approvals.approval_grants(), list)
    await approvals.close()
    with pytest.raises(NotConnectedError):
        await approvals.pending_approvals()
