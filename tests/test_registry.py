"""The handler registry nobody can corrupt by accident, against a real nats-server.

Records are written straight into the bucket (as a careless or hostile writer would), and
every test asserts the decision an emit returns. The records of the first tests are spelled
out as JSON and literal keys, so the same tests run against an older hookbus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from _declarations import declaration
from _serving import serving
from conftest import Connect
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from hookbus._core.buckets import handlers_bucket_config
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HANDLERS_BUCKET,
    HandlerDeclaration,
    HookReply,
    HookResult,
    encode,
    encode_token,
    handler_key,
    handler_subject,
)

pytestmark = pytest.mark.anyio


async def bucket(nc: NATS) -> KeyValue:
    js = nc.jetstream()
    try:
        return await js.create_key_value(config=handlers_bucket_config())
    except nats.js.errors.BadRequestError:
        return await js.key_value(HANDLERS_BUCKET)


def names(d: HookDispatcher, event: str) -> list[str]:
    return d.list_handlers(event).get(event, [])


async def until(check: Callable[[], bool], what: str) -> None:
    """Poll `check` (the routing table has no change event) for at most 10 s."""
    with anyio.fail_after(10, shield=False):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def sentinel(kv: KeyValue, d: HookDispatcher, event: str) -> None:
    """Write a valid declaration after the records under test and wait until the dispatcher
    routes it: the watch has then processed everything written before it."""
    name = f"sentinel{uuid.uuid4().hex[:6]}"
    decl = declaration(event, name, timeout_s=0.5, priority=99)
    await kv.put(handler_key(event, name), encode(decl))
    await until(lambda: name in names(d, event), f"sentinel {name}")
    await kv.delete(handler_key(event, name))
    await until(lambda: name not in names(d, event), f"sentinel {name} gone")


async def deny_responder(nc: NATS, event: str, name: str) -> None:
    """A raw replica of (event, name) on its derived subject that denies everything."""

    async def respond(msg: Msg) -> None:
        result = HookResult(action="deny", reason="raw says no")
        await msg.respond(encode(HookReply(handler=name, result=result)))

    await nc.subscribe(handler_subject(event, name), queue=encode_token(name), cb=respond)
    await nc.flush()


# -- a value is bound to its key; subjects are derived ------------------------------------
async def eavesdropper(connect: Connect) -> tuple[NATS, str, list[bytes]]:
    """An attacker's connection listening on an inbox of its own: (the connection, the
    inbox, what arrives there)."""
    attacker = await connect()
    inbox = f"attacker.inbox.{uuid.uuid4().hex}"
    stolen: list[bytes] = []

    async def steal(msg: Msg) -> None:
        stolen.append(msg.data)

    await attacker.subscribe(inbox, cb=steal)
    await attacker.flush()
    return attacker, inbox, stolen


async def test_value_under_another_key_routes_nothing(
    nc: NATS, connect: Connect, event: str
) -> None:
    attacker, inbox, stolen = await eavesdropper(connect)
    kv = await bucket(nc)
    other = f"A{uuid.uuid4().hex[:8]}"
    value = {"event": event, "name": "x", "subject": inbox, "timeout_s": 0.3}
    async with HookDispatcher(await connect()) as d:
        await kv.put(f"{other}.x", json.dumps(value).encode())
        await sentinel(kv, d, event)
        result = await d.emit(event, {"tool_name": "bash", "tool_input": {"secret": 1}})
        await attacker.flush()
        assert stolen == []
        assert result.action == "continue" and result.failures == []
        assert names(d, event) == [] and names(d, other) == []
        await kv.delete(f"{other}.x")


async def test_foreign_subject_under_the_right_key_is_refused(
    nc: NATS, connect: Connect, event: str
) -> None:
    attacker, inbox, stolen = await eavesdropper(connect)
    kv = await bucket(nc)
    value = {"event": event, "name": "x", "subject": inbox, "timeout_s": 0.3}
    async with HookDispatcher(await connect()) as d:
        await kv.put(handler_key(event, "x"), json.dumps(value).encode())
        await sentinel(kv, d, event)
        result = await d.emit(event, {"tool_name": "bash"})
        await attacker.flush()
        assert stolen == []
        assert names(d, event) == []
        assert result.action == "continue"


async def test_empty_subject_is_derived_and_routes(nc: NATS, connect: Connect, event: str) -> None:
    await deny_responder(await connect(), event, "guard")
    kv = await bucket(nc)
    value = {"event": event, "name": "guard", "subject": "", "failure_policy": "deny"}
    async with HookDispatcher(await connect()) as d:
        await kv.put(handler_key(event, "guard"), json.dumps(value).encode())
        await until(lambda: names(d, event) == ["guard"], "guard routed")
        result = await d.emit(event, {"tool_name": "bash"})
        assert (result.action, result.decided_by, result.reason) == ("deny", "guard", "raw says no")


# -- a complete resync sees deletes --------------------------------------------------------
async def test_resync_removes_a_route_whose_delete_the_watch_missed(
    nc: NATS, connect: Connect, event: str
) -> None:
    kv = await bucket(nc)
    decl = declaration(event, "gate", failure_policy="deny", timeout_s=0.5)
    async with HookDispatcher(await connect()) as d:
        await kv.put(handler_key(event, "gate"), encode(decl))
        await until(lambda: names(d, event) == ["gate"], "gate routed")
        denied = await d.emit(event, {})
        assert denied.action == "deny"
        assert [(f.handler, f.kind) for f in denied.failures] == [("gate", "no_responders")]
        router = getattr(d, "_router", d)
        await router._watch.stop()  # the watch misses what follows
        await kv.delete(handler_key(event, "gate"))
        assert names(d, event) == ["gate"]  # nothing told the dispatcher yet
        await d.refresh()
        assert names(d, event) == []
        result = await d.emit(event, {})
        assert result.action == "continue" and result.failures == []


# -- one bad record is skipped, never fatal -------------------------------------------------
async def test_invalid_utf8_record_neither_freezes_the_watch_nor_blocks_a_start(
    nc: NATS, connect: Connect, event: str
) -> None:
    kv = await bucket(nc)
    bad = b'{"event": "' + event.encode() + b'", "name": "bad\xff\xfe"}'
    try:
        await invalid_utf8_record(kv, connect, event, bad)
    finally:  # other tests share the bucket
        await kv.delete(handler_key(event, "bad"))
        await kv.delete(handler_key(event, "gate"))


async def invalid_utf8_record(kv: KeyValue, connect: Connect, event: str, bad: bytes) -> None:
    async with HookDispatcher(await connect()) as d:
        await kv.put(handler_key(event, "bad"), bad)
        decl = declaration(event, "gate", failure_policy="deny", timeout_s=0.5)
        await kv.put(handler_key(event, "gate"), encode(decl))  # added after the bad record
        await until(lambda: "gate" in names(d, event), "gate routed after the bad record")
        assert names(d, event) == ["gate"]
        assert (await d.emit(event, {})).action == "deny"
    with anyio.fail_after(15):
        async with HookDispatcher(await connect(), strict_events=True) as fresh:
            assert names(fresh, event) == ["gate"]
            assert (await fresh.emit(event, {})).action == "deny"


@pytest.mark.parametrize("field", ["subject", "name"])
async def test_oversized_record_does_not_close_the_dispatchers_connection(
    nc: NATS, connect: Connect, event: str, field: str
) -> None:
    await deny_responder(await connect(), event, "guard")
    kv = await bucket(nc)
    value: dict[str, Any] = {"event": event, "name": "huge", "timeout_s": 0.3}
    value[field] = "hookbus.v1.handler." + "a" * 5000 if field == "subject" else "n" * 5000
    dnc = await connect(max_reconnect_attempts=1)
    async with HookDispatcher(dnc) as d:
        await kv.put(handler_key(event, "huge"), json.dumps(value).encode())
        await sentinel(kv, d, event)
        first = await d.emit(event, {"tool_name": "bash"})
        guard = {"event": event, "name": "guard", "failure_policy": "deny", "timeout_s": 2}
        await kv.put(handler_key(event, "guard"), json.dumps(guard).encode())
        await until(lambda: "guard" in names(d, event), "guard routed")
        second = await d.emit(event, {"tool_name": "bash"})
        assert dnc.is_connected
        assert first.action == "continue" and first.failures == []
        assert (second.action, second.decided_by) == ("deny", "guard")
    await kv.delete(handler_key(event, "huge"))
    await kv.delete(handler_key(event, "guard"))


@pytest.mark.parametrize(
    "raw_timeout, routed",
    [("1e9", 60.0), ("1e999", None), ("-1", None), ("0", None), ('"5"', None), ("2.5", 2.5)],
)
async def test_timeout_is_bounded(
    nc: NATS, connect: Connect, event: str, raw_timeout: str, routed: float | None
) -> None:
    kv = await bucket(nc)
    raw = f'{{"event": "{event}", "name": "slow", "timeout_s": {raw_timeout}}}'.encode()
    async with HookDispatcher(await connect()) as d:
        await kv.put(handler_key(event, "slow"), raw)
        await sentinel(kv, d, event)
        routes = {r.name: r.timeout_s for r in d._table.routes(event)}
        assert routes == ({} if routed is None else {"slow": routed})
    await kv.delete(handler_key(event, "slow"))


# -- required handlers ---------------------------------------------------------------------
async def test_required_handler_absent_denies_until_the_requirement_is_removed(
    nc: NATS, connect: Connect, event: str
) -> None:
    kv = await bucket(nc)
    key = f"_required.{encode_token(event)}.security_policy"
    async with HookDispatcher(await connect()) as d:
        await kv.put(key, json.dumps({"event": event, "name": "security_policy"}).encode())
        await until(lambda: "security_policy" in names(d, event), "requirement routed")
        denied = await d.emit(event, {"tool_name": "bash"})
        assert denied.action == "deny"
        assert [(f.handler, f.kind, f.policy) for f in denied.failures] == [
            ("security_policy", "no_responders", "deny")
        ]
        await kv.delete(key)
        await until(lambda: names(d, event) == [], "requirement removed")
        result = await d.emit(event, {"tool_name": "bash"})
        assert result.action == "continue" and result.failures == []


async def test_required_handler_api_and_a_declaration_taking_its_place(
    nc: NATS, connect: Connect, event: str
) -> None:
    from hookbus.dispatcher import require_handler, unrequire_handler

    req = await require_handler(nc, event, "policy", priority=5, timeout_s=1e9)
    assert (req.failure_policy, req.timeout_s) == ("deny", 60.0)
    async with HookDispatcher(await connect(), strict_events=True) as d:
        assert names(d, event) == ["policy"]  # the event is known: it has a requirement
        assert (await d.emit(event, {})).action == "deny"

        async def allow(event_: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="continue")

        wnc = await connect()
        async with serving(wnc, (event, allow, {"name": "policy", "failure_policy": "deny"})):
            await until(lambda: d._table.routes(event)[0].priority == 0, "declared")
            result = await d.emit(event, {})
            assert result.action == "continue" and result.failures == []
        assert await unrequire_handler(nc, event, "policy") is True
        assert await unrequire_handler(nc, event, "policy") is False


# -- conflicting declarations ---------------------------------------------------------------
async def allow(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="continue")


SECURITY = {"priority": 10, "tool_filter": ["bash", "shell*"], "failure_policy": "deny"}
LAX = {"priority": 0, "tool_filter": None, "failure_policy": "ignore"}


async def test_second_worker_with_other_settings_is_refused(
    nc: NATS, connect: Connect, event: str
) -> None:
    from hookbus.workers import HookWorker

    async with serving(await connect(), (event, allow, {"name": "security", **SECURITY})):
        intruder = HookWorker(await connect())
        intruder.add_handler(event, allow, name="security", **LAX)
        with pytest.raises(Exception) as caught:  # HandlerConflictError (imported lazily)
            await intruder.start()
        assert type(caught.value).__name__ == "HandlerConflictError"
        message = str(caught.value)
        assert "failure_policy: live 'deny', declared 'ignore'" in message
        assert "priority: live 10, declared 0" in message and "replace=True" in message
        entry = await (await bucket(nc)).get(handler_key(event, "security"))
        live = json.loads(entry.value)
        assert (live["failure_policy"], live["priority"]) == ("deny", 10)
        assert live["tool_filter"] == ["bash", "shell*"]
        async with HookDispatcher(await connect()) as d:
            route = d._table.routes(event)[0]
            assert (route.failure_policy, route.priority) == ("deny", 10)
            await intruder.shutdown()
        assert intruder.handled == 0


async def test_replica_with_identical_settings_and_explicit_replace(
    nc: NATS, connect: Connect, event: str
) -> None:
    from hookbus.workers import HookWorker

    opts = {"name": "security", **SECURITY}
    async with serving(await connect(), (event, allow, opts)):
        async with serving(await connect(), (event, allow, opts)):  # a second replica
            pass
        successor = HookWorker(await connect(), replace=True)
        successor.add_handler(event, allow, name="security", **LAX)
        async with successor:
            entry = await (await bucket(nc)).get(handler_key(event, "security"))
            assert json.loads(entry.value).get("failure_policy", "ignore") == "ignore"
        per_handler = HookWorker(await connect())
        per_handler.add_handler(event, allow, name="security", replace=True, **SECURITY)
        async with per_handler:
            entry = await (await bucket(nc)).get(handler_key(event, "security"))
            assert json.loads(entry.value)["failure_policy"] == "deny"


async def test_a_stopped_workers_declaration_is_taken_over_but_a_live_ones_is_not(
    nc: NATS, connect: Connect, event: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker restarted with one setting changed: refused while a replica of the old
    declaration is live (the message says how many, and what would change), taken over
    with a WARNING naming each difference once none is."""
    from hookbus.schemas import HandlerConflictError
    from hookbus.workers import HookWorker

    old = {"name": "security", **SECURITY, "timeout_s": 2.0}
    new = {"name": "security", **SECURITY, "timeout_s": 7.5, "failure_policy": "ignore"}
    async with serving(await connect(), (event, allow, old)):
        restarted = HookWorker(await connect())
        restarted.add_handler(event, allow, **new)
        with pytest.raises(HandlerConflictError) as caught:
            await restarted.start()
        message = str(caught.value)
        assert "1 replica(s) of it live now" in message and "--replace" in message
        assert "failure_policy: live 'deny', declared 'ignore'" in message
        assert "timeout_s: live 2.0, declared 7.5" in message
        await restarted.shutdown()
    entry = await (await bucket(nc)).get(handler_key(event, "security"))
    assert (json.loads(entry.value)["timeout_s"], json.loads(entry.value)["failure_policy"]) == (
        2.0,
        "deny",
    )

    caplog.set_level("WARNING", logger="hookbus.workers")
    restarted = HookWorker(await connect())  # the old worker stopped: none live
    restarted.add_handler(event, allow, **new)
    async with restarted:
        entry = await (await bucket(nc)).get(handler_key(event, "security"))
        live = json.loads(entry.value)
        assert (live["timeout_s"], live.get("failure_policy", "ignore")) == (7.5, "ignore")
        async with HookDispatcher(await connect()) as d:
            await until(lambda: d._table.routes(event)[0].timeout_s == 7.5, "taken over")
            assert (await d.emit(event, {})).action == "continue"
    warned = [r.getMessage() for r in caplog.records if "taking over handler" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "no replica of it live" in warned[0]
    assert "failure_policy: live 'deny', declared 'ignore'" in warned[0]
    assert "timeout_s: live 2.0, declared 7.5" in warned[0]


async def test_two_racing_workers_cannot_both_win(connect: Connect, event: str) -> None:
    from hookbus.schemas import HandlerConflictError
    from hookbus.workers import HookWorker

    workers = []
    for options in (SECURITY, LAX, {**LAX, "priority": 3}):
        w = HookWorker(await connect())
        w.add_handler(event, allow, name="race", **options)
        workers.append(w)
    outcomes = await asyncio.gather(*(w.start() for w in workers), return_exceptions=True)
    try:
        winners = [o for o in outcomes if o is None]
        assert len(winners) == 1, outcomes
        assert all(isinstance(o, HandlerConflictError) for o in outcomes if o is not None)
    finally:
        for w in workers:
            await w.shutdown()


async def test_bad_record_is_overwritten_by_a_valid_declaration(
    nc: NATS, connect: Connect, event: str
) -> None:
    kv = await bucket(nc)
    await kv.put(handler_key(event, "fixme"), b"\xff not json")
    async with serving(await connect(), (event, allow, {"name": "fixme"})):
        entry = await kv.get(handler_key(event, "fixme"))
        assert json.loads(entry.value)["name"] == "fixme"


# -- liveness -----------------------------------------------------------------------------
async def test_live_replicas_are_listed_and_leave_on_shutdown(
    nc: NATS, connect: Connect, event: str
) -> None:
    from hookbus.dispatcher import live_handlers

    async with serving(
        await connect(), (event, allow, {"name": "a"}), (event, allow, {"name": "b"})
    ):
        async with serving(await connect(), (event, allow, {"name": "a"})):
            live = await live_handlers(nc, timeout_s=0.5)
            assert len(live[(event, "a")]) == 2
            assert len(live[(event, "b")]) == 1
            ids = {r.service_id for r in live[(event, "a")]}
            assert len(ids) == 2
        live = await live_handlers(nc, timeout_s=0.5)
        assert len(live[(event, "a")]) == 1
    live = await live_handlers(nc, timeout_s=0.5)
    assert (event, "a") not in live and (event, "b") not in live


async def test_worker_answers_the_services_api(nc: NATS, connect: Connect, event: str) -> None:
    from hookbus.schemas import WORKER_SERVICE_NAME, parse_served_handlers

    async with serving(await connect(), (event, allow, {"name": "a"})):
        info = json.loads((await nc.request(f"$SRV.INFO.{WORKER_SERVICE_NAME}", b"")).data)
        stats = json.loads((await nc.request(f"$SRV.STATS.{WORKER_SERVICE_NAME}", b"")).data)
        assert info["name"] == stats["name"] == WORKER_SERVICE_NAME
        # other workers of the session may answer first: ask this one by id
        mine = [
            json.loads((await nc.request(f"$SRV.INFO.{WORKER_SERVICE_NAME}.{i}", b"")).data)
            for i in {info["id"]}
        ]
        assert all("handlers" in m["metadata"] for m in mine)
        assert all(isinstance(parse_served_handlers(m["metadata"]["handlers"]), list) for m in mine)


# -- registration through a JetStream outage ----------------------------------------------
@pytest.mark.faults
async def test_worker_registration_rides_out_a_jetstream_without_quorum(tmp_path: Any) -> None:
    """Two of three cluster nodes go away, so JetStream has no quorum (as during a leader
    election, only longer: more than nats-py's 5 s request timeout) while core NATS still
    works; a worker started meanwhile keeps retrying and registers once they are back.

    The record is read from the stream's leader: a direct get may be answered by a replica
    that came back a moment ago and has not applied the write yet."""
    from _cluster import Cluster

    from hookbus.workers import HookWorker

    event = f"test:{uuid.uuid4().hex[:10]}"
    cluster = Cluster(tmp_path / "cluster").start()
    conn: NATS | None = None
    workers: list[Any] = []
    starting: asyncio.Task[None] | None = None
    try:
        await cluster.wait_ready()
        first = cluster.nodes[0]
        conn = await nats.connect(first.url, max_reconnect_attempts=-1)
        seed = HookWorker(conn, bucket_replicas=3)
        seed.add_handler(event, allow, name="seed")
        async with seed:  # the bucket exists (R3) before the outage
            pass
        for node in cluster.nodes[1:]:
            node.stop()
        w = HookWorker(conn, bucket_replicas=3)  # retries for 30 s by default
        workers.append(w)
        w.add_handler(event, allow, name="late", failure_policy="deny")
        starting = asyncio.create_task(w.start())
        await asyncio.sleep(6.5)  # the outage itself: nothing to wait on
        assert not starting.done()
        for node in cluster.nodes[1:]:
            node.start()
        with anyio.fail_after(40):
            await starting
        stored = await conn.jetstream().get_last_msg(
            f"KV_{HANDLERS_BUCKET}", f"$KV.{HANDLERS_BUCKET}.{handler_key(event, 'late')}"
        )
        assert json.loads(stored.data or b"{}")["failure_policy"] == "deny"
    finally:
        if starting is not None and not starting.done():
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        for w in workers:
            await w.shutdown()
        if conn is not None:
            await conn.close()
        cluster.stop()


# -- the CLI -------------------------------------------------------------------------------
async def hookbus(*args: str) -> Any:
    """Run the `hookbus` command in a subprocess (as a user would)."""
    import sys

    return await anyio.run_process(
        [sys.executable, "-m", "hookbus.cli", *args], check=False, stdin=None
    )


async def test_cli_shows_replicas_and_manages_requirements(
    nc: NATS, connect: Connect, nats_url: str, event: str
) -> None:
    async with serving(await connect(), (event, allow, {"name": "seen", "priority": 2})):
        async with serving(await connect(), (event, allow, {"name": "seen", "priority": 2})):
            listed = await hookbus("handlers", "--url", nats_url, "--event", event, "--json")
            table = await hookbus("handlers", "--url", nats_url, "--event", event)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["name"], r["declared"], len(r["replicas"])) for r in rows] == [("seen", True, 2)]
    assert rows[0]["last_seen"] is not None
    line = next(x for x in table.stdout.decode().splitlines() if event in x)
    assert "seen" in line and " 2 " in line and "s ago" in line

    req = await hookbus("handlers", "require", event, "security_policy", "--url", nats_url)
    assert req.returncode == 0, req.stderr
    async with HookDispatcher(await connect()) as d:
        denied = await d.emit(event, {"tool_name": "bash"})
        assert denied.action == "deny" and denied.decided_by == "security_policy"
        assert [f.kind for f in denied.failures] == ["no_responders"]
        listed = await hookbus("handlers", "--url", nats_url, "--event", event, "--json")
        rows = {r["name"]: r for r in json.loads(listed.stdout)}
        assert rows["security_policy"]["declared"] is False
        assert rows["security_policy"]["required"]["failure_policy"] == "deny"
        assert rows["seen"]["replicas"] == []
        gone = await hookbus("handlers", "unrequire", event, "security_policy", "--url", nats_url)
        assert gone.returncode == 0, gone.stderr
        await until(lambda: "security_policy" not in names(d, event), "requirement removed")
        assert (await d.emit(event, {"tool_name": "bash"})).action == "continue"
    again = await hookbus("handlers", "unrequire", event, "security_policy", "--url", nats_url)
    assert again.returncode == 1
    assert f"{event} does not require security_policy" in again.stderr.decode()


@pytest.mark.faults
async def test_cli_reports_an_unreadable_registry_in_one_line(tmp_path: Any) -> None:
    """A server without JetStream answers no KV call; after retrying, `hookbus handlers`
    prints one error line, no traceback."""
    from _cluster import free_ports

    from hookbus.cli import find_nats_server

    port = free_ports(1)[0]
    server = await anyio.open_process([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)])
    try:
        url = f"nats://127.0.0.1:{port}"
        with anyio.fail_after(10):
            while True:  # wait until it accepts connections
                try:
                    probe = await nats.connect(url, max_reconnect_attempts=0, connect_timeout=1)
                    await probe.close()
                    break
                except Exception:
                    await anyio.sleep(0.05)
        result = await hookbus("handlers", "--url", url)
        err = result.stderr.decode()
        assert result.returncode == 1, err
        assert "Traceback" not in err
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: cannot read the handler registry")
    finally:
        server.terminate()
        await server.wait()


# -- validation never raises anything but BadRequestError ---------------------------------
def _hostile_values() -> Any:
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=50),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
        max_leaves=20,
    )
    fields = st.fixed_dictionaries(
        {},
        optional={
            "event": st.sampled_from(["tool:pre", "x"]) | st.text(max_size=300),
            "name": st.sampled_from(["x", "guard"]) | st.text(max_size=300),
            "priority": st.integers() | json_values,
            "timeout_s": st.floats() | st.integers() | json_values,
            "tool_filter": st.lists(st.text(max_size=250), max_size=70) | json_values,
            "failure_policy": st.sampled_from(["deny", "ignore", "maybe"]),
            "subject": st.text(max_size=50),
            "queue_group": st.text(max_size=20),
        },
    )
    as_json = fields.map(lambda d: json.dumps(d, allow_nan=True).encode())
    return as_json | st.binary(max_size=300)


def test_any_record_is_accepted_bound_to_its_key_or_refused() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hookbus._core.declarations import check_declaration, check_required
    from hookbus.schemas import (
        MAX_HANDLER_TIMEOUT_S,
        BadRequestError,
    )

    keys = st.sampled_from(["tool=3Apre.x", "x.guard", "_required.tool=3Apre.x", "bad key", ""])

    @settings(max_examples=400, deadline=None)
    @given(key=keys, value=_hostile_values())
    def check(key: str, value: bytes) -> None:
        for fn in (check_declaration, check_required):
            try:
                record = fn(key, value)
            except BadRequestError:
                continue
            assert key.endswith(f"{encode_token(record.event)}.{encode_token(record.name)}")
            assert 0 < record.timeout_s <= MAX_HANDLER_TIMEOUT_S
            if isinstance(record, HandlerDeclaration):
                assert record.subject == handler_subject(record.event, record.name)

    check()


def test_a_change_applied_from_the_cache_routes_as_the_record_checked_afresh() -> None:
    """A change's route is checked once per process and shared by its dispatchers: each
    of two tables applying the same bytes (the second from the cache) gets the routes,
    or the refusal, of the record checked afresh, and a refusal is reported to both."""
    import dataclasses

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from hookbus.dispatcher._registry_watch import RegistryRead, apply_entry, classify
    from hookbus.dispatcher._route_table import RoutingTable

    keys = st.sampled_from(["tool=3Apre.x", "x.guard", "_required.tool=3Apre.x", "x.y"])

    def fields(table: RoutingTable, event: str) -> list[dict[str, Any]]:
        return [
            {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "_filter"}
            for r in table.routes(event)
        ]

    @settings(max_examples=300, deadline=None)
    @given(key=keys, value=_hostile_values())
    def check(key: str, value: bytes) -> None:
        event = "tool:pre" if key.endswith("tool=3Apre.x") else "x"
        read = RegistryRead()
        classify(read, key, value)
        reference = RoutingTable()
        for decl in read.declarations.values():
            reference.put_remote(decl)
        for req in read.required.values():
            reference.put_required(req)
        for _ in range(2):
            table, reports = RoutingTable(), []
            apply_entry(table, {}, reports.append, key, bytes(value), False)
            assert fields(table, event) == fields(reference, event)
            assert bool(reports) == bool(read.rejected)

    check()


async def test_cli_worker_conflict_is_one_error_line(
    nc: NATS, connect: Connect, nats_url: str, event: str, tmp_path: Any
) -> None:
    module = tmp_path / "lax_worker.py"
    module.write_text(
        "from hookbus.workers import HookWorker\n"
        "worker = HookWorker()\n"
        f"@worker.handler({event!r}, name='security', failure_policy='ignore')\n"
        "async def security(event, data):\n"
        "    return None\n"
    )
    async with serving(await connect(), (event, allow, {"name": "security", **SECURITY})):
        with anyio.fail_after(30):  # a worker that started would serve until killed
            result = await hookbus("worker", f"{module}:worker", "--url", nats_url)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert "Traceback" not in err
    assert "Error: handler 'security'" in err and "--replace" in err
    entry = await (await bucket(nc)).get(handler_key(event, "security"))
    assert json.loads(entry.value)["failure_policy"] == "deny"


# -- following the registry ---------------------------------------------------------------
async def test_an_agent_that_cannot_follow_an_empty_registry_does_not_start(
    embedded_server: Any,
) -> None:
    """The handlers stream takes one consumer (as a server at its consumer limit does): the
    first agent's watch holds it. A second agent started while the registry is empty must
    not start, since it would never see a handler declared later: with the first agent
    denying ``rm -rf /`` by then, the second would let it through."""
    from nats.js.api import DiscardPolicy, StreamConfig

    from hookbus.schemas import HookbusError
    from hookbus.workers import HookWorker

    url = embedded_server.url
    event = f"test:{uuid.uuid4().hex[:10]}"
    admin = await nats.connect(url)
    conns = [admin]
    try:
        kv_config = handlers_bucket_config()
        await admin.jetstream().add_stream(
            StreamConfig(
                name=f"KV_{HANDLERS_BUCKET}", subjects=[f"$KV.{HANDLERS_BUCKET}.>"],
                max_msgs_per_subject=kv_config.history, discard=DiscardPolicy.NEW,
                allow_rollup_hdrs=True, deny_delete=True, allow_direct=True, max_consumers=1,
            )
        )  # fmt: skip
        conns += [await nats.connect(url) for _ in range(3)]
        first = HookDispatcher(conns[1])
        await first.start()  # its watch holds the one consumer
        late = HookDispatcher(conns[2])
        try:
            with pytest.raises(HookbusError, match="handler registry") as refused:
                await late.start()
            print(f"refused: {refused.value}")
        finally:
            await late.close()

        async def guard(event: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="deny", reason="no")

        worker = HookWorker(conns[3])
        worker.add_handler(event, guard, name="guard", failure_policy="deny")
        async with worker:
            with anyio.fail_after(10):
                while not first.routes(event):  # noqa: ASYNC110  (no change event)
                    await anyio.sleep(0.05)
            assert (await first.emit(event, {"command": "rm -rf /"})).action == "deny"
        await first.close()
    finally:
        for conn in conns:
            await conn.close()
