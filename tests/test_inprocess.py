"""`HookDispatcher()` with no NATS connection behaves like amplifier-core's `HookRegistry`.

Everything here runs in-process: no server, no connection.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import datetime, timedelta
from typing import Any

import anyio
import pytest

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import ALL_EVENTS, HandlerFailure, HookResult, UnknownEventError

pytestmark = pytest.mark.anyio

EVENT = "tool:pre"


def recorder(calls: list[str], name: str, result: Any = None):
    """An async handler that records its name and returns `result`."""

    async def handler(event: str, data: dict[str, Any]) -> Any:
        calls.append(name)
        return result

    handler.__name__ = name
    return handler


def looking() -> tuple[HookDispatcher, list[dict[str, Any]]]:
    """An in-process dispatcher with one `EVENT` handler that keeps a copy of each `data`
    it sees (in order), and that list."""
    d = HookDispatcher()
    seen: list[dict[str, Any]] = []

    async def look(event: str, data: dict[str, Any]) -> None:
        seen.append(dict(data))

    d.register(EVENT, look)
    return d, seen


# -- register / on / unregister ---------------------------------------------------------
async def test_register_returns_an_idempotent_unregister() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    unregister = d.register(EVENT, recorder(calls, "a"))
    d.register(EVENT, recorder(calls, "b"), priority=1)
    assert d.list_handlers(EVENT) == {EVENT: ["a", "b"]}
    unregister()
    assert d.list_handlers(EVENT) == {EVENT: ["b"]}
    unregister()  # a second call changes nothing
    assert d.list_handlers(EVENT) == {EVENT: ["b"]}
    await d.emit(EVENT, {})
    assert calls == ["b"]


async def test_unregister_removes_only_its_own_registration() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    handler = recorder(calls, "same")
    first = d.register(EVENT, handler)
    d.register(EVENT, handler)  # the same function twice: two registrations
    first()
    first()
    assert d.list_handlers(EVENT) == {EVENT: ["same"]}
    await d.emit(EVENT, {})
    assert calls == ["same"]


async def test_on_is_register() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    unregister = d.on(EVENT, recorder(calls, "a"), 5, "named")
    assert d.list_handlers(EVENT) == {EVENT: ["named"]}
    await d.emit(EVENT, {})
    assert calls == ["a"]
    unregister()
    unregister()
    assert d.list_handlers() == {EVENT: []}  # as amplifier-core lists an emptied event


async def test_decorator_form_registers_and_returns_the_function() -> None:
    d = HookDispatcher()

    @d.register(EVENT)
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason=f"no {data['tool_name']}")

    @d.register(EVENT, priority=-1, name="first")
    async def early(event: str, data: dict[str, Any]) -> None:
        return None

    assert guard.__name__ == "guard"  # returned unchanged, still callable
    assert (await guard(EVENT, {"tool_name": "x"})).reason == "no x"
    assert d.list_handlers(EVENT) == {EVENT: ["first", "guard"]}
    r = await d.emit(EVENT, {"tool_name": "bash"})
    assert r.action == "deny" and r.reason == "no bash" and r.decided_by == "guard"


async def test_name_defaults_to_the_function_name() -> None:
    d = HookDispatcher()

    async def audit(event: str, data: dict[str, Any]) -> None:
        return None

    d.register(EVENT, audit)
    assert d.list_handlers(EVENT) == {EVENT: ["audit"]}


# -- priority order ---------------------------------------------------------------------
async def test_priority_order_lower_first_ties_in_registration_order() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    for name, priority in [
        ("p10", 10),
        ("p0a", 0),
        ("pm5", -5),
        ("p0b", 0),
        ("p10b", 10),
        ("p0c", 0),
    ]:
        d.register(EVENT, recorder(calls, name), priority=priority)
    expected = ["pm5", "p0a", "p0b", "p0c", "p10", "p10b"]
    assert d.list_handlers(EVENT) == {EVENT: expected}
    await d.emit(EVENT, {})
    assert calls == expected


async def test_handlers_see_the_data_in_priority_order_with_modify_chaining() -> None:
    d = HookDispatcher()
    seen: list[dict[str, Any]] = []

    async def add(event: str, data: dict[str, Any]) -> HookResult:
        seen.append(dict(data))
        return HookResult(
            action="modify", data={**data, "trail": [*data.get("trail", []), len(seen)]}
        )

    d.register(EVENT, add, priority=2)
    d.register(EVENT, add, priority=1)
    r = await d.emit(EVENT, {"tool_name": "bash"})
    assert r.action == "continue"  # a modify chain ends as continue with its data
    assert r.data is not None and r.data["trail"] == [1, 2]
    assert [s.get("trail") for s in seen] == [None, [1]]


# -- list_handlers ----------------------------------------------------------------------
async def test_list_handlers_shapes() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    d.register("tool:pre", recorder(calls, "validator"), priority=20)
    d.register("tool:pre", recorder(calls, "security"), priority=1)
    d.register("tool:post", recorder(calls, "audit"))
    d.register("tool:post", recorder(calls, "metrics"), priority=1)
    assert d.list_handlers() == {
        "tool:pre": ["security", "validator"],
        "tool:post": ["audit", "metrics"],
    }
    assert d.list_handlers("tool:pre") == {"tool:pre": ["security", "validator"]}
    assert d.list_handlers("session:start") == {"session:start": []}


# -- default fields and timestamp -------------------------------------------------------
async def test_default_fields_merged_explicit_data_wins() -> None:
    d, seen = looking()
    d.set_default_fields(session_id="s1", env="prod")
    data = {"tool_name": "bash", "env": "dev"}
    r = await d.emit(EVENT, data)
    assert seen[0]["session_id"] == "s1"
    assert seen[0]["env"] == "dev"  # explicit data wins over a default
    assert seen[0]["tool_name"] == "bash"
    assert r.data is not None and r.data["session_id"] == "s1" and r.data["env"] == "dev"
    assert data == {"tool_name": "bash", "env": "dev"}  # the caller's dict is not mutated


async def test_second_set_default_fields_replaces_the_first() -> None:
    d, seen = looking()
    d.set_default_fields(session_id="s1", env="prod")
    d.set_default_fields(user_id="u1")
    await d.emit(EVENT, {})
    assert seen[0]["user_id"] == "u1"
    assert "session_id" not in seen[0] and "env" not in seen[0]


async def test_timestamp_is_stamped_utc_iso8601() -> None:
    d, seen = looking()
    before = datetime.now().astimezone()
    r = await d.emit(EVENT, {"tool_name": "bash"})
    after = datetime.now().astimezone()
    stamp = seen[0]["timestamp"]
    assert isinstance(stamp, str)
    parsed = datetime.fromisoformat(stamp)
    assert parsed.tzinfo is not None
    assert parsed.utcoffset() == timedelta(0)
    assert before <= parsed <= after
    assert r.data is not None and r.data["timestamp"] == stamp


async def test_no_handlers_data_unchanged_no_defaults_no_timestamp() -> None:
    d = HookDispatcher()
    d.set_default_fields(session_id="s1")
    data = {"tool_name": "bash"}
    r = await d.emit("tool:post", data)
    assert r.action == "continue"
    assert r.data == {"tool_name": "bash"}
    assert "timestamp" not in (r.data or {}) and "session_id" not in (r.data or {})
    assert data == {"tool_name": "bash"}
    assert r.failures == [] and r.decided_by is None


async def test_no_handlers_after_unregister_behaves_as_never_registered() -> None:
    d = HookDispatcher()
    unregister = d.register(EVENT, recorder([], "a"))
    unregister()
    r = await d.emit(EVENT, {"x": 1})
    assert r.action == "continue" and r.data == {"x": 1}


# -- event constants --------------------------------------------------------------------
# (the eight class constants: tests/test_amplifier_conformance.py)


# -- what a handler returns, and handler failures ----------------------------------------
async def test_handler_exception_does_not_stop_other_handlers() -> None:
    d = HookDispatcher()
    calls: list[str] = []

    async def broken(event: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("boom")

    d.register(EVENT, recorder(calls, "before"), priority=0)
    d.register(EVENT, broken, priority=1)
    d.register(
        EVENT,
        recorder(calls, "after", HookResult(action="inject_context", context_injection="ok")),
        priority=2,
    )
    r = await d.emit(EVENT, {})
    assert calls == ["before", "after"]
    assert r.action == "inject_context" and r.context_injection == "ok"
    assert len(r.failures) == 1
    f = r.failures[0]
    assert (f.handler, f.kind, f.policy) == ("broken", "error", "ignore")
    assert "RuntimeError" in f.message and "boom" in f.message


async def test_sync_handler_exception_is_a_failure_too() -> None:
    d = HookDispatcher()

    def broken(event: str, data: dict[str, Any]) -> HookResult:
        raise ValueError("bad")

    d.register(EVENT, broken)
    r = await d.emit(EVENT, {})
    assert r.action == "continue"
    assert [(f.handler, f.kind) for f in r.failures] == [("broken", "error")]


async def test_handler_exception_with_deny_policy_fails_closed() -> None:
    d = HookDispatcher()
    calls: list[str] = []

    async def security(event: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("policy store down")

    d.register(EVENT, security, failure_policy="deny")
    d.register(EVENT, recorder(calls, "later"), priority=1)
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.decided_by == "security"
    assert r.reason is not None and "security" in r.reason and "error" in r.reason
    assert calls == []
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("security", "error", "deny")]


async def test_handler_returning_a_dict() -> None:
    d = HookDispatcher()

    async def guard(event: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"action": "deny", "reason": "from a dict"}

    d.register(EVENT, guard)
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.reason == "from a dict" and r.decided_by == "guard"


async def test_sync_handler_returning_a_dict_modify() -> None:
    d = HookDispatcher()

    def redact(event: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"action": "modify", "data": {"command": "***"}}

    d.register(EVENT, redact)
    r = await d.emit(EVENT, {"command": "cat secrets"})
    assert r.action == "continue" and r.data == {"command": "***"}


async def test_handler_returning_none_is_continue() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    d.register(EVENT, recorder(calls, "quiet", None))
    r = await d.emit(EVENT, {"x": 1})
    assert calls == ["quiet"]
    assert r.action == "continue" and r.failures == []
    assert r.data is not None and r.data["x"] == 1


@pytest.mark.parametrize(
    "bad", [42, "deny", ["deny"], {"action": "explode"}, {"action": "deny", "reason": 3}]
)
async def test_handler_returning_an_invalid_value_is_denied(bad: Any) -> None:
    """A result that cannot be read fails closed whatever the handler's policy, as
    amplifier-core denies an unparseable handler result."""
    d = HookDispatcher()
    calls: list[str] = []
    d.register(EVENT, recorder(calls, "weird", bad))
    d.register(EVENT, recorder(calls, "after"), priority=1)
    r = await d.emit(EVENT, {})
    assert calls == ["weird"]
    assert r.action == "deny" and r.decided_by == "weird"
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("weird", "bad_reply", "deny")]


async def test_local_timeout_is_a_failure_and_the_chain_goes_on() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    d.register(EVENT, stuck, timeout_s=0.2)
    d.register(EVENT, recorder(calls, "after"), priority=1)
    with anyio.fail_after(10):
        r = await d.emit(EVENT, {})
    assert calls == ["after"]
    assert r.action == "continue"
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("stuck", "timeout", "ignore")]


async def test_local_timeout_with_deny_policy_fails_closed() -> None:
    d = HookDispatcher()
    d.register(EVENT, stuck, timeout_s=0.2, failure_policy="deny")
    with anyio.fail_after(10):
        r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.decided_by == "stuck"
    assert [(f.kind, f.policy) for f in r.failures] == [("timeout", "deny")]


async def stuck(event: str, data: dict[str, Any]) -> None:
    """A handler that never returns (what a handler's timeout cuts short)."""
    await anyio.sleep_forever()


async def fine(event: str, data: dict[str, Any]) -> HookResult:
    """A handler that answers ``{"from": "fine"}`` at once."""
    return HookResult(data={"from": "fine"})


def blocking(started: threading.Event, release: threading.Event, *, hold_s: float = 3.0):
    """A sync handler that blocks (at most `hold_s` seconds, until `release`), then denies."""

    def slow(event: str, data: dict[str, Any]) -> HookResult:
        started.set()
        release.wait(hold_s)
        return HookResult(action="deny", reason="late deny from slow")

    return slow


@pytest.mark.parametrize("limit", ["handler timeout_s", "emit deadline"])
@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_blocking_sync_handler_is_cut_at_its_timeout(limit: str, policy: str) -> None:
    """A sync handler honours its time limit as it does on a worker: it runs in a worker
    thread, the call ends at 0.2 s as a ``timeout`` judged by its policy, and its late deny
    (after 3 s) decides nothing. Before, it ran on the event loop: nothing could cut it
    and its deny decided the emit 3 s later."""
    started, release = threading.Event(), threading.Event()
    d = HookDispatcher()
    calls: list[str] = []
    if limit == "handler timeout_s":
        d.register(EVENT, blocking(started, release), timeout_s=0.2, failure_policy=policy)
        d.register(EVENT, recorder(calls, "after"), priority=1)  # the emit goes on
    else:  # the deadline leaves no time for a handler after it
        d.register(EVENT, blocking(started, release), failure_policy=policy)
    loop = asyncio.get_running_loop()
    try:
        t0 = loop.time()
        r = await d.emit(EVENT, {}, timeout_s=0.2 if limit == "emit deadline" else None)
        took = loop.time() - t0
    finally:
        release.set()  # the abandoned thread ends now, not 3 s later
    # (on a busy machine the worker thread may not have started within 0.2 s: the call is
    # cut all the same, and a handler run on the loop would have held it for 3 s)
    assert took < 2.5, f"the emit took {took:.2f}s: the sync handler was not cut"
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("slow", "timeout", policy)]
    if policy == "deny":  # fail closed by the timeout, not by the handler's own late deny
        assert r.action == "deny" and r.decided_by == "slow"
        assert r.reason is not None and "late deny" not in r.reason and "timeout" in r.reason
        assert calls == []
    else:
        assert r.action == "continue"
        assert calls == (["after"] if limit == "handler timeout_s" else [])


async def test_sync_handler_runs_off_the_loop_when_it_has_a_timeout() -> None:
    """While a sync handler with a timeout blocks, the event loop goes on (other emits are
    decided); its result, once it returns within the timeout, decides as before."""
    started, release = threading.Event(), threading.Event()
    d = HookDispatcher()
    d.register(EVENT, blocking(started, release, hold_s=5.0), timeout_s=30.0)
    other = f"{EVENT}:other"
    d.register(other, recorder([], "quick"))
    with anyio.fail_after(10):
        call = asyncio.ensure_future(d.emit(EVENT, {}))
        assert await asyncio.to_thread(started.wait, 10)
        assert (await d.emit(other, {})).action == "continue"  # the loop is free
        assert not call.done()
        release.set()
        r = await call
    assert r.action == "deny" and r.reason == "late deny from slow" and r.failures == []


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_an_async_handler_computing_past_its_timeout_is_a_timeout(policy: str) -> None:
    """An async handler that computes 0.5 s without awaiting, with ``timeout_s=0.1``: the
    loop could not cut it, yet its late deny decides nothing (a ``timeout`` under its
    policy), as on a worker, which times the step it runs."""
    d = HookDispatcher()

    async def computing(event: str, data: dict[str, Any]) -> HookResult:
        end = time.monotonic() + 0.5
        while time.monotonic() < end:
            pass
        return HookResult(action="deny", reason="late deny")

    d.register(EVENT, computing, name="scan", timeout_s=0.1, failure_policy=policy)
    r = await d.emit(EVENT, {})
    assert [(f.handler, f.kind, f.policy) for f in r.failures] == [("scan", "timeout", policy)]
    assert r.reason != "late deny"
    assert r.action == ("deny" if policy == "deny" else "continue")


async def test_local_tool_filter() -> None:
    d = HookDispatcher()
    calls: list[str] = []
    d.register(EVENT, recorder(calls, "bash_only"), tool_filter=["bash*"])
    await d.emit(EVENT, {"tool_name": "ls"})
    await d.emit(EVENT, {})
    assert calls == []
    await d.emit(EVENT, {"tool_name": "bash_exec"})
    assert calls == ["bash_only"]


# -- emit_and_collect -------------------------------------------------------------------
async def test_emit_and_collect_data_as_given_non_none_in_priority_order() -> None:
    d = HookDispatcher()
    d.set_default_fields(session_id="s1")
    seen: list[dict[str, Any]] = []

    def answer(value: Any):
        async def handler(event: str, data: dict[str, Any]) -> HookResult:
            seen.append(data)
            return HookResult(data=value)

        return handler

    d.register(
        "decision:tool_resolution", answer({"tool": "web", "score": 0.3}), priority=5, name="web"
    )
    d.register(
        "decision:tool_resolution",
        answer({"tool": "weather", "score": 0.9}),
        priority=1,
        name="weather",
    )
    d.register("decision:tool_resolution", answer(None), priority=3, name="silent")
    data = {"user_query": "weather?"}
    responses = await d.emit_and_collect("decision:tool_resolution", data)
    assert responses == [{"tool": "weather", "score": 0.9}, {"tool": "web", "score": 0.3}]
    assert len(seen) == 3
    for s in seen:
        assert s == {"user_query": "weather?"}  # no defaults, no timestamp
    assert data == {"user_query": "weather?"}


async def test_emit_and_collect_skips_timeouts_and_failures() -> None:
    d = HookDispatcher()

    async def broken(event: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("boom")

    def weird(event: str, data: dict[str, Any]) -> int:
        return 7

    d.register(EVENT, stuck, priority=0)
    d.register(EVENT, broken, priority=1)
    d.register(EVENT, weird, priority=2)
    d.register(EVENT, fine, priority=3)
    with anyio.fail_after(10):
        responses = await d.emit_and_collect(EVENT, {}, timeout=0.3)
    assert responses == [{"from": "fine"}]


async def test_emit_and_collect_handler_timeout_s_skips_it() -> None:
    d = HookDispatcher()
    d.register(EVENT, stuck, timeout_s=0.2)
    d.register(EVENT, fine, priority=1)
    with anyio.fail_after(10):
        responses = await d.emit_and_collect(EVENT, {}, timeout=5.0)
    assert responses == [{"from": "fine"}]


async def test_emit_and_collect_handlers_sharing_a_name_all_answer() -> None:
    """amplifier-core keeps every registration; names are for debugging only, so two
    handlers that happen to share a name (lambdas, one factory) must both be collected."""
    d = HookDispatcher()
    d.register(EVENT, lambda event, data: HookResult(data={"n": 1}))
    d.register(EVENT, lambda event, data: HookResult(data={"n": 2}), priority=1)
    assert d.list_handlers(EVENT) == {EVENT: ["<lambda>", "<lambda>"]}
    responses = await d.emit_and_collect(EVENT, {})
    assert responses == [{"n": 1}, {"n": 2}]


async def test_emit_and_collect_without_handlers_is_empty() -> None:
    d = HookDispatcher()
    assert await d.emit_and_collect("decision:tool_resolution", {"q": 1}) == []


# -- strict_events ----------------------------------------------------------------------
async def test_strict_events_raises_for_an_unknown_event_without_handlers() -> None:
    d = HookDispatcher(strict_events=True)
    with pytest.raises(UnknownEventError):
        await d.emit("tool:pree", {})
    with pytest.raises(UnknownEventError):
        await d.emit_and_collect("tool:pree", {})


@pytest.mark.parametrize("event", sorted(ALL_EVENTS))
async def test_strict_events_accepts_standard_events(event: str) -> None:
    d = HookDispatcher(strict_events=True)
    r = await d.emit(event, {"x": 1})
    assert r.action == "continue" and r.data == {"x": 1}
    assert await d.emit_and_collect(event, {"x": 1}) == []


async def test_strict_events_accepts_a_custom_event_with_a_handler() -> None:
    d = HookDispatcher(strict_events=True)
    d.register("custom:thing", lambda event, data: HookResult(action="deny", reason="r"))
    r = await d.emit("custom:thing", {})
    assert r.action == "deny"


async def test_non_strict_unknown_event_is_a_plain_continue() -> None:
    d = HookDispatcher()
    r = await d.emit("tool:pree", {"x": 1})
    assert r.action == "continue" and r.data == {"x": 1}


async def test_failure_record_shape() -> None:
    d = HookDispatcher()

    async def broken(event: str, data: dict[str, Any]) -> None:
        raise KeyError("k")

    d.register(EVENT, broken)
    r = await d.emit(EVENT, {})
    assert len(r.failures) == 1 and isinstance(r.failures[0], HandlerFailure)
