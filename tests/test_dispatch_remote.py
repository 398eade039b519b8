"""`emit` across processes: remote handlers served by `HookWorker`s on a real nats-server.

Every worker and every dispatcher has its own connection (one per simulated process), and
every test runs twice: with chain requests and with one request per handler.
Positive call counts are taken from the handlers' own records (a handler records before
it replies); a worker's `handled` count is only used to show that no request ever came.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import decimal
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from _serving import serving
from conftest import Connect
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from test_registry import bucket as handlers_bucket

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HandlerDeclaration,
    HookReply,
    HookResult,
    WireFormatError,
    collect_subject,
    decode,
    encode,
    handler_key,
    handler_queue_group,
    handler_subject,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True, params=["chains", "one-request-per-handler"])
def request_shape(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs both ways: handlers of one worker sent as one chain request
    (the default), and one request per handler. The semantics must not differ."""
    init = HookDispatcher.__init__
    chains = request.param == "chains"
    monkeypatch.setattr(HookDispatcher, "__init__", functools.partialmethod(init, chains=chains))
    return str(request.param)


# -- helpers ---------------------------------------------------------------------------
async def wait_for_handlers(d: HookDispatcher, event: str, names: list[str]) -> None:
    """Poll `list_handlers` until it shows `names` (bounded: 10 s)."""
    with anyio.fail_after(10):
        # no change event in the public API: poll
        while d.list_handlers(event)[event] != names:  # noqa: ASYNC110
            await anyio.sleep(0.01)


def recorder(calls: list[str], name: str, result: Any = None) -> Callable[..., Awaitable[Any]]:
    async def handler(event: str, data: dict[str, Any]) -> Any:
        calls.append(name)
        return result

    handler.__name__ = name
    return handler


def looker(seen: list[dict[str, Any]]) -> Callable[..., Awaitable[None]]:
    """A handler named ``look`` that appends the data it receives to `seen` (no answer)."""

    async def look(event: str, data: dict[str, Any]) -> None:
        seen.append(data)

    return look


def trail(name: str) -> Callable[..., Awaitable[HookResult]]:
    """A handler that appends its name to ``data["trail"]`` (modify)."""

    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "trail": [*data.get("trail", []), name]})

    handler.__name__ = name
    return handler


# -- priority order across processes ------------------------------------------------------
async def test_remote_and_local_interleave_in_one_priority_order(
    nc: NATS, connect: Connect, event: str
) -> None:
    d = HookDispatcher(await connect())
    d.register(event, trail("local1"), priority=1)
    d.register(event, trail("local3"), priority=3)
    d.register(event, trail("local5"), priority=5)  # tie with remotes: in-process first
    async with (
        serving(
            nc,
            (event, trail("remote2"), {"priority": 2}),
            (event, trail("remote4"), {"priority": 4}),
            (event, trail("zz_remote5"), {"priority": 5}),
            (event, trail("aa_remote5"), {"priority": 5}),  # ties between remotes: by name
        ),
        d,
    ):
        expected = ["local1", "remote2", "local3", "remote4", "local5", "aa_remote5", "zz_remote5"]
        assert d.list_handlers(event) == {event: expected}
        r = await d.emit(event, {"tool_name": "bash"})
    assert r.action == "continue"
    assert r.failures == []
    assert r.data is not None
    assert r.data["trail"] == expected
    assert r.modified_by == expected and r.decided_by == expected[-1]
    assert r.data["tool_name"] == "bash" and "timestamp" in r.data


async def test_deny_short_circuits_across_processes(nc: NATS, connect: Connect, event: str) -> None:
    calls: list[str] = []
    d = HookDispatcher(await connect())
    d.register(event, recorder(calls, "local_later"), priority=3)
    deny = HookResult(action="deny", reason="no bash", user_message="blocked")
    async with (
        serving(nc, (event, recorder(calls, "guard", deny), {"priority": 1})),
        serving(await connect(), (event, recorder(calls, "remote_later"), {"priority": 2})) as w2,
        d,
    ):
        assert d.list_handlers(event) == {event: ["guard", "remote_later", "local_later"]}
        r = await d.emit(event, {"tool_name": "bash"})
        assert w2.handled == 0
    assert calls == ["guard"]
    assert r.action == "deny" and r.reason == "no bash" and r.user_message == "blocked"
    assert r.decided_by == "guard"
    assert r.data is None  # the deny as its handler made it
    assert r.chained_data is not None and r.chained_data["tool_name"] == "bash"


async def test_modify_chains_across_two_remote_handlers(
    nc: NATS, connect: Connect, event: str
) -> None:
    seen: list[dict[str, Any]] = []

    async def first(ev: str, data: dict[str, Any]) -> HookResult:
        seen.append(data)
        return HookResult(action="modify", data={**data, "a": 1})

    async def second(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        seen.append(data)
        return {"action": "modify", "data": {**data, "b": data["a"] + 1}}

    async with (
        serving(nc, (event, first, {"priority": 1})),
        serving(await connect(), (event, second, {"priority": 2})),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {"tool_name": "bash", "command": "ls"})
    assert r.action == "continue" and r.failures == []
    assert r.modified_by == ["first", "second"]
    assert r.data is not None
    assert (r.data["a"], r.data["b"], r.data["command"]) == (1, 2, "ls")
    assert "a" not in seen[0] and seen[1]["a"] == 1
    assert seen[0]["timestamp"] == seen[1]["timestamp"] == r.data["timestamp"]


async def test_remote_modify_replaces_data_whole(nc: NATS, connect: Connect, event: str) -> None:
    seen: list[dict[str, Any]] = []

    async def replace(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={"only": True})

    look = looker(seen)
    async with (
        serving(nc, (event, replace, {"priority": 1}), (event, look, {"priority": 2})),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {"tool_name": "bash"})
    assert seen == [{"only": True}]
    assert r.action == "continue" and r.data == {"only": True}


# -- tool filters ----------------------------------------------------------------------------
async def test_tool_filter_skips_with_no_round_trip(nc: NATS, connect: Connect, event: str) -> None:
    calls: list[str] = []
    async with (
        serving(nc, (event, recorder(calls, "bash_guard"), {"tool_filter": ["bash*"]})) as w,
        HookDispatcher(await connect()) as d,
    ):
        await d.emit(event, {"tool_name": "ls"})
        await d.emit(event, {"tool_name": "xbash"})
        await d.emit(event, {})  # no tool name: a filter never admits it
        await d.emit(event, {"tool_name": 7})
        assert w.handled == 0
        assert calls == []
        await d.emit(event, {"tool_name": "bash_exec"})
        await d.emit(event, {"tool_name": "bash"})
    assert calls == ["bash_guard", "bash_guard"]


@pytest.mark.parametrize(
    ("tool", "matched"),
    [
        ("read_a", True),
        ("read_ab", False),
        ("apple", True),
        ("banana", True),
        ("cherry", False),
        ("write_file", True),
        ("write", False),
        ("READ_A", True),  # names are matched ignoring case (ToolFilter)
    ],
)
async def test_tool_filter_globs(
    nc: NATS, connect: Connect, event: str, tool: str, matched: bool
) -> None:
    calls: list[str] = []
    filt = ["read_?", "[ab]*", "write_*"]
    async with (
        serving(nc, (event, recorder(calls, "filtered"), {"tool_filter": filt})) as w,
        HookDispatcher(await connect()) as d,
    ):
        await d.emit(event, {"tool_name": tool})
        if not matched:
            assert w.handled == 0
    assert calls == (["filtered"] if matched else [])


async def test_tool_filter_sees_the_chained_data(nc: NATS, connect: Connect, event: str) -> None:
    calls: list[str] = []
    d = HookDispatcher(await connect())

    async def rename(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "tool_name": "bash"})

    d.register(event, rename, priority=0)
    async with (
        serving(
            nc, (event, recorder(calls, "bash_only"), {"priority": 1, "tool_filter": ["bash"]})
        ),
        d,
    ):
        await d.emit(event, {"tool_name": "ls"})
    assert calls == ["bash_only"]


async def test_empty_tool_filter_admits_nothing(nc: NATS, connect: Connect, event: str) -> None:
    calls: list[str] = []
    async with (
        serving(nc, (event, recorder(calls, "never"), {"tool_filter": []})) as w,
        HookDispatcher(await connect()) as d,
    ):
        await d.emit(event, {"tool_name": "bash"})
        assert w.handled == 0
    assert calls == []


# -- parallel handlers ---------------------------------------------------------------------
def meeting(
    *handlers: tuple[str, str],
) -> list[Callable[[str, dict[str, Any]], Awaitable[HookResult]]]:
    """One handler a ``(name, injection)``: each marks itself started, waits until all the
    others have started, then injects its text; so they finish only if they run at once."""
    started = {name: asyncio.Event() for name, _ in handlers}

    def make(name: str, text: str) -> Callable[[str, dict[str, Any]], Awaitable[HookResult]]:
        async def handler(ev: str, data: dict[str, Any]) -> HookResult:
            started[name].set()
            for other, event in started.items():
                if other != name:
                    await event.wait()
            return HookResult(action="inject_context", context_injection=text)

        handler.__name__ = name
        return handler

    return [make(name, text) for name, text in handlers]


async def emitted_in_parallel(
    nc: NATS, connect: Connect, event: str, first: Callable[..., Any], second: Callable[..., Any]
) -> HookResult:
    """`first` and `second`, parallel handlers (20 s timeouts) of priority 1 and 2, served by
    two workers (on `nc` and on a connection of its own): the result of one emit of `event`
    with empty data by a third process's dispatcher (30 s at most)."""
    opts = {"parallel": True, "timeout_s": 20.0}
    async with (
        serving(nc, (event, first, {**opts, "priority": 1})),
        serving(await connect(), (event, second, {**opts, "priority": 2})),
        HookDispatcher(await connect()) as d,
    ):
        with anyio.fail_after(30):
            return await d.emit(event, {})


async def test_adjacent_parallel_handlers_run_concurrently(
    nc: NATS, connect: Connect, event: str
) -> None:
    """A and B each wait for the other to have started: this completes only if both run
    at once (run one after the other, the first would wait until its timeout)."""
    a, b = meeting(("a", "from a"), ("b", "from b"))
    r = await emitted_in_parallel(nc, connect, event, a, b)
    assert r.failures == []
    assert r.action == "inject_context"
    assert r.context_injection == "from a\n\nfrom b"  # folded in priority order
    assert [c.hook_name for c in r.context_injections] == ["a", "b"]


async def test_local_and_remote_parallel_handlers_run_concurrently(
    nc: NATS, connect: Connect, event: str
) -> None:
    local, remote = meeting(("local", "local"), ("remote", "remote"))

    d = HookDispatcher(await connect())
    d.register(event, local, priority=2, parallel=True, timeout_s=20.0)
    async with (
        serving(nc, (event, remote, {"priority": 1, "parallel": True, "timeout_s": 20.0})),
        d,
    ):
        with anyio.fail_after(30):
            r = await d.emit(event, {})
    assert r.failures == []
    assert [c.hook_name for c in r.context_injections] == ["remote", "local"]


async def test_parallel_first_deny_in_priority_order_wins(
    nc: NATS, connect: Connect, event: str
) -> None:
    """B (later in priority order) denies and answers first; A denies only after B's reply
    was seen on the wire. The fold still names A, first in priority order."""
    b_replied = asyncio.Event()
    monitor = await connect()

    async def watch(msg: Msg) -> None:
        with contextlib.suppress(WireFormatError):
            if decode(msg.data, HookReply).handler == "b_deny":
                b_replied.set()

    await monitor.subscribe("_INBOX.>", cb=watch)
    await monitor.flush()

    async def a_deny(ev: str, data: dict[str, Any]) -> HookResult:
        await b_replied.wait()
        return HookResult(action="deny", reason="denied by a")

    async def b_deny(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="denied by b")

    r = await emitted_in_parallel(nc, connect, event, a_deny, b_deny)
    assert b_replied.is_set()
    assert r.failures == []
    assert r.action == "deny" and r.decided_by == "a_deny" and r.reason == "denied by a"


async def test_parallel_group_is_followed_by_sequential_handlers(
    nc: NATS, connect: Connect, event: str
) -> None:
    seen: list[dict[str, Any]] = []
    async with (
        serving(
            nc,
            (event, trail("seq1"), {"priority": 1}),
            (event, recorder([], "par2"), {"priority": 2, "parallel": True}),
            (event, recorder([], "par3"), {"priority": 3, "parallel": True}),
            (event, trail("seq4"), {"priority": 4}),
            (event, looker(seen), {"priority": 5}),
        ),
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {})
    assert r.failures == []
    assert r.data is not None and r.data["trail"] == ["seq1", "seq4"]
    assert seen[0]["trail"] == ["seq1", "seq4"]


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_parallel_handler_returning_modify_is_a_bad_reply_denied(
    nc: NATS, connect: Connect, event: str, policy: str
) -> None:
    """A parallel handler may not modify: its reply is refused, and a refused reply fails
    closed whatever its policy."""
    calls: list[str] = []

    async def sneaky(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={"hacked": True})

    d = HookDispatcher(await connect())
    d.register(event, recorder(calls, "after"), priority=5)
    async with (
        serving(
            nc,
            (event, sneaky, {"priority": 1, "parallel": True, "failure_policy": policy}),
            (event, recorder(calls, "peer"), {"priority": 2, "parallel": True}),
        ),
        d,
    ):
        r = await d.emit(event, {"tool_name": "bash"})
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("sneaky", "bad_reply", "deny")]
    assert r.chained_data is not None and "hacked" not in r.chained_data
    assert r.chained_data["tool_name"] == "bash"
    assert r.action == "deny" and r.decided_by == "sneaky"
    assert "after" not in calls


# -- JSON-safe data, each handler its own copy, as in-process -----------------------------
async def test_remote_handlers_get_json_safe_data_as_local_ones_do(
    nc: NATS, connect: Connect, event: str
) -> None:
    seen: list[dict[str, Any]] = []

    async def look(ev: str, data: dict[str, Any]) -> HookResult:
        seen.append(dict(data))
        data["edited_in_place"] = True  # reaches nobody
        return HookResult(data={"collected": data["cost"]})

    d = HookDispatcher(await connect())
    d.register(event, recorder([], "local"), priority=9)
    caller = {"cost": decimal.Decimal("1.23"), "at": dt.date(2024, 1, 2), "ids": (1, 2)}
    async with serving(nc, (event, look, {"priority": 1})), d:
        r = await d.emit(event, caller)
        collected = await d.emit_and_collect(event, caller, timeout=5.0)
    expected = {"cost": "1.23", "at": "2024-01-02", "ids": [1, 2]}
    assert {k: seen[0][k] for k in expected} == expected  # emit: with timestamp
    assert seen[1] == expected  # emit_and_collect: as is
    assert r.data is not None and "edited_in_place" not in r.data
    assert collected == [{"collected": "1.23"}]
    assert caller["cost"] == decimal.Decimal("1.23")  # the caller's dict is untouched


# -- failures under both policies -------------------------------------------------------------
KINDS = ["timeout", "no_responders", "error", "bad_reply"]


@contextlib.asynccontextmanager
async def failing_handler(kind: str, policy: str, event: str, nc: NATS) -> AsyncIterator[str]:
    """A remote handler of `event` that fails with `kind`; yields its name."""
    name = f"failing_{kind}"
    opts: dict[str, Any] = {"priority": 1, "failure_policy": policy, "name": name}
    never = asyncio.Event()

    async def stuck(ev: str, data: dict[str, Any]) -> None:
        await never.wait()

    async def raises(ev: str, data: dict[str, Any]) -> None:
        raise RuntimeError("handler exploded")

    async def explodes(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"action": "explode"}

    async def fine(ev: str, data: dict[str, Any]) -> None:
        return None

    match kind:
        case "timeout":
            async with serving(nc, (event, stuck, {**opts, "timeout_s": 0.5})):
                yield name
        case "no_responders":
            # declared (the declaration outlives the worker), but nobody serves it
            async with serving(nc, (event, fine, {**opts, "timeout_s": 30.0})):
                pass
            await nc.flush()  # the server has processed the unsubscribes
            yield name
        case "error":
            async with serving(nc, (event, raises, opts)):
                yield name
        case "bad_reply":
            async with serving(nc, (event, explodes, opts)):
                yield name
        case _:
            raise AssertionError(kind)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "bad_reply"])
async def test_failure_under_ignore_is_recorded_and_emit_continues(
    nc: NATS, connect: Connect, event: str, kind: str
) -> None:
    calls: list[str] = []
    d = HookDispatcher(await connect())
    d.register(
        event,
        recorder(
            calls, "after", HookResult(action="inject_context", context_injection="still ran")
        ),
        priority=10,
    )
    async with failing_handler(kind, "ignore", event, nc) as name, d:
        assert d.list_handlers(event) == {event: [name, "after"]}
        r = await d.emit(event, {"tool_name": "bash"})
    assert calls == ["after"]
    assert r.action == "inject_context" and r.context_injection == "still ran"
    assert r.decided_by == "after"
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [(name, kind, "ignore")]
    assert r.chained_data is not None and r.chained_data["tool_name"] == "bash"


async def test_a_bad_reply_under_ignore_is_denied(nc: NATS, connect: Connect, event: str) -> None:
    """A reply that cannot be read might have been a deny: it fails closed under ``ignore``
    too (amplifier-core denies a handler result it cannot parse)."""
    calls: list[str] = []
    d = HookDispatcher(await connect())
    d.register(event, recorder(calls, "after"), priority=10)
    async with failing_handler("bad_reply", "ignore", event, nc) as name, d:
        r = await d.emit(event, {"tool_name": "bash"})
    assert calls == []
    assert r.action == "deny" and r.decided_by == name
    assert r.reason == "Hook handler returned invalid response"
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [(name, "bad_reply", "deny")]
    assert "$.action" in r.failures[0].message


@pytest.mark.parametrize("kind", KINDS)
async def test_failure_under_deny_fails_closed(
    nc: NATS, connect: Connect, event: str, kind: str
) -> None:
    calls: list[str] = []
    d = HookDispatcher(await connect())
    d.register(event, recorder(calls, "after"), priority=10)
    async with failing_handler(kind, "deny", event, nc) as name, d:
        r = await d.emit(event, {"tool_name": "bash"})
    assert calls == []
    assert r.action == "deny"
    assert r.decided_by == name
    assert r.reason is not None
    if kind != "bad_reply":  # a bad reply's reason is amplifier-core's; details on the failure
        assert name in r.reason and kind in r.reason
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [(name, kind, "deny")]


async def test_error_failure_message_carries_the_exception(
    nc: NATS, connect: Connect, event: str
) -> None:
    async with (
        failing_handler("error", "ignore", event, nc) as name,
        HookDispatcher(await connect()) as d,
    ):
        r = await d.emit(event, {})
    assert r.failures[0].handler == name
    assert "RuntimeError" in r.failures[0].message and "handler exploded" in r.failures[0].message


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\xffnot json{",
        b'{"handler": "raw"}',  # neither result nor error
        b'{"handler": "raw", "result": {"action": "explode"}}',
        b'{"handler": "raw", "result": "deny"}',
    ],
    ids=["garbage", "empty-reply", "bad-action", "result-not-object"],
)
@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_raw_responder_replying_garbage_is_a_bad_reply_denied(
    nc: NATS, connect: Connect, event: str, payload: bytes, policy: str
) -> None:
    name = "raw"
    decl = HandlerDeclaration(
        event=event,
        name=name,
        priority=1,
        timeout_s=5.0,
        failure_policy=policy,  # type: ignore[arg-type]
        subject=handler_subject(event, name),
        collect_subject=collect_subject(event),
        queue_group=handler_queue_group(name),
    )
    answered: list[bytes] = []

    async def respond(msg: Msg) -> None:
        answered.append(msg.data)
        await msg.respond(payload)

    raw = await connect()
    await raw.subscribe(decl.subject, queue=decl.queue_group, cb=respond)
    await raw.flush()
    kv = await handlers_bucket(raw)
    await kv.put(handler_key(event, name), encode(decl))
    calls: list[str] = []
    d = HookDispatcher(await connect())
    d.register(event, recorder(calls, "after"), priority=10)
    try:
        async with d:
            r = await d.emit(event, {"tool_name": "bash"})
    finally:
        await kv.delete(handler_key(event, name))
    assert len(answered) == 1
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [(name, "bad_reply", "deny")]
    assert r.action == "deny" and r.decided_by == name and calls == []


# -- the registry watch ----------------------------------------------------------------------
async def test_handler_declared_after_start_is_picked_up_and_deletion_removes_it(
    nc: NATS, connect: Connect, event: str
) -> None:
    calls: list[str] = []
    async with HookDispatcher(await connect()) as d:
        assert d.list_handlers(event) == {event: []}
        w = HookWorker(nc)
        w.add_handler(event, recorder(calls, "late", HookResult(action="deny", reason="late")))
        async with w:
            await wait_for_handlers(d, event, ["late"])
            r = await d.emit(event, {})
            assert r.action == "deny" and r.decided_by == "late"
            assert calls == ["late"]
            await w.unregister()
            await wait_for_handlers(d, event, [])
            r = await d.emit(event, {"x": 1})
        assert r.action == "continue" and r.data == {"x": 1}
        assert calls == ["late"]
        assert d.list_handlers()[event] == []  # the event stays listed, with no handlers


async def test_redeclaration_updates_the_route(nc: NATS, connect: Connect, event: str) -> None:
    """A put of a changed declaration (here: a new priority) reorders the routes."""
    async with (
        serving(nc, (event, trail("a"), {"priority": 1}), (event, trail("b"), {"priority": 2})),
        HookDispatcher(await connect()) as d,
    ):
        assert d.list_handlers(event) == {event: ["a", "b"]}
        kv = await handlers_bucket(nc)
        entry = await kv.get(handler_key(event, "a"))
        assert entry.value is not None
        decl = decode(entry.value, HandlerDeclaration)
        decl.priority = 3
        await kv.put(handler_key(event, "a"), encode(decl))
        await wait_for_handlers(d, event, ["b", "a"])
        r = await d.emit(event, {})
    assert r.data is not None and r.data["trail"] == ["b", "a"]


async def test_a_declared_handler_with_no_replica_is_rechecked_once_not_on_every_emit(
    nc: NATS, nats_url: str, event: str
) -> None:
    """A declaration whose replicas are all gone: the first emit sends its request twice
    (the recheck of "no responders"), the next emits once each: none waits for a recheck
    again while the subject stays without a replica (counted on the wire, through a proxy)."""
    from _proxy import NatsProxy

    from hookbus.schemas import handler_subject

    async with (
        NatsProxy(nats_url) as proxy,
        failing_handler("no_responders", "ignore", event, nc) as name,
    ):
        dnc = await nats.connect(proxy.url)
        try:
            async with HookDispatcher(dnc) as d:
                results = [await d.emit(event, {"tool_name": "bash"}) for _ in range(5)]
        finally:
            await dnc.close()
        subject = handler_subject(event, name).encode()
        sent = [op for op in proxy.client_ops if op.split(b" ")[1:2] == [subject]]
    assert all([f.kind for f in r.failures] == ["no_responders"] for r in results)
    assert len(sent) == 6, sent


async def test_an_emit_without_a_deadline_gives_its_remote_handlers_one_total(
    nc: NATS, connect: Connect, event: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two remote handlers that hang, each with a 5 s timeout, and no caller deadline: the
    emit ends at the one total (`REMOTE_EMIT_BUDGET_S`, 2 s here), not at the sum of the
    timeouts (10 s); the second is not called."""
    from hookbus.dispatcher import _call_router

    monkeypatch.setattr(_call_router, "REMOTE_EMIT_BUDGET_S", 2.0)
    never = asyncio.Event()

    async def stuck(ev: str, data: dict[str, Any]) -> None:
        await never.wait()

    handlers = [
        (event, stuck, {"name": n, "priority": p, "timeout_s": 5.0})
        for n, p in (("a", 1), ("b", 2))
    ]
    async with serving(nc, *handlers), HookDispatcher(await connect(), chains=False) as d:
        r = await d.emit(event, {"tool_name": "bash"})
    a, b = r.failures
    assert (a.handler, a.kind, b.handler, b.kind) == ("a", "timeout", "b", "timeout")
    # its 5 s cut to the total. Two clocks end it at the same 2 s: the worker's (which
    # runs the step and times it) and the dispatcher's (rounded up to its millisecond
    # timer); on a local link the worker's answer can arrive inside that millisecond.
    # Either names the same 2 s and gives the same decision.
    assert a.message in ("no reply within 2s", "handler_timeout: ran past 2s")
    assert b.message == "not called: the emit's deadline had passed"
