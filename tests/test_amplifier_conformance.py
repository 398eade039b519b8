"""`HookDispatcher()` with no connection is amplifier-core 2.0.2's `HookRegistry`.

Each test states one semantic of amplifier-core's own hook tests (the registry, the
timestamp, the aliases, the Python bindings' switchover, `emit_and_collect` returning
dicts, JSON sanitising) or one that amplifier-core 2.0.2 shows when probed, and checks it
through `hookbus.amplifier` — the one-line switch — so the names are amplifier-core's.
`tests/test_fold.py` covers the fold rule by rule; `tests/test_dispatch_remote.py` the
same semantics with handlers on NATS.
"""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import decimal
import uuid
from typing import Any

import pytest

import hookbus.amplifier as amplifier
import hookbus.schemas
from hookbus.amplifier import ContextInjection, HookRegistry, HookResult
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import BadRequestError

pytestmark = pytest.mark.anyio

EVENT = "test:event"


def capture(seen: list[dict[str, Any]], result: Any = None):
    async def handler(event: str, data: dict[str, Any]) -> Any:
        seen.append(data)
        return HookResult(action="continue") if result is None else result

    return handler


def returning(result: Any):
    async def handler(event: str, data: dict[str, Any]) -> Any:
        return result

    return handler


# -- the switch ----------------------------------------------------------------------------
async def test_the_amplifier_names_are_hookbus() -> None:
    assert HookRegistry is HookDispatcher
    assert amplifier.RustHookRegistry is HookDispatcher
    assert HookResult is hookbus.schemas.HookResult
    assert isinstance(HookRegistry(), HookRegistry)


async def test_the_registry_carries_amplifier_cores_eight_class_constants() -> None:
    constants = {
        "SESSION_START": "session:start",
        "SESSION_END": "session:end",
        "PROMPT_SUBMIT": "prompt:submit",
        "TOOL_PRE": "tool:pre",
        "TOOL_POST": "tool:post",
        "CONTEXT_PRE_COMPACT": "context:pre_compact",
        "ORCHESTRATOR_COMPLETE": "orchestrator:complete",
        "USER_NOTIFICATION": "user:notification",
    }
    for name, value in constants.items():
        assert getattr(HookRegistry, name) == value
        assert getattr(HookRegistry(), name) == value
    carried = {
        k for k in dir(HookRegistry) if k.isupper() and isinstance(getattr(HookRegistry, k), str)
    }
    assert carried == set(constants)  # the removed ones are gone


async def test_the_event_module_names_and_all_events() -> None:
    assert amplifier.CONTEXT_PRE_COMPACT == "context:pre_compact"
    assert amplifier.CONTENT_BLOCK_START == "content_block:start"
    assert amplifier.PROVIDER_TOOL_SEQUENCE_REPAIRED == "provider:tool_sequence_repaired"
    assert amplifier.MODULE_LOAD_FAILED == "module:load_failed"
    assert isinstance(amplifier.ALL_EVENTS, list) and len(amplifier.ALL_EVENTS) == 43
    assert amplifier.ALL_EVENTS[:3] == ["session:start", "session:end", "session:fork"]
    assert len(set(amplifier.ALL_EVENTS)) == 43
    for removed in ("AGENT_SPAWN", "AGENT_COMPLETE", "DECISION_TOOL_RESOLUTION", "ERROR_TOOL"):
        assert not hasattr(amplifier, removed)


async def test_hook_result_has_amplifier_cores_fields_and_defaults() -> None:
    r = HookResult()
    assert r.action == "continue" and r.data is None and r.reason is None
    assert r.context_injection is None and r.context_injection_role == "system"
    assert r.ephemeral is False and r.append_to_last_tool_result is False
    assert r.approval_prompt is None and r.approval_options is None
    assert r.approval_timeout == 300.0 and r.approval_default == "deny"
    assert r.suppress_output is False and r.user_message is None
    assert r.user_message_level == "info" and r.user_message_source is None
    assert r.context_injections == []
    i = ContextInjection(content="x")
    assert (i.role, i.ephemeral, i.append_to_last_tool_result, i.hook_name, i.event) == (
        "system",
        False,
        False,
        "unknown",
        "",
    )


async def test_a_field_hookbus_does_not_know_is_ignored_not_a_lost_deny() -> None:
    d = HookRegistry()
    d.register(
        EVENT,
        lambda e, data: HookResult(action="deny", reason="no", a_field_from_the_future=1),
        name="guard",
    )
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.reason == "no"


async def test_user_message_source_on_a_deny_is_a_deny() -> None:
    d = HookRegistry()
    d.register(
        EVENT,
        returning(HookResult(action="deny", reason="r", user_message_source="policy")),
        name="guard",
    )
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.user_message_source == "policy"


# -- register / on / unregister / list_handlers --------------------------------------------
async def test_register_and_on_register_and_return_the_unregister_function() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    un1 = d.register(EVENT, capture(seen), name="one")
    un2 = d.on(EVENT, capture(seen), name="two")
    assert d.list_handlers(EVENT) == {EVENT: ["one", "two"]}
    await d.emit(EVENT, {})
    assert len(seen) == 2
    un1()
    un1()  # a second call is a no-op
    assert d.list_handlers(EVENT) == {EVENT: ["two"]}
    un2()
    assert d.list_handlers() == {EVENT: []}  # an emptied event stays, with no handlers
    assert d.list_handlers("missing:event") == {"missing:event": []}


async def test_unregister_by_name() -> None:
    d = HookRegistry()
    d.register(EVENT, capture([]), name="x")
    d.register(EVENT, capture([]), name="y")
    assert d.unregister("x") is None
    assert d.list_handlers(EVENT) == {EVENT: ["y"]}
    d.unregister("not-registered")  # no-op
    assert d.list_handlers(EVENT) == {EVENT: ["y"]}


async def test_priority_lower_first_ties_in_registration_order() -> None:
    d = HookRegistry()
    order: list[str] = []

    def rec(name: str):
        async def h(event: str, data: dict[str, Any]) -> HookResult:
            order.append(name)
            return HookResult()

        return h

    d.register(EVENT, rec("p5-first"), priority=5, name="p5-first")
    d.register(EVENT, rec("p5-second"), priority=5, name="p5-second")
    d.register(EVENT, rec("neg"), priority=-1, name="neg")
    d.register(EVENT, rec("p10"), priority=10, name="p10")
    await d.emit(EVENT, {})
    assert order == ["neg", "p5-first", "p5-second", "p10"]
    assert d.list_handlers(EVENT) == {EVENT: order}


@pytest.mark.parametrize(
    ("priority", "error"),
    [(1.5, TypeError), ("1", TypeError), (None, TypeError), (2**31, OverflowError)],
)
async def test_a_priority_must_be_a_32_bit_int(priority: Any, error: type[Exception]) -> None:
    d = HookRegistry()
    with pytest.raises(error):
        d.register(EVENT, capture([]), priority=priority, name="h")
    d.register(EVENT, capture([]), priority=True, name="bool-is-an-int")
    d.register(EVENT, capture([]), priority=-(2**31), name="lowest")
    assert d.list_handlers(EVENT) == {EVENT: ["lowest", "bool-is-an-int"]}


async def test_set_default_fields_merge_under_explicit_data_and_replace_earlier_defaults() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    d.register(EVENT, capture(seen), name="c")
    d.set_default_fields(session_id="s-1", env="test")
    await d.emit(EVENT, {"custom": "value"})
    await d.emit(EVENT, {"session_id": "override"})
    d.set_default_fields(other=1)
    await d.emit(EVENT, {})
    assert seen[0]["session_id"] == "s-1" and seen[0]["env"] == "test"
    assert seen[0]["custom"] == "value"
    assert seen[1]["session_id"] == "override" and seen[1]["env"] == "test"
    assert "session_id" not in seen[2] and seen[2]["other"] == 1


# -- emit: the result -----------------------------------------------------------------------
async def test_no_handlers_continue_with_the_data_and_no_timestamp() -> None:
    r = await HookRegistry().emit("unregistered:event", {"data": "value"})
    assert r.action == "continue" and r.data == {"data": "value"}


async def test_continue_returns_the_chained_data() -> None:
    d = HookRegistry()
    d.register(EVENT, capture([]), name="c")
    r = await d.emit(EVENT, {"x": 1})
    assert r.action == "continue"
    assert r.data is not None and r.data["x"] == 1 and "timestamp" in r.data


async def test_a_modify_chain_ends_as_continue_with_the_data() -> None:
    d = HookRegistry()

    async def add(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "n": data.get("n", 0) + 1})

    d.register(EVENT, add, name="a")
    d.register(EVENT, add, name="b")
    r = await d.emit(EVENT, {"original": True})
    assert r.action == "continue"
    assert r.data is not None and r.data["n"] == 2 and r.data["original"] is True
    assert r.modified_by == ["a", "b"]  # hookbus's own field


async def test_a_deny_is_returned_as_its_handler_made_it() -> None:
    d = HookRegistry()
    calls: list[str] = []

    async def modify(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={"redacted": True})

    async def later(event: str, data: dict[str, Any]) -> HookResult:
        calls.append("later")
        return HookResult(action="ask_user", approval_prompt="never seen")

    d.register(EVENT, modify, priority=1, name="m")
    d.register(EVENT, returning(HookResult(action="deny", reason="Test denial")), 5, "deny")
    d.register(EVENT, later, priority=10, name="later")
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.reason == "Test denial"
    assert r.data is None  # the deny handler returned no data
    assert r.chained_data == {"redacted": True}  # hookbus's own field
    assert calls == []  # short-circuit


async def test_ask_user_wins_over_inject_context_in_either_order() -> None:
    for first, second in (("ask", "inject"), ("inject", "ask")):
        d = HookRegistry()
        results = {
            "ask": HookResult(
                action="ask_user", approval_prompt="Allow?", approval_options=["Allow", "Deny"]
            ),
            "inject": HookResult(action="inject_context", context_injection="context"),
        }
        d.register(EVENT, returning(results[first]), priority=5, name=first)
        d.register(EVENT, returning(results[second]), priority=10, name=second)
        r = await d.emit(EVENT, {})
        assert r.action == "ask_user" and r.approval_prompt == "Allow?"
        assert r.approval_default == "deny"


async def test_injections_from_two_handlers_merge() -> None:
    d = HookRegistry()
    d.register(EVENT, returning(HookResult(action="inject_context", context_injection="A")), 5)
    d.register(EVENT, returning(HookResult(action="inject_context", context_injection="B")), 9)
    r = await d.emit(EVENT, {})
    assert r.action == "inject_context"
    assert r.context_injection == "A\n\nB"
    assert [i.content for i in r.context_injections] == ["A", "B"]
    assert all(i.event == EVENT for i in r.context_injections)


async def test_an_empty_injection_text_still_injects() -> None:
    d = HookRegistry()
    d.register(EVENT, returning(HookResult(action="inject_context", context_injection="")), 1)
    d.register(EVENT, returning(HookResult(action="inject_context", context_injection="A")), 2)
    r = await d.emit(EVENT, {})
    assert r.action == "inject_context" and r.context_injection == "\n\nA"


async def test_a_failing_handler_is_skipped() -> None:
    d = HookRegistry()

    async def failing(event: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("Test error")

    d.register(EVENT, failing, priority=5, name="failing")
    d.register(EVENT, returning(HookResult(action="modify", data={"still_works": True})), 10)
    r = await d.emit(EVENT, {})
    assert r.action == "continue" and r.data == {"still_works": True}
    assert [f.handler for f in r.failures] == ["failing"]  # hookbus: never silent


@pytest.mark.parametrize(
    "bad",
    ["str", 42, [1], {"action": "bogus"}, HookResult(action="bogus"),  # type: ignore[arg-type]
     HookResult(action="modify", data="ok")],  # type: ignore[arg-type]
)  # fmt: skip
async def test_a_result_that_cannot_be_read_is_denied(bad: Any) -> None:
    d = HookRegistry()
    calls: list[str] = []
    d.register(EVENT, returning(bad), priority=1, name="weird")
    d.register(EVENT, capture([], HookResult()), priority=2, name="later")
    d.register(EVENT, lambda e, data: calls.append("later2"), priority=3, name="later2")
    r = await d.emit(EVENT, {})
    assert r.action == "deny" and r.reason == "Hook handler returned invalid response"
    assert calls == []


@pytest.mark.parametrize(
    ("returned", "action"),
    [
        (None, "continue"),
        ({"action": "deny", "unknown_key": 1}, "deny"),
        ({"reason": "no action is continue"}, "continue"),
    ],
)
async def test_none_and_dicts_are_results(returned: Any, action: str) -> None:
    d = HookRegistry()
    d.register(EVENT, returning(returned), name="h")
    assert (await d.emit(EVENT, {})).action == action


async def test_sync_and_async_handlers() -> None:
    d = HookRegistry()
    d.register(EVENT, lambda e, data: {"action": "deny", "reason": "sync"}, name="sync")
    assert (await d.emit(EVENT, {})).reason == "sync"


async def test_a_dict_result_with_context_injection_items() -> None:
    d = HookRegistry()
    items = [{"content": "i1", "role": "user"}, {"content": "i2", "ephemeral": True}]
    d.register(EVENT, returning({"action": "inject_context", "context_injections": items}), 0, "h")
    r = await d.emit(EVENT, {})
    assert r.context_injection == "i1\n\ni2" and r.context_injection_role == "user"
    assert r.ephemeral is True
    assert [(i.hook_name, i.event) for i in r.context_injections] == [("h", EVENT)] * 2


# -- each handler its own copy ------------------------------------------------------------
async def test_in_place_edits_are_seen_by_no_other_handler_nor_the_caller() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []

    async def mutate(event: str, data: dict[str, Any]) -> HookResult:
        data["mutated"] = True
        data["nested"]["x"] = 99
        return HookResult(action="continue")

    d.register(EVENT, mutate, priority=0, name="mutate")
    d.register(EVENT, capture(seen), priority=1, name="see")
    caller = {"nested": {"x": 1}}
    r = await d.emit(EVENT, caller)
    assert "mutated" not in seen[0] and seen[0]["nested"] == {"x": 1}
    assert caller == {"nested": {"x": 1}}
    assert r.data is not None and "mutated" not in r.data


async def test_a_modify_result_is_copied_before_the_next_handler_sees_it() -> None:
    d = HookRegistry()
    kept: dict[str, Any] = {"v": 1}
    seen: list[dict[str, Any]] = []

    async def modify(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data=kept)

    async def mutate(event: str, data: dict[str, Any]) -> HookResult:
        data["v"] = 2
        return HookResult()

    d.register(EVENT, modify, priority=0, name="modify")
    d.register(EVENT, mutate, priority=1, name="mutate")
    d.register(EVENT, capture(seen), priority=2, name="see")
    r = await d.emit(EVENT, {})
    assert seen[0] == {"v": 1} and r.data == {"v": 1}
    kept["v"] = 3  # the handler's own dict, changed after the emit, changes nothing
    assert r.data == {"v": 1}


# -- the timestamp ------------------------------------------------------------------------
async def test_emit_stamps_an_rfc3339_utc_timestamp_callers_cannot_set() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    d.register(EVENT, capture(seen), name="c")
    d.set_default_fields(timestamp="from-defaults")
    await d.emit(EVENT, {"timestamp": "caller-supplied"})
    await asyncio.sleep(0.001)
    await d.emit(EVENT, {})
    first, second = seen[0]["timestamp"], seen[1]["timestamp"]
    for ts in (first, second):
        assert ts.endswith("+00:00")
        parsed = dt.datetime.fromisoformat(ts)
        assert parsed.utcoffset() == dt.timedelta(0)
        assert len(ts.split(".")[1]) == len("123456789+00:00")  # nanoseconds
    assert first < second


async def test_every_handler_of_one_emit_sees_the_same_timestamp() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    d.register(EVENT, capture(seen), name="a")
    d.register(EVENT, capture(seen), name="b")
    await d.emit(EVENT, {})
    assert seen[0]["timestamp"] == seen[1]["timestamp"]


# -- emit_and_collect ---------------------------------------------------------------------
async def test_emit_and_collect_returns_each_handlers_data_dict_in_priority_order() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    d.set_default_fields(session_id="s")
    d.register(EVENT, capture(seen, HookResult(data={"key": "value", "count": 42})), 1, "b")
    d.register(EVENT, capture(seen, HookResult(action="deny", data={"first": 1})), 0, "a")
    d.register(EVENT, capture(seen, HookResult()), 2, "no-data")
    d.register(EVENT, capture(seen, HookResult(data={})), 3, "empty")
    out = await d.emit_and_collect(EVENT, {"trigger": True}, timeout=1.0)
    assert out == [{"first": 1}, {"key": "value", "count": 42}, {}]
    assert all(s == {"trigger": True} for s in seen)  # no defaults, no timestamp, no chain


async def test_emit_and_collect_drops_failures_and_late_handlers() -> None:
    d = HookRegistry()

    async def slow(event: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(5)
        return HookResult(data={"slow": 1})

    async def boom(event: str, data: dict[str, Any]) -> HookResult:
        raise RuntimeError("boom")

    d.register(EVENT, slow, name="slow")
    d.register(EVENT, boom, name="boom")
    d.register(EVENT, returning("not a result"), name="bad")
    d.register(EVENT, returning(HookResult(data={"fast": 1})), name="fast")
    assert await d.emit_and_collect(EVENT, {}, timeout=0.2) == [{"fast": 1}]
    assert await HookRegistry().emit_and_collect(EVENT, {}) == []


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), None])
async def test_emit_and_collect_refuses_a_bad_timeout(timeout: Any) -> None:
    d = HookRegistry()
    d.register(EVENT, returning(HookResult(data={"x": 1})), name="h")
    with pytest.raises(BadRequestError):
        await d.emit_and_collect(EVENT, {}, timeout=timeout)


# -- JSON-safe data -----------------------------------------------------------------------
class _Color:
    def __str__(self) -> str:
        return "Color.RED"


SANITISED = [
    (decimal.Decimal("1.23"), "1.23"),
    (dt.datetime(2024, 1, 1, 12, 0, 0), "2024-01-01 12:00:00"),
    (dt.datetime(2024, 1, 1, 12, 0, 0, tzinfo=dt.UTC), "2024-01-01 12:00:00+00:00"),
    (dt.date(2024, 1, 2), "2024-01-02"),
    ({1, 2, 3}, "{1, 2, 3}"),
    (b"ab", "b'ab'"),
    ((1, 2), [1, 2]),
    (uuid.UUID(int=1), "00000000-0000-0000-0000-000000000001"),
    (_Color(), "Color.RED"),
    ({1: "a", 2.5: "b", None: "c", False: "d"}, {"1": "a", "2.5": "b", "null": "c", "false": "d"}),
    ({"nested": [decimal.Decimal("2")]}, {"nested": ["2"]}),
]


@pytest.mark.parametrize(("value", "expected"), SANITISED, ids=lambda v: type(v).__name__)
async def test_emit_hands_handlers_json_safe_data(value: Any, expected: Any) -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    d.register(EVENT, capture(seen), name="c")
    r = await d.emit(EVENT, {"v": value})
    assert seen[0]["v"] == expected
    assert r.data is not None and r.data["v"] == expected
    assert await d.emit_and_collect(EVENT, {"v": value}) == []
    assert seen[1]["v"] == expected
    assert (await HookRegistry().emit(EVENT, {"v": value})).data == {"v": expected}


@pytest.mark.parametrize(
    "bad", [{"v": float("nan")}, {"v": float("inf")}, {(1, 2): "tuple key"}, "not a dict"]
)
async def test_data_json_cannot_hold_is_a_clear_error(bad: Any) -> None:
    d = HookRegistry()
    d.register(EVENT, capture([]), name="c")
    with pytest.raises(BadRequestError, match=r"JSON|dict"):
        await d.emit(EVENT, bad)
    with pytest.raises(BadRequestError, match=r"JSON|dict"):
        await d.emit_and_collect(EVENT, bad)


async def test_data_referring_to_itself_is_a_clear_error() -> None:
    loop: dict[str, Any] = {}
    loop["self"] = loop
    d = HookRegistry()
    d.register(EVENT, capture([]), name="c")
    with pytest.raises(BadRequestError, match="JSON"):
        await d.emit(EVENT, loop)


async def test_a_handler_result_with_a_decimal_is_made_json() -> None:
    d = HookRegistry()
    seen: list[dict[str, Any]] = []
    cost = {"action": "modify", "data": {"cost": decimal.Decimal("2.50")}}
    d.register(EVENT, lambda e, data: cost, 0, "m")
    d.register(EVENT, capture(seen), priority=1, name="see")
    r = await d.emit(EVENT, {"input": "test"})
    assert seen[0] == {"cost": "2.50"} and r.data == {"cost": "2.50"}
    d2 = HookRegistry()
    d2.register(EVENT, lambda e, data: HookResult(data={"cost": decimal.Decimal("1.5")}), 0, "c")
    assert await d2.emit_and_collect(EVENT, {}) == [{"cost": "1.5"}]


# -- the event loop and context of the emit ---------------------------------------------------
async def test_async_handlers_run_on_the_emitting_loop_with_its_contextvars() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("hook_context_value")
    d = HookRegistry()
    loops: list[asyncio.AbstractEventLoop] = []
    var.set("A")

    async def handler(event: str, data: dict[str, Any]) -> dict[str, Any]:
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        return {"action": "deny", "reason": f"context={var.get()}"}

    d.register(EVENT, handler, 0, name="h")
    var.set("B")
    r = await d.emit(EVENT, {})
    assert r.reason == "context=B" and loops == [asyncio.get_running_loop()]


def test_a_registry_made_outside_a_loop_emits_from_asyncio_run() -> None:
    d = HookRegistry()

    async def handler(event: str, data: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"action": "deny", "reason": "async denial"}

    d.register("test:async-hook", handler, 0, name="outside-loop")
    r = asyncio.run(d.emit("test:async-hook", {}))
    assert r.action == "deny" and r.reason == "async denial"
