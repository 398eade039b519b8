"""`emit_and_collect` with remote (HookWorker, real nats-server) and in-process handlers.

amplifier-core semantics: data passed as is (no defaults, no timestamp); the non-None
``result.data`` of every handler that answered in time, in priority order; failures and
timeouts skipped. hookbus: one scatter publish, and the call returns as soon as every
expected handler has answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from _serving import serving
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult

pytestmark = pytest.mark.anyio


def answer(
    name: str, value: Any, seen: list[tuple[str, dict[str, Any]]]
) -> Callable[..., Awaitable[HookResult]]:
    """A handler that records the data it saw and answers ``HookResult(data=value)``."""

    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        seen.append((name, data))
        return HookResult(data=value)

    handler.__name__ = name
    return handler


LOCAL = {"from": "local"}
"""What the in-process handler ``local`` answers."""


async def with_local(
    connect: Connect, event: str, *handlers: tuple[Callable[..., Any], int]
) -> HookDispatcher:
    """A dispatcher (not started) on a connection of its own, with in-process `handlers`
    ``(fn, priority)`` of `event`."""
    d = HookDispatcher(await connect())
    for fn, priority in handlers:
        d.register(event, fn, priority=priority)
    return d


async def test_collect_remote_and_local_in_priority_order_data_as_given(
    nc: NATS, connect: Connect, event: str
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    d = HookDispatcher(await connect())
    d.set_default_fields(session_id="s1")  # must not reach emit_and_collect's handlers
    d.register(event, answer("local1", {"tool": "calc", "score": 0.1}, seen), priority=1)
    d.register(event, answer("local3", {"tool": "web", "score": 0.3}, seen), priority=3)
    d.register(event, answer("local_none", None, seen), priority=4)
    async with (
        serving(
            nc,
            (event, answer("remote2", {"tool": "weather", "score": 0.9}, seen), {"priority": 2}),
            (event, answer("remote_none", None, seen), {"priority": 0}),
        ),
        serving(
            await connect(),
            (event, answer("remote5", {"tool": "maps", "score": 0.5}, seen), {"priority": 5}),
        ),
        d,
    ):
        data = {"user_query": "weather in Paris?", "available_tools": ["weather", "web"]}
        with anyio.fail_after(30):
            responses = await d.emit_and_collect(event, data, timeout=20.0)
    assert responses == [
        {"tool": "calc", "score": 0.1},
        {"tool": "weather", "score": 0.9},
        {"tool": "web", "score": 0.3},
        {"tool": "maps", "score": 0.5},
    ]
    assert sorted(name for name, _ in seen) == sorted(
        ["local1", "local3", "local_none", "remote2", "remote_none", "remote5"]
    )
    for name, got in seen:
        assert got == {"user_query": "weather in Paris?", "available_tools": ["weather", "web"]}, (
            name
        )
        assert "timestamp" not in got and "session_id" not in got
    assert data == {"user_query": "weather in Paris?", "available_tools": ["weather", "web"]}


async def test_collect_returns_as_soon_as_all_answered(
    nc: NATS, connect: Connect, event: str
) -> None:
    """With a 20 s timeout, the call must end when the last handler answers, not at the
    deadline (the one coarse elapsed check in the suite: 5 s is far above any answer)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    d = HookDispatcher(await connect())
    d.register(event, answer("local", {"from": "local"}, seen))
    async with (
        serving(nc, (event, answer("r1", {"from": "r1"}, seen), {"priority": 1})),
        serving(await connect(), (event, answer("r2", {"from": "r2"}, seen), {"priority": 2})),
        d,
    ):
        start = time.monotonic()
        responses = await d.emit_and_collect(event, {"q": 1}, timeout=20.0)
        elapsed = time.monotonic() - start
    assert responses == [{"from": "local"}, {"from": "r1"}, {"from": "r2"}]
    assert elapsed < 5.0


async def test_collect_skips_a_handler_that_never_answers(
    nc: NATS, connect: Connect, event: str
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    release = asyncio.Event()
    stuck_called = asyncio.Event()

    async def stuck_remote(ev: str, data: dict[str, Any]) -> HookResult:
        stuck_called.set()
        await release.wait()
        return HookResult(data={"from": "stuck_remote"})

    async def stuck_local(ev: str, data: dict[str, Any]) -> HookResult:
        await release.wait()
        return HookResult(data={"from": "stuck_local"})

    d = await with_local(connect, event, (stuck_local, 0), (answer("local", LOCAL, seen), 3))
    async with (
        serving(
            nc,
            (event, stuck_remote, {"priority": 1, "timeout_s": 30.0}),
            (event, answer("remote", {"from": "remote"}, seen), {"priority": 2}),
        ),
        d,
    ):
        try:
            with anyio.fail_after(30):
                responses = await d.emit_and_collect(event, {}, timeout=1.0)
            assert stuck_called.is_set()  # it was asked, and gave no answer in time
        finally:
            release.set()  # let the worker drain
    assert responses == [{"from": "remote"}, {"from": "local"}]


async def test_collect_skips_failing_handlers(nc: NATS, connect: Connect, event: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def broken_remote(ev: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("remote boom")

    async def bad_remote(ev: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"action": "explode", "data": {"from": "bad_remote"}}

    async def broken_local(ev: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("local boom")

    d = await with_local(connect, event, (broken_local, 0), (answer("local", LOCAL, seen), 4))
    async with (
        serving(
            nc,
            (event, broken_remote, {"priority": 1}),
            (event, bad_remote, {"priority": 2}),
            (event, answer("remote", {"from": "remote"}, seen), {"priority": 3}),
        ),
        d,
    ):
        with anyio.fail_after(30):
            responses = await d.emit_and_collect(event, {}, timeout=20.0)
    assert responses == [{"from": "remote"}, {"from": "local"}]


async def test_collect_ignores_tool_filters(nc: NATS, connect: Connect, event: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with (
        serving(
            nc, (event, answer("bash_only", {"from": "bash_only"}, seen), {"tool_filter": ["bash"]})
        ),
        HookDispatcher(await connect()) as d,
    ):
        with anyio.fail_after(30):
            responses = await d.emit_and_collect(event, {"tool_name": "ls"}, timeout=20.0)
    assert responses == [{"from": "bash_only"}]


async def test_collect_local_and_remote_handler_sharing_a_name(
    nc: NATS, connect: Connect, event: str
) -> None:
    """Names are unique per event among remote handlers only; an in-process handler with
    the same name as a remote one is a different handler and both answers count."""
    seen: list[tuple[str, dict[str, Any]]] = []
    d = HookDispatcher(await connect())
    d.register(event, answer("scorer", {"from": "local"}, seen), priority=1)
    async with serving(nc, (event, answer("scorer", {"from": "remote"}, seen), {"priority": 2})), d:
        assert d.list_handlers(event) == {event: ["scorer", "scorer"]}
        with anyio.fail_after(30):
            responses = await d.emit_and_collect(event, {}, timeout=20.0)
    assert len(seen) == 2
    assert responses == [{"from": "local"}, {"from": "remote"}]


async def test_collect_with_no_live_replica_returns_at_once(
    nc: NATS, connect: Connect, event: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A declared remote handler with no replica: the server's 503 status on the collect
    inbox means nobody will answer, so the call returns at once (amplifier-core: no
    responses), without reading the status as a bad reply."""
    async with serving(nc, (event, answer("gone", {"from": "gone"}, []), {})):
        pass  # declared, then drained: no replica is left
    seen: list[tuple[str, dict[str, Any]]] = []
    d = HookDispatcher(await connect())
    d.register(event, answer("local", {"from": "local"}, seen), priority=5)
    async with d:
        assert [r.name for r in d.routes(event)] == ["gone", "local"]
        start = time.monotonic()
        with anyio.fail_after(30):
            responses = await d.emit_and_collect(event, {}, timeout=20.0)
        elapsed = time.monotonic() - start
    assert responses == [{"from": "local"}]
    assert not [r for r in caplog.records if "bad collect reply" in r.getMessage()]
    assert elapsed < 10.0  # not the 20 s timeout
