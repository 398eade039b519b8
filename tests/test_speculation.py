"""Speculative pure handlers decide what calling them one by one decides, never later.

`pure=True` lets a dispatcher call an adjacent run of pure handlers at once; the decision
must still be the reference one (the handlers called one by one in priority order, each
with its failure policy), the emit's deadline included. Remote handlers run on real
workers against a real nats-server; nothing of the bus is mocked.

In-process cases run on an event loop with a virtual clock (``looptime``): it moves only
when every task waits, to the next timer, so a handler's sleep takes exactly what it says
and a CPU-bound stretch takes none; their verdicts cannot depend on how busy the machine
is. Remote cases keep margins ten times what they measure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import looptime
import pytest
from conftest import Connect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

T = TypeVar("T")


def on_loop_time(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on a fresh event loop whose clock is virtual (``looptime``)."""
    loop = looptime.new_event_loop(start=0.0)
    try:
        return loop.run_until_complete(main)
    finally:
        loop.close()


def make_p1_p2(unit_s: float) -> tuple[Callable[..., Awaitable[HookResult]], ...]:
    """p1 (2 units, modify) and p2 (5 units, deny saying what it saw)."""

    async def p1(event: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(2 * unit_s)
        return HookResult(action="modify", data={**data, "redacted": True})

    async def p2(event: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(5 * unit_s)
        return HookResult(action="deny", reason=f"redacted={data.get('redacted')}")

    return p1, p2


def decision(result: HookResult) -> tuple[Any, ...]:
    return (result.action, result.decided_by, result.reason, [f.handler for f in result.failures])


def handlers_reason(result: HookResult) -> str | None:
    """The reason a handler gave; a failure's reason (its wording names how long the call
    waited, which differs between the two ways of calling) as one word."""
    reason = result.reason
    return "a failure" if reason is not None and reason.startswith("handler ") else reason


@pytest.mark.anyio
async def test_remote_pure_handlers_deny_within_the_deadline(connect: Connect, event: str) -> None:
    """p1 (2 s, modify) then p2 (5 s, deny, policy ignore), each served by a worker of its
    own, under a 9.5 s deadline: called one by one (declared not pure, on another event),
    p2 denies at 7 s; speculatively too, since p2 is called again on p1's data the moment
    p1 answers (a 2.5 s margin either way: real time, on a real server)."""
    p1, p2 = make_p1_p2(1.0)
    one_by_one = f"{event}-seq"
    workers = [HookWorker(await connect()), HookWorker(await connect())]
    for ev, pure in ((event, True), (one_by_one, False)):
        workers[0].add_handler(ev, p1, priority=1, pure=pure, timeout_s=20)
        workers[1].add_handler(ev, p2, priority=2, pure=pure, timeout_s=20)
    async with workers[0], workers[1], HookDispatcher(await connect()) as d:
        for ev, pure in ((one_by_one, False), (event, True)):
            assert [r.pure for r in d.routes(ev)] == [pure, pure]
            started = time.monotonic()
            result = await d.emit(ev, {"tool_name": "bash"}, timeout_s=9.5)
            took = time.monotonic() - started
            assert decision(result) == ("deny", "p2", "redacted=True", []), pure
            assert took < 9.0, (pure, took)


def test_in_process_pure_handlers_deny_within_the_deadline_and_drop_stale_calls(
    event: str,
) -> None:
    """The same at 0.1 s a unit, on the loop's virtual clock: p2 denies at exactly 0.7 s,
    both ways, and the one call dropped is the one on the data p1 replaced."""
    p1, p2 = make_p1_p2(0.1)
    cancelled: list[str] = []

    async def p2_tracked(ev: str, data: dict[str, Any]) -> HookResult:
        try:
            return await p2(ev, data)
        except asyncio.CancelledError:
            cancelled.append("redacted" if data.get("redacted") else "stale")
            raise

    async def main(pure: bool) -> tuple[HookResult, float]:
        d = HookDispatcher()
        d.register(event, p1, priority=1, name="p1", pure=pure)
        d.register(event, p2_tracked, priority=2, name="p2", pure=pure)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await d.emit(event, {}, timeout_s=0.95)
        return result, loop.time() - started

    for pure in (False, True):
        result, took = on_loop_time(main(pure))
        assert decision(result) == ("deny", "p2", "redacted=True", []), pure
        assert took == pytest.approx(0.7), (pure, took)
    assert cancelled == ["stale"]  # the call on the data p1 replaced, and only that one


def test_a_later_result_is_folded_as_soon_as_the_ones_before_it(event: str) -> None:
    """A fast deny after a slow continue: decided when the slow one answers, not later."""

    async def slow(ev: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(0.3)

    async def fast_deny(ev: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(0.01)
        return HookResult(action="deny", reason="no")

    async def main() -> tuple[HookResult, float]:
        d = HookDispatcher()
        d.register(event, slow, priority=1, name="slow", pure=True)
        d.register(event, fast_deny, priority=2, name="fast", pure=True)
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await d.emit(event, {})
        return result, loop.time() - started

    result, took = on_loop_time(main())
    assert decision(result) == ("deny", "fast", "no", [])
    assert took == pytest.approx(0.3)


# -- property: pure=True decides as pure=False ----------------------------------------------
UNIT_S = 0.05
"""Handlers sleep whole units; deadlines and timeouts end half a unit off any sum of them
(on the virtual clock, no jitter at all)."""

KINDS = ["continue", "deny", "modify", "inject_context", "ask_user", "none", "raise"]

handler_spec = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(KINDS),
        "sleep": st.integers(0, 3),
        "policy": st.sampled_from(["ignore", "deny"]),
        "timeout": st.one_of(st.none(), st.integers(0, 3)),
        "tools": st.sampled_from([None, ["bash"], ["edit"]]),
        "retool": st.sampled_from(["bash", "edit"]),
    }
)


def make_handler(i: int, spec: dict[str, Any]) -> Callable[..., Awaitable[Any]]:
    async def handler(event: str, data: dict[str, Any]) -> Any:
        await asyncio.sleep(spec["sleep"] * UNIT_S)
        kind = spec["kind"]
        if kind == "raise":
            raise RuntimeError(f"h{i} failed")
        if kind == "none":
            return None
        if kind == "modify":
            steps = [*data.get("steps", []), f"h{i}"]
            return HookResult(action="modify", data={**data, "steps": steps,
                                                     "tool_name": spec["retool"]})  # fmt: skip
        if kind == "inject_context":
            return HookResult(action="inject_context",
                              context_injection=f"h{i} saw {data.get('steps')}")  # fmt: skip
        return HookResult(action=kind, reason=f"h{i} saw {data.get('steps')}")

    return handler


async def run_emit(
    event: str, specs: list[dict[str, Any]], deadline: int | None, pure: bool
) -> tuple[Any, ...]:
    d = HookDispatcher()
    for i, spec in enumerate(specs):
        timeout = None if spec["timeout"] is None else (spec["timeout"] + 0.5) * UNIT_S
        d.register(event, make_handler(i, spec), priority=i, name=f"h{i}", pure=pure,
                   timeout_s=timeout, failure_policy=spec["policy"],
                   tool_filter=spec["tools"])  # fmt: skip
    timeout_s = None if deadline is None else (deadline + 0.5) * UNIT_S
    r = await d.emit(event, {"tool_name": "bash"}, timeout_s=timeout_s)
    injections = [(c.hook_name, c.content) for c in r.context_injections]
    failed = [f.handler for f in r.failures]
    data, chained = without_timestamp(r.data), without_timestamp(r.chained_data)
    return (r.action, r.decided_by, data, handlers_reason(r), chained, injections, failed)


def without_timestamp(data: dict[str, Any] | None) -> dict[str, Any] | None:
    return data if data is None else {k: v for k, v in data.items() if k != "timestamp"}


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    specs=st.lists(handler_spec, min_size=2, max_size=5),
    deadline=st.one_of(st.none(), st.integers(0, 8)),
)
def test_speculation_decides_as_calling_one_by_one(
    event: str, specs: list[dict[str, Any]], deadline: int | None
) -> None:
    """On the virtual clock: every sleep, timeout and deadline exactly as written."""
    reference = on_loop_time(run_emit(event, specs, deadline, pure=False))
    speculative = on_loop_time(run_emit(event, specs, deadline, pure=True))
    assert speculative == reference
