"""The permission model against a real server started from `hookbus auth init`, in both
modes: static nkey users (``auth.conf``) and NATS JWTs (``--jwt``: each identity a
``.creds`` file signed by its tenant's account), so every probe holds for both.

Every probe below is something a client of one role must not do; each must be refused by
the server with a NATS permissions violation (or, across tenants, never be delivered),
while every legitimate flow passes: an agent's emit decided by a worker, a worker's reply
and declaration, an approval answered by an approver (who is recorded), an agent's own
suspension resolved by itself, an emit through the dispatcher service, the auditor reading
the decision trail.

Run with ``-s`` to see the probe table (probe, expected, observed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import nats.js.errors
import pytest
from _ports import on_free_port
from _sites import wait_listening
from nats.aio.client import Client as NATS

from hookbus._core.jetstream import existing_key_value
from hookbus._core.nats_guard import harden_connection
from hookbus.cli import find_nats_server
from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.schemas import (
    DISPATCHER_SERVICE_NAME,
    SUSPENSIONS_BUCKET,
    TOOL_PRE,
    ApprovalAnswer,
    HookResult,
    approval_answer_key,
    emit_service_subject,
    encode,
    encode_token,
    grant_key,
    handler_key,
    handler_subject,
    suspension_event_subject,
    suspension_key,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

VIOLATION = "permissions violation"
EVENT = "tool:pre"
"""The event every worker identity of the module serves (a worker is bound to its events)."""


@pytest.fixture
def event() -> str:
    return EVENT


@dataclass
class Secure:
    """A server started from `hookbus auth init` (two tenants), and its credentials."""

    out: Path
    url: str
    table: list[tuple[str, str, str]] = field(default_factory=list)

    def context(self, tenant: str, stem: str) -> dict[str, Any]:
        return dict(json.loads((self.out / tenant / f"{stem}.json").read_text()))


@pytest.fixture(scope="module", params=["nkey", "jwt"])
def secure(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
           ) -> Iterator[Secure]:  # fmt: skip
    base = tmp_path_factory.mktemp(f"auth-{request.param}")
    mode = ["--jwt"] if request.param == "jwt" else []

    def start(port: int) -> tuple[subprocess.Popen[bytes], Path, int]:
        out = base / f"port-{port}"
        subprocess.run(
            [sys.executable, "-m", "hookbus.cli", "auth", "init", "--out", str(out),
             "--tenant", "T1", "--tenant", "T2", "--embedded-agent", "a1", "--agent", "a2",
             "--worker", f"sec:{EVENT}/security", "--worker", f"other:{EVENT}/audit",
             "--approver", "alice", "--approver", "bob", "--auditor", "aud",
             "--port", str(port), *mode],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        check = subprocess.run(
            [find_nats_server(), "-c", str(out / "server.conf"), "-t"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert check.returncode == 0, check.stderr + check.stdout
        log = out / "nats.log"
        proc = subprocess.Popen(
            [find_nats_server(), "-c", str(out / "server.conf"), "-l", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_listening(port, proc, log, timeout_s=20)
        except BaseException:
            proc.terminate()
            proc.wait(10)
            raise
        return proc, out, port

    proc, out, port = on_free_port(start)
    try:
        provisioned = subprocess.run(
            [sys.executable, "-m", "hookbus.cli", "auth", "provision", "--dir", str(out)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert provisioned.returncode == 0, provisioned.stderr
        secure = Secure(out, f"nats://127.0.0.1:{port}")
        yield secure
        if secure.table:
            width = max(len(p) for p, _, _ in secure.table)
            print("\n" + f"{'probe':<{width}}  expected  observed")
            for probe, expected, observed in secure.table:
                print(f"{probe:<{width}}  {expected:<8}  {observed}")
    finally:
        proc.terminate()
        proc.wait(10)


class Client:
    """One connection with one identity's credentials, collecting asynchronous errors."""

    def __init__(self, nc: NATS, errors: list[str]) -> None:
        self.nc, self.errors = nc, errors

    async def violation(self, since: int, timeout_s: float = 3.0) -> str | None:
        """The first permissions violation reported after error number `since`."""
        with anyio.move_on_after(timeout_s):
            while True:
                for err in self.errors[since:]:
                    if VIOLATION in err.lower():
                        return err
                await anyio.sleep(0.02)
        return None


Connect = Callable[..., Awaitable[Client]]


@pytest.fixture
async def as_(secure: Secure) -> AsyncIterator[Connect]:
    clients: list[NATS] = []

    async def make(stem: str, tenant: str = "T1") -> Client:
        ctx = secure.context(tenant, stem)
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        secret = {"user_credentials": ctx["creds"]} if "creds" in ctx else {
            "nkeys_seed": ctx["nkey"]}  # fmt: skip
        nc = await nats.connect(
            secure.url, **secret, inbox_prefix=ctx["inbox_prefix"],
            error_cb=on_error, max_reconnect_attempts=0, connect_timeout=15,  # busy TLS
            tls=ssl.create_default_context(cafile=ctx["ca"]),
        )  # fmt: skip
        clients.append(nc)
        return Client(nc, errors)

    yield make
    for nc in clients:
        with contextlib.suppress(Exception):
            await nc.close()


def emits_as(nc: NATS, event: str, agent_id: str) -> Callable[[], Awaitable[Any]]:
    """The probe: an emit request on agent `agent_id`'s service subject of `event`."""
    return lambda: nc.publish(emit_service_subject(event, agent_id), b'{"data": {}}')


def writes_suspension_of(js: Any, agent_id: str) -> Callable[[], Awaitable[Any]]:
    """The probe: a write (resolve/cancel) of agent `agent_id`'s suspension ``l``."""
    return lambda: js.publish(f"$KV.hookbus_suspensions.{suspension_key('l', agent_id)}", b"{}")


def fakes_resolved_event_of(nc: NATS, agent_id: str) -> Callable[[], Awaitable[Any]]:
    """The probe: a fake 'resolved' hook event of agent `agent_id`'s suspension ``l``."""
    return lambda: nc.publish(suspension_event_subject("l", "resolved", agent_id), b"{}")


async def refused(
    secure: Secure, client: Client, probe: str, act: Callable[[], Awaitable[Any]]
) -> None:
    """Run `act` and require a permissions violation for it (its own error, if any, is the
    refused request timing out)."""
    since = len(client.errors)
    with contextlib.suppress(Exception):
        with anyio.fail_after(6):
            await act()
    with contextlib.suppress(Exception):  # a hardened connection raises the refusal here
        await client.nc.flush()
    seen = await client.violation(since)
    secure.table.append((probe, "refused", seen or "ALLOWED"))
    assert seen is not None, f"{probe}: no permissions violation"


async def _system(as_: Connect, event: str) -> tuple[HookWorker, Client]:
    """Worker `sec` serving `security` on `event` (the buckets: `hookbus auth provision`)."""
    worker_client = await as_("worker-sec")
    worker = HookWorker(worker_client.nc)

    @worker.handler(event, name="security", failure_policy="deny")
    async def security(ev: str, data: dict[str, Any]) -> HookResult:
        command = str(data.get("tool_input", {}).get("command", ""))
        if "rm -rf" in command:
            return HookResult(action="deny", reason="destructive")
        if "ask" in command:
            return HookResult(action="ask_user", approval_prompt="run it?", approval_timeout=20,
                              approval_options=["Allow once", "Allow always", "Deny"])  # fmt: skip
        return HookResult(action="continue")

    return worker, worker_client


# -- probes: each refused -----------------------------------------------------------------------
ANONYMOUS = """
import asyncio, ssl, sys, nats
async def main():
    errors = []
    async def on_error(exc):
        errors.append(str(exc))
    try:
        tls = ssl.create_default_context(cafile=sys.argv[2])
        nc = await nats.connect(sys.argv[1], allow_reconnect=False, connect_timeout=3,
                                error_cb=on_error, tls=tls)
    except Exception as exc:
        print("refused:", type(exc).__name__, *errors)
        return
    print("CONNECTED")
    await nc.close()
asyncio.run(main())
"""


async def test_anonymous_connect_is_refused(secure: Secure) -> None:
    # in a process of its own: nats-py leaves the refused socket for the GC to close
    with anyio.fail_after(30):
        ca = secure.context("T1", "admin-admin")["ca"]  # the server's TLS is on: verified
        run = await anyio.run_process([sys.executable, "-c", ANONYMOUS, secure.url, ca],
                                      check=False)  # fmt: skip
    observed = run.stdout.decode().strip() or run.stderr.decode().strip()[-200:]
    secure.table.append(("anonymous connect", "refused", observed))
    assert observed.startswith("refused") and "authorization violation" in observed.lower()


async def test_agent_probes_are_refused(secure: Secure, as_: Connect, event: str) -> None:
    worker, _ = await _system(as_, event)
    async with worker:
        agent = await as_("agent-a1")
        nc = agent.nc
        js = nc.jetstream(timeout=2)
        for probe, act in {
            "agent subscribes to hookbus.v1.handler.>": lambda: nc.subscribe(
                "hookbus.v1.handler.>"
            ),
            "agent joins the security handler's queue group": lambda: nc.subscribe(
                handler_subject(event, "security"), queue="security"
            ),
        }.items():
            await refused(secure, agent, probe, act)
        disp = secure.context("T1", "dispatcher-dispatcher")["inbox_prefix"]
        await refused(
            secure,
            agent,
            "agent replies on another user's inbox",
            lambda: nc.publish(f"{disp}.x", b'{"result": {"action": "continue"}}'),
        )
        decl = f"$KV.hookbus_handlers.{handler_key(event, 'security')}"
        for probe, act in {
            "agent writes a declaration": lambda: js.publish(decl, b"{}"),
            "agent deletes the handlers bucket": lambda: js.delete_key_value("hookbus_handlers"),
            "agent emits as another agent (service subject)": emits_as(nc, event, "a2"),
            "agent writes another agent's suspension (resolve/cancel)": writes_suspension_of(
                js, "a2"
            ),
        }.items():
            await refused(secure, agent, probe, act)
        kv = await js.key_value("hookbus_suspensions")
        for probe, act in {
            "agent reads another agent's suspension": lambda: kv.get(suspension_key("l", "a2")),
            "agent watches every suspension": lambda: kv.watch(">"),
            "agent writes an approval answer proof (answers an approval)": lambda: kv.create(
                approval_answer_key("l", "a1", "alice"),
                encode(ApprovalAnswer(choice="Allow", answered_by="alice")),
            ),
            "agent forges an 'Allow always' grant": lambda: js.publish(
                "$KV.hookbus_approvals.a1.s.tool=3Apre.security.bash", b"{}"
            ),
            "agent listens to another agent's hook events": lambda: nc.subscribe(
                "hookbus.v1.suspension.a2.>"
            ),
            "agent publishes a fake hook event of another agent": fakes_resolved_event_of(nc, "a2"),
            "agent reads the audit stream": lambda: js.stream_info("hookbus_decisions"),
            "agent marks a handler required": lambda: js.publish(
                "$KV.hookbus_handlers._required.x.y", b"{}"
            ),
            "agent forges a registry change (the server's republish)": lambda: nc.publish(
                "hookbus.v1.registry._required.x.y", b"{}"
            ),
        }.items():
            await refused(secure, agent, probe, act)


async def test_worker_probes_are_refused(secure: Secure, as_: Connect, event: str) -> None:
    worker, client = await _system(as_, event)
    async with worker:
        nc, js = client.nc, client.nc.jetstream(timeout=2)
        other = f"$KV.hookbus_handlers.{handler_key(event, 'audit')}"
        for probe, act in {
            "worker declares under another worker's handler name": lambda: js.publish(other, b"{}"),
            "worker forges a registry change (the server's republish)": lambda: nc.publish(
                f"hookbus.v1.registry.{handler_key(event, 'audit')}", b"{}"
            ),
            "worker serves another worker's handler": lambda: nc.subscribe(
                handler_subject(event, "audit"), queue="audit"
            ),
            "worker publishes a fake 'resolved' hook event": fakes_resolved_event_of(nc, "a1"),
            "worker emits as an agent": emits_as(nc, event, "a1"),
            "worker resolves a suspension": writes_suspension_of(js, "a1"),
        }.items():
            await refused(secure, client, probe, act)


async def test_approver_cannot_answer_as_another_approver(secure: Secure, as_: Connect) -> None:
    bob = await as_("approver-bob")
    kv = await bob.nc.jetstream(timeout=2).key_value("hookbus_suspensions")
    await refused(
        secure, bob, "approver bob writes alice's answer proof",
        lambda: kv.create(approval_answer_key("l", "a1", "alice"),
                          encode(ApprovalAnswer(choice="Allow", answered_by="alice"))),
    )  # fmt: skip


async def test_tenants_do_not_see_each_other(secure: Secure, as_: Connect) -> None:
    """Same agent name in two tenants (NATS accounts): nothing crosses."""
    t1, t2 = await as_("agent-a1", "T1"), await as_("agent-a1", "T2")
    got: list[bytes] = []
    arrived = anyio.Event()

    async def on(msg: Any) -> None:
        got.append(msg.data)
        arrived.set()

    await t2.nc.subscribe("hookbus.v1.suspension.a1.>", cb=on)
    await t2.nc.flush()
    await t1.nc.publish(suspension_event_subject("secret", "pending", "a1"), b"tenant one")
    await t1.nc.flush()
    await t2.nc.publish(suspension_event_subject("mine", "pending", "a1"), b"tenant two")
    with anyio.fail_after(5):
        await arrived.wait()
    await t1.nc.flush()
    await t2.nc.flush()
    observed = "not delivered" if got == [b"tenant two"] else f"DELIVERED {got}"
    secure.table.append(("agent reads another tenant's events", "refused", observed))
    assert got == [b"tenant two"]


# -- legitimate flows ---------------------------------------------------------------------------
async def _until_served(client: Client, subject: str) -> None:
    """Readiness from the agent's side: under load, a request sent right after the
    service's subscribe was flushed has once met "no responders"."""
    with anyio.fail_after(10):
        while True:
            try:
                await client.nc.request(subject, b'{"data": {}}', timeout=5)
                return
            except nats.errors.NoRespondersError:
                await anyio.sleep(0.1)


async def _service_emit(client: Client, command: str, **data: Any) -> dict[str, Any]:
    body = {"data": {"tool_name": "bash", "tool_input": {"command": command}, **data}}
    msg = await client.nc.request(emit_service_subject(EVENT, "a2"), json.dumps(body).encode(),
                                  timeout=30)  # fmt: skip
    return dict(json.loads(msg.data))


async def test_legitimate_flows_pass(secure: Secure, as_: Connect, event: str) -> None:
    worker, _ = await _system(as_, event)
    async with worker:  # the worker's declaration and queue subscription were allowed
        # an embedded agent decides for itself, with the worker's answers
        agent = await as_("agent-a1")
        async with HookDispatcher(agent.nc, agent_id="a1") as d:
            d.set_default_fields(session_id="s1")
            await d.refresh()
            assert d.list_handlers(event) == {event: ["security"]}
            denied = await d.emit(event, {"tool_name": "bash",
                                          "tool_input": {"command": "rm -rf /"}})  # fmt: skip
            assert (denied.action, denied.decided_by) == ("deny", "security")
            allowed = await d.emit(event, {"tool_name": "bash", "tool_input": {"command": "ls"}})
            assert allowed.action == "continue" and not allowed.failures
            # ... but may not ask for an approval: denied at once, saying where to ask
            with anyio.fail_after(10):
                asked = await d.emit(event, {"tool_name": "bash",
                                             "tool_input": {"command": "ask me"}})  # fmt: skip
            assert asked.action == "deny" and "service" in (asked.reason or ""), asked

            # the agent's own suspension, resolved by itself
            async with anyio.create_task_group() as tg:
                label = f"own-{uuid.uuid4().hex[:6]}"
                got: list[Any] = []

                async def wait() -> None:
                    got.append(await d.hook(label, timeout_s=15))

                tg.start_soon(wait)
                with anyio.fail_after(10):
                    while True:
                        record = await d.suspensions.get(label)
                        if record is not None:
                            break
                        await anyio.sleep(0.05)
                await d.resolve_hook(label, {"ok": True})
            assert got == [{"ok": True}]
            # it may get its own keys only, by direct get: never asks the stream's leader
            assert not d.suspensions.records.kv.reads_from_leader
        assert not [e for e in agent.errors if VIOLATION in e.lower()
                    and "hookbus_approvals" not in e], agent.errors  # fmt: skip

        # the service decides for a client agent: a deny, an approval answered by alice
        # with "Allow always", then the grant that answer made, and the audit trail
        service_client = await as_("dispatcher-dispatcher")
        decider = HookDispatcher(service_client.nc, audit=True)
        service = DispatcherService(decider, service_client.nc)
        await service.start()
        client = await as_("agent-a2")
        approver = await as_("approver-alice")
        try:
            await _until_served(client, emit_service_subject(event, "a2"))
            reply = await _service_emit(client, "rm -rf /")
            assert reply["result"]["action"] == "deny", reply
            assert reply["result"]["chained_data"]["agent_id"] == "a2"
            async with ApprovalsClient(approver.nc) as ad:
                events = await ad.events()
                out: list[dict[str, Any]] = []
                async with anyio.create_task_group() as tg:

                    async def ask() -> None:
                        out.append(await _service_emit(client, "ask always", session_id="s9"))

                    tg.start_soon(ask)
                    async for ev in events:
                        if ev.hook.status == "pending" and ev.hook.agent_id == "a2":
                            await ad.answer_approval(ev.hook.label, "Allow always",
                                                     approver="alice", agent_id="a2")  # fmt: skip
                            break
                await events.aclose()
            first = out[0]["result"]
            assert (first["action"], first["approved_by"]) == ("continue", "alice"), first
            again = (await _service_emit(client, "ask always", session_id="s9"))["result"]
            assert (again["action"], again["approved_by"]) == ("continue", "alice"), again
            assert "allowed always" in again["reason"], again
            # the service answers the services API with its endpoints and counts
            srv = f"$SRV.STATS.{DISPATCHER_SERVICE_NAME}.{service.service_id}"
            stats = json.loads((await client.nc.request(srv, b"", timeout=5)).data)
            emit = next(e for e in stats["endpoints"] if e["name"] == "emit")
            assert emit["num_requests"] >= 3 and emit["num_errors"] == 0, stats
            assert not [e for e in service_client.errors if VIOLATION in e.lower()]
            # the decider reads what it decides on from the streams' leaders
            assert decider.suspensions.records.kv.reads_from_leader
            assert not [e for e in approver.errors if VIOLATION in e.lower()], approver.errors
        finally:
            await service.stop()
        # the auditor reads the decision trail
        auditor = await as_("auditor-aud")
        last = await auditor.nc.jetstream(timeout=5).get_last_msg(
            "hookbus_decisions", "hookbus.v1.decisions.a2"
        )
        assert b"alice" in last.data, last.data
    secure.table.append(
        (
            "legitimate flows (emit, reply, declaration, own suspension, service emit, approval"
            " answered by an approver, grant from that answer, audit read, service stats)",
            "pass",
            "pass",
        )
    )


async def test_the_library_never_leaks_a_raw_error_on_a_refused_write(
    secure: Secure, as_: Connect
) -> None:
    """An agent's dispatcher asked to act for another agent refuses at once, naming it."""
    agent = await as_("agent-a1")
    async with HookDispatcher(agent.nc, agent_id="a1") as d:
        d.register(TOOL_PRE, lambda ev, data: None)
        with pytest.raises(Exception, match="acts as agent 'a1'"):
            await d.emit(TOOL_PRE, {"agent_id": "a2"})


# -- least privilege: each probe below was allowed before the roles were narrowed ---------------
async def test_no_role_but_the_admin_creates_or_changes_a_stream(
    secure: Secure, as_: Connect
) -> None:
    """A create request's body chooses the stream's subjects: a right to create one
    bucket was a right to create a stream over every agent's approval prompts."""
    body = json.dumps(
        {"name": "KV_hookbus_handlers", "subjects": ["hookbus.v1.suspension.>"],
         "allow_direct": True}
    ).encode()  # fmt: skip
    for stem in ("worker-sec", "dispatcher-dispatcher", "agent-a1", "approver-alice"):
        client = await as_(stem)
        for verb in ("CREATE", "UPDATE"):
            await refused(
                secure, client, f"{stem.split('-')[0]} {verb.lower()}s a stream over"
                " hookbus.v1.suspension.>",
                lambda client=client, verb=verb: client.nc.request(
                    f"$JS.API.STREAM.{verb}.KV_hookbus_handlers", body, timeout=2
                ),
            )  # fmt: skip


async def test_only_the_decider_creates_approvals_and_grants(secure: Secure, as_: Connect) -> None:
    """An agent cannot ask in a handler's name, an approver cannot grant what no approval
    asked for, nor fake a suspension event or resolve a record."""
    label = encode_token("approval:" + "ab" * 16)
    for stem, token in (("agent-a1", "a1"), ("agent-a2", "a2")):
        client = await as_(stem)
        js = client.nc.jetstream(timeout=2)
        await refused(
            secure, client, f"agent {token} creates an approval naming handler security",
            lambda js=js, token=token: js.publish(f"$KV.hookbus_approvals.{token}.{label}", b"{}"),
        )  # fmt: skip
    bob = await as_("approver-bob")
    js = bob.nc.jetstream(timeout=2)
    forged = grant_key("payments", "sess-G", EVENT, "security", "transfer")
    await refused(secure, bob, "approver writes an 'Allow always' grant no approval asked for",
                  lambda: js.publish(f"$KV.hookbus_approvals.{forged}", b"{}"))  # fmt: skip
    await refused(
        secure, bob, "approver publishes a fake 'resolved' suspension event",
        lambda: bob.nc.publish(suspension_event_subject("l", "resolved", "a1"), b"{}"),
    )  # fmt: skip
    await refused(
        secure, bob, "approver resolves a suspension record itself",
        lambda: js.publish(f"$KV.hookbus_suspensions.{suspension_key('l', 'a1')}", b"{}"),
    )  # fmt: skip
    await refused(
        secure, bob, "approver resolves an approval record itself",
        lambda: js.publish(f"$KV.hookbus_approvals.a1.{label}", b"{}"),
    )  # fmt: skip


async def test_a_worker_is_bound_to_its_events(secure: Secure, as_: Connect) -> None:
    """The tool:pre worker cannot declare or serve its handler name on other events (it
    would read every prompt and rewrite tool output)."""
    client = await as_("worker-sec")
    nc, js = client.nc, client.nc.jetstream(timeout=2)
    for other in ("prompt:submit", "tool:post"):
        await refused(
            secure, client, f"tool:pre worker declares security on {other}",
            lambda other=other: js.publish(
                f"$KV.hookbus_handlers.{handler_key(other, 'security')}", b"{}"
            ),
        )  # fmt: skip
        await refused(
            secure, client, f"tool:pre worker serves security on {other}",
            lambda other=other: nc.subscribe(handler_subject(other, "security"), queue="security"),
        )  # fmt: skip
        await refused(
            secure, client, f"tool:pre worker hears {other}'s emit_and_collect",
            lambda other=other: nc.subscribe(
                f"hookbus.v1.collect.{encode_token(other)}", queue="security"
            ),
        )  # fmt: skip


async def test_a_worker_answers_one_request_once(secure: Secure, as_: Connect) -> None:
    """A worker serving one handler per event may answer each request once: a second
    answer to the same reply subject is refused."""
    worker_client = await as_("worker-sec")
    service = await as_("dispatcher-dispatcher")

    async def twice(msg: Any) -> None:
        await msg.respond(b"first")
        await msg.respond(b"second")

    # a flush must follow the SUB before it (nats-py writes its PING ahead of the queued
    # SUB otherwise: the request could meet "no responders"), as a hookbus worker's does
    harden_connection(worker_client.nc)
    await worker_client.nc.subscribe(handler_subject(EVENT, "security"), queue="security",
                                     cb=twice)  # fmt: skip
    await worker_client.nc.flush()
    inbox = service.nc.new_inbox()
    replies = await service.nc.subscribe(inbox)
    await service.nc.publish(handler_subject(EVENT, "security"), b"{}", reply=inbox)
    got = [(await replies.next_msg(timeout=5)).data]
    with contextlib.suppress(nats.errors.TimeoutError):
        got.append((await replies.next_msg(timeout=0.5)).data)
    seen = await worker_client.violation(0)
    secure.table.append(("worker answers one request twice", "refused", seen or "ALLOWED"))
    assert got == [b"first"] and seen is not None


async def test_no_identity_but_the_service_exhausts_or_drops_consumers(
    secure: Secure, as_: Connect
) -> None:
    """An agent may hold consumers only in its own slots (8 per stream), with filters
    within its own keys, and delete only those; a dispatcher then still starts."""
    a1 = await as_("agent-a1")
    a1_key = secure.context("T1", "agent-a1")["inbox_prefix"].removeprefix("_INBOX_")
    service_key = secure.context("T1", "dispatcher-dispatcher")["inbox_prefix"][7:]
    nc = a1.nc
    inbox = nc.new_inbox()
    await nc.subscribe(inbox)

    def create(subject: str, name: str | None, filter_subject: str) -> Any:
        config: dict[str, Any] = {"deliver_subject": inbox, "ack_policy": "none",
                                  "inactive_threshold": 3600 * 10**9,
                                  "filter_subject": filter_subject}  # fmt: skip
        if name:
            config["name"] = name
        stream = subject.split(".")[4]
        body = json.dumps({"stream_name": stream, "config": config}).encode()
        return nc.request(subject, body, timeout=2)

    own = "$KV.hookbus_suspensions.a1.>"
    await refused(secure, a1, "agent creates an unnamed consumer",
                  lambda: create("$JS.API.CONSUMER.CREATE.KV_hookbus_handlers", None,
                                 "$KV.hookbus_handlers.>"))  # fmt: skip
    await refused(
        secure, a1, "agent creates a consumer outside its slots",
        lambda: create(f"$JS.API.CONSUMER.CREATE.KV_hookbus_suspensions.evil.{own}", "evil", own),
    )  # fmt: skip
    other = "$KV.hookbus_suspensions.a2.>"
    await refused(
        secure, a1, "agent watches another agent's keys in its own slot",
        lambda: create(f"$JS.API.CONSUMER.CREATE.KV_hookbus_suspensions.{a1_key}_0.{other}",
                       f"{a1_key}_0", other),
    )  # fmt: skip
    await refused(
        secure, a1, "agent deletes the service's consumer",
        lambda: nc.request(
            f"$JS.API.CONSUMER.DELETE.KV_hookbus_handlers.{service_key}_0", b"", timeout=2
        ),
    )  # fmt: skip
    # it fills all its slots on both streams, each with a 10 h inactive threshold
    for i in range(8):
        for stream, filt in (("KV_hookbus_suspensions", own),
                             ("KV_hookbus_handlers", "$KV.hookbus_handlers.>")):  # fmt: skip
            reply = await create(f"$JS.API.CONSUMER.CREATE.{stream}.{a1_key}_{i}.{filt}",
                                 f"{a1_key}_{i}", filt)  # fmt: skip
            assert "error" not in json.loads(reply.data), reply.data
    await refused(
        secure, a1, "agent creates a 9th consumer",
        lambda: create(f"$JS.API.CONSUMER.CREATE.KV_hookbus_suspensions.{a1_key}_8.{own}",
                       f"{a1_key}_8", own),
    )  # fmt: skip
    service = await as_("dispatcher-dispatcher")
    with anyio.fail_after(20):
        async with HookDispatcher(service.nc) as d:  # registry watch, suspensions, approvals
            await d.refresh()
    secure.table.append(("a dispatcher starts beside an agent holding all its slots", "pass",
                         "pass"))  # fmt: skip
    for i in range(8):
        for stream in ("KV_hookbus_suspensions", "KV_hookbus_handlers"):
            await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{a1_key}_{i}", b"", timeout=2)


async def test_buckets_and_accounts_carry_limits(secure: Secure, as_: Connect) -> None:
    """Storage is bounded: every bucket (made by `hookbus auth provision`) has a byte
    limit and a value size limit, and the tenant's account has JetStream limits."""
    admin = await as_("admin-admin")
    js = admin.nc.jetstream(timeout=5)
    for bucket in ("hookbus_handlers", "hookbus_suspensions", "hookbus_approvals",
                   "hookbus_leases"):  # fmt: skip
        info = await js.stream_info(f"KV_{bucket}")
        assert (info.config.max_bytes or -1) > 0 and (info.config.max_msg_size or -1) > 0, bucket
    limits = (await js.account_info()).limits
    assert limits.max_consumers > 0 and limits.max_streams > 0 and limits.max_storage > 0
    secure.table.append(("buckets and account without storage limits", "bounded", "bounded"))


async def test_an_identity_refused_a_leader_read_falls_back_to_direct_gets(
    secure: Secure, as_: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    """A bucket opened to read from its stream's leader, by an identity whose NATS user may
    not (an agent may get only its own keys; an identity issued before hookbus read from
    leaders): the first refusal turns its gets into direct gets, said once on the log, and
    the read is answered (here: its own key, never written)."""
    agent = await as_("agent-a1")
    kv = await existing_key_value(agent.nc, SUSPENSIONS_BUCKET)
    assert kv.reads_from_leader
    with caplog.at_level(logging.WARNING, logger="hookbus"):
        for _ in range(2):
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await kv.get(suspension_key(f"never-{uuid.uuid4().hex[:6]}", "a1"))
    assert not kv.reads_from_leader
    said = [r for r in caplog.records if "may not read from the stream's leader" in r.message]
    assert len(said) == 1, said
