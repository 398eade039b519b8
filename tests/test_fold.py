"""The fold of handler results, pure (no server): amplifier-core 2.0.2's
`HookRegistry.emit` semantics, result for result, plus hookbus's own fields (see
`hookbus.dispatcher._fold`).

Most tests feed `Fold` directly, in priority order, the way the dispatcher does; the
short-circuit tests also go through an in-process `HookDispatcher` to show that a later
handler is never called.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from hookbus.dispatcher import Fold, HookDispatcher
from hookbus.dispatcher._fold import INVALID_RESULT_REASON
from hookbus.schemas import ContextInjection, HandlerFailure, HookResult

DATA = {"tool_name": "bash", "command": "ls"}


def fold_all(
    results: list[tuple[str, HookResult]], data: dict[str, Any] | None = None
) -> HookResult:
    """Fold `(handler, result)` pairs in order, stopping at a deny, as the dispatcher does."""
    fold = Fold(dict(data if data is not None else DATA), "tool:pre")
    for name, result in results:
        denied = fold.apply(name, result)
        if denied is not None:
            return denied
    return fold.result()


# -- continue --------------------------------------------------------------------------
def test_no_results_continue_with_data_unchanged() -> None:
    r = fold_all([])
    assert r.action == "continue"
    assert r.data == DATA and r.chained_data == DATA
    assert r.failures == [] and r.context_injections == [] and r.decided_by is None


def test_continue_results_keep_data() -> None:
    r = fold_all([("a", HookResult()), ("b", HookResult(action="continue", reason="fine"))])
    assert r.action == "continue"
    assert r.data == DATA
    assert r.reason is None  # a continue result's fields do not leak into the fold
    assert r.decided_by is None


def test_continue_with_data_does_not_change_the_chain() -> None:
    r = fold_all([("a", HookResult(action="continue", data={"other": 1}))])
    assert r.action == "continue"
    assert r.data == DATA


# -- deny ------------------------------------------------------------------------------
def test_deny_returns_at_once_with_the_denying_result() -> None:
    fold = Fold(dict(DATA))
    assert fold.apply("a", HookResult()) is None
    denied = fold.apply(
        "guard", HookResult(action="deny", reason="no bash", user_message="blocked")
    )
    assert denied is not None
    assert denied.action == "deny"
    assert denied.reason == "no bash"
    assert denied.user_message == "blocked"
    assert denied.decided_by == "guard"
    assert denied.data is None  # as the handler made it (amplifier-core)
    assert denied.chained_data == DATA  # hookbus: the chained data on a field of its own


def test_deny_short_circuits_later_results() -> None:
    later = [
        ("asker", HookResult(action="ask_user", approval_prompt="ok?")),
        ("injector", HookResult(action="inject_context", context_injection="later")),
        ("modifier", HookResult(action="modify", data={"later": True})),
        ("denier2", HookResult(action="deny", reason="second")),
    ]
    r = fold_all([("denier", HookResult(action="deny", reason="first")), *later])
    assert r.action == "deny"
    assert r.reason == "first"
    assert r.decided_by == "denier"
    assert r.data is None and r.chained_data == DATA
    assert r.context_injections == []
    assert r.approval_prompt is None


def test_deny_keeps_what_was_folded_before_it() -> None:
    r = fold_all(
        [
            ("redact", HookResult(action="modify", data={"command": "***"})),
            ("note", HookResult(action="inject_context", context_injection="careful")),
            ("guard", HookResult(action="deny", reason="no")),
        ]
    )
    assert r.action == "deny" and r.decided_by == "guard"
    assert r.data is None and r.chained_data == {"command": "***"}
    assert r.context_injections == []  # the deny as its handler made it
    assert r.modified_by == ["redact"]


def test_deny_keeps_the_data_its_handler_put_on_it() -> None:
    r = fold_all(
        [
            ("redact", HookResult(action="modify", data={"command": "***"})),
            ("guard", HookResult(action="deny", reason="no", data={"why": "policy"})),
        ]
    )
    assert r.data == {"why": "policy"} and r.chained_data == {"command": "***"}


@pytest.mark.anyio
async def test_deny_short_circuit_later_handler_never_called() -> None:
    d = HookDispatcher()
    called: list[str] = []

    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        called.append("guard")
        return HookResult(action="deny", reason="blocked")

    async def later(event: str, data: dict[str, Any]) -> HookResult:
        called.append("later")
        return HookResult(action="inject_context", context_injection="never")

    d.register("tool:pre", later, priority=10)
    d.register("tool:pre", guard, priority=1)
    r = await d.emit("tool:pre", dict(DATA))
    assert called == ["guard"]
    assert r.action == "deny" and r.reason == "blocked" and r.decided_by == "guard"


# -- modify ----------------------------------------------------------------------------
def test_modify_replaces_the_data_whole() -> None:
    fold = Fold(dict(DATA))
    assert fold.apply("redact", HookResult(action="modify", data={"command": "***"})) is None
    assert fold.data == {"command": "***"}  # not merged: tool_name is gone
    r = fold.result()
    assert r.action == "continue"  # a modify chain ends as continue with its data
    assert r.data == {"command": "***"} and r.chained_data == r.data
    assert r.decided_by == "redact"
    assert r.modified_by == ["redact"]


def test_modify_chains_to_the_next_handler() -> None:
    fold = Fold({"n": 0})
    for name in ("a", "b", "c"):
        fold.apply(name, HookResult(action="modify", data={"n": fold.data["n"] + 1}))
    r = fold.result()
    assert r.action == "continue"
    assert r.data == {"n": 3}
    assert r.modified_by == ["a", "b", "c"]
    assert r.decided_by == "c"  # the last one that modified the data


def test_modify_with_data_none_is_ignored() -> None:
    r = fold_all([("noop", HookResult(action="modify", data=None))])
    assert r.action == "continue"
    assert r.data == DATA
    assert r.modified_by == [] and r.decided_by is None


def test_modify_with_data_none_does_not_undo_an_earlier_modify() -> None:
    r = fold_all(
        [
            ("a", HookResult(action="modify", data={"x": 1})),
            ("b", HookResult(action="modify", data=None)),
        ]
    )
    assert r.action == "continue"
    assert r.data == {"x": 1}
    assert r.modified_by == ["a"] and r.decided_by == "a"


def test_modify_with_empty_dict_replaces() -> None:
    r = fold_all([("wipe", HookResult(action="modify", data={}))])
    assert r.action == "continue"
    assert r.data == {}


# -- inject_context --------------------------------------------------------------------
LINT_INJECTION = {
    "context_injection": "lint: 2 issues",
    "context_injection_role": "user",
    "ephemeral": True,
    "append_to_last_tool_result": True,
    "suppress_output": True,
    "user_message": "linted",
    "user_message_level": "warning",
    "user_message_source": "linter",
    "reason": "lint",
}
"""Every field an injecting result carries, none at its default."""


def test_single_injection_returned_as_its_handler_made_it() -> None:
    injection = HookResult(action="inject_context", **LINT_INJECTION)  # type: ignore[arg-type]
    r = fold_all([("redact", HookResult(action="modify", data={"x": 1})), ("lint", injection)])
    assert r.action == "inject_context"
    assert {field: getattr(r, field) for field in LINT_INJECTION} == LINT_INJECTION
    assert r.data is None  # the injecting handler's (amplifier-core)
    assert r.chained_data == {"x": 1}
    assert r.context_injections == [
        ContextInjection(content="lint: 2 issues", role="user", ephemeral=True,
                         append_to_last_tool_result=True, hook_name="lint", event="tool:pre")
    ]  # fmt: skip
    assert r.decided_by == "lint"
    assert r.modified_by == ["redact"]


def test_injections_merge_joined_by_blank_line() -> None:
    first = HookResult(action="inject_context", context_injection="one",
                       context_injection_role="assistant", ephemeral=False,
                       append_to_last_tool_result=False, suppress_output=True,
                       user_message="first says", reason="first")  # fmt: skip
    second = HookResult(action="inject_context", context_injection="two",
                        context_injection_role="user", ephemeral=True,
                        append_to_last_tool_result=True, suppress_output=False)  # fmt: skip
    third = HookResult(action="inject_context", context_injection="three")
    r = fold_all([("a", first), ("b", second), ("c", third)])
    assert r.action == "inject_context"
    assert r.context_injection == "one\n\ntwo\n\nthree"
    assert r.context_injection_role == "assistant"  # the first item's
    assert r.ephemeral is True  # any item's
    assert r.append_to_last_tool_result is True  # any item's
    assert r.suppress_output is True  # the first result's
    assert r.user_message is None and r.reason is None  # a new result: nothing else kept
    assert r.data is None and r.chained_data == DATA
    assert r.decided_by == "a"  # the first injector
    # lossless: every injection with its own hook, event and flags, in order
    assert r.context_injections == [
        ContextInjection(content="one", role="assistant", hook_name="a", event="tool:pre"),
        ContextInjection(
            content="two",
            role="user",
            ephemeral=True,
            append_to_last_tool_result=True,
            hook_name="b",
            event="tool:pre",
        ),
        ContextInjection(content="three", hook_name="c", event="tool:pre"),
    ]


@pytest.mark.parametrize("flagged_first", [True, False])
def test_merged_flags_are_any_items_and_suppress_output_the_first_results(
    flagged_first: bool,
) -> None:
    plain = HookResult(action="inject_context", context_injection="plain")
    flagged = HookResult(
        action="inject_context",
        context_injection="flagged",
        ephemeral=True,
        append_to_last_tool_result=True,
        suppress_output=True,
        context_injection_role="user",
    )
    order = [("f", flagged), ("p", plain)] if flagged_first else [("p", plain), ("f", flagged)]
    r = fold_all(order)
    assert r.ephemeral is True and r.append_to_last_tool_result is True
    assert r.suppress_output is flagged_first
    assert r.context_injection_role == ("user" if flagged_first else "system")


def test_injection_items_of_one_result_are_projected() -> None:
    items = [
        ContextInjection(content="i1", role="user"),
        ContextInjection(content="i2", ephemeral=True),
    ]
    r = fold_all([("h", HookResult(action="inject_context", context_injections=items))])
    assert r.action == "inject_context"
    assert r.context_injection == "i1\n\ni2"
    assert r.context_injection_role == "user" and r.ephemeral is True
    assert [(i.content, i.hook_name, i.event) for i in r.context_injections] == [
        ("i1", "h", "tool:pre"),
        ("i2", "h", "tool:pre"),
    ]


def test_injection_items_win_over_the_scalar_text() -> None:
    r = fold_all(
        [
            (
                "h",
                HookResult(
                    action="inject_context",
                    context_injection="scalar",
                    context_injections=[ContextInjection(content="item")],
                ),
            )
        ]
    )
    assert r.context_injection == "item"


def test_injection_without_text_is_not_counted() -> None:
    r = fold_all([("empty", HookResult(action="inject_context", context_injection=None))])
    assert r.action == "continue"
    assert r.context_injections == []
    r = fold_all(
        [
            ("empty", HookResult(action="inject_context")),
            ("one", HookResult(action="inject_context", context_injection="b", user_message="u")),
        ]
    )
    assert r.context_injection == "b" and r.user_message == "u"  # one injector: as is


def test_continue_with_injection_text_injects_nothing() -> None:
    r = fold_all([("h", HookResult(action="continue", context_injection="zz"))])
    assert r.action == "continue" and r.context_injection is None


# -- ask_user --------------------------------------------------------------------------
def test_first_ask_user_kept() -> None:
    r = fold_all(
        [
            (
                "first",
                HookResult(
                    action="ask_user", approval_prompt="first?", approval_options=["y", "n"]
                ),
            ),
            ("second", HookResult(action="ask_user", approval_prompt="second?")),
        ]
    )
    assert r.action == "ask_user"
    assert r.approval_prompt == "first?"
    assert r.approval_options == ["y", "n"]
    assert r.decided_by == "first"
    assert r.data is None and r.chained_data == DATA


def test_ask_user_does_not_stop_the_chain() -> None:
    r = fold_all(
        [
            ("asker", HookResult(action="ask_user", approval_prompt="ok?")),
            ("redact", HookResult(action="modify", data={"x": 1})),
        ]
    )
    assert r.action == "ask_user"
    assert r.chained_data == {"x": 1}  # later handlers ran and their modify chained


# -- precedence: deny > ask_user > inject_context > modify (ends as continue) > continue --
RANK = {"continue": 0, "modify": 1, "inject_context": 2, "ask_user": 3, "deny": 4}


def sample(action: str, name: str) -> HookResult:
    match action:
        case "deny":
            return HookResult(action="deny", reason=f"deny by {name}")
        case "ask_user":
            return HookResult(action="ask_user", approval_prompt=f"ask by {name}")
        case "inject_context":
            return HookResult(action="inject_context", context_injection=f"inject by {name}")
        case "modify":
            return HookResult(action="modify", data={"by": name})
        case _:
            return HookResult(action="continue")


@pytest.mark.parametrize(
    "actions",
    [
        *itertools.permutations(RANK, 2),
        *itertools.permutations(["ask_user", "inject_context", "modify", "continue"], 3),
        *itertools.permutations(["deny", "ask_user", "inject_context", "modify"], 4),
    ],
    ids=lambda a: ">".join(a),
)
def test_precedence(actions: tuple[str, ...]) -> None:
    names = [f"h{i}" for i in range(len(actions))]
    r = fold_all([(n, sample(a, n)) for n, a in zip(names, actions, strict=True)])
    expected = max(actions, key=RANK.__getitem__)
    assert r.action == ("continue" if expected == "modify" else expected)
    if expected == "deny":
        i = actions.index("deny")
        assert r.decided_by == names[i] and r.reason == f"deny by {names[i]}"
        folded = actions[:i]  # short-circuit: what came after the deny never counts
    else:
        folded = actions
    if expected == "ask_user":
        i = actions.index("ask_user")
        assert r.decided_by == names[i] and r.approval_prompt == f"ask by {names[i]}"
    modifiers = [names[i] for i, a in enumerate(folded) if a == "modify"]
    if expected == "inject_context":
        injector = names[actions.index("inject_context")]
        assert r.decided_by == injector
        assert r.context_injection == f"inject by {injector}"
    if expected == "modify":
        assert r.decided_by == modifiers[-1]
    if expected == "continue":
        assert r.decided_by is None
    assert r.modified_by == modifiers
    # chained data: the last modify folded (before a deny), else the original
    chained = {"by": modifiers[-1]} if modifiers else DATA
    assert r.chained_data == chained
    # data: the chain's for a continue; the deciding handler's (None here) otherwise
    assert r.data == (chained if expected in ("modify", "continue") else None)
    if expected == "inject_context":
        injectors = [names[i] for i, a in enumerate(folded) if a == "inject_context"]
        assert [c.hook_name for c in r.context_injections] == injectors


# -- failures --------------------------------------------------------------------------
def test_failure_under_ignore_is_recorded_and_the_fold_continues() -> None:
    fold = Fold(dict(DATA))
    assert fold.fail("flaky", "timeout", "ignore", "no reply within 1.0s") is None
    assert fold.apply("redact", HookResult(action="modify", data={"x": 1})) is None
    assert fold.fail("gone", "no_responders", "ignore", "") is None
    r = fold.result()
    assert r.action == "continue"
    assert r.data == {"x": 1}
    assert r.decided_by == "redact"
    assert r.failures == [
        HandlerFailure(
            handler="flaky", kind="timeout", policy="ignore", message="no reply within 1.0s"
        ),
        HandlerFailure(handler="gone", kind="no_responders", policy="ignore", message=""),
    ]
    assert fold.failures == r.failures


def test_failure_under_ignore_keeps_a_later_deny_and_its_failures() -> None:
    fold = Fold(dict(DATA))
    fold.fail("flaky", "error", "ignore", "RuntimeError: boom")
    denied = fold.apply("guard", HookResult(action="deny", reason="no"))
    assert denied is not None
    assert denied.decided_by == "guard"
    assert [(f.handler, f.kind, f.policy) for f in denied.failures] == [
        ("flaky", "error", "ignore")
    ]


@pytest.mark.parametrize("kind", ["timeout", "no_responders", "error", "bad_reply"])
def test_failure_under_deny_fails_closed(kind: str) -> None:
    fold = Fold(dict(DATA))
    fold.apply("note", HookResult(action="inject_context", context_injection="hi"))
    fold.apply("redact", HookResult(action="modify", data={"x": 1}))
    denied = fold.fail("security", kind, "deny", "detail text")  # type: ignore[arg-type]
    assert denied is not None
    assert denied.action == "deny"
    assert denied.decided_by == "security"
    assert denied.reason is not None
    if kind == "bad_reply":  # amplifier-core's words; the details are on the failure
        assert denied.reason == INVALID_RESULT_REASON
    else:
        assert "security" in denied.reason and kind in denied.reason
        assert "detail text" in denied.reason
    assert denied.failures == [
        HandlerFailure(handler="security", kind=kind, policy="deny", message="detail text")  # type: ignore[arg-type]
    ]
    assert denied.data is None and denied.chained_data == {"x": 1}
    assert denied.context_injections == []


def test_failure_under_deny_overrides_an_earlier_ask_user() -> None:
    fold = Fold(dict(DATA))
    fold.apply("asker", HookResult(action="ask_user", approval_prompt="ok?"))
    denied = fold.fail("security", "timeout", "deny", "")
    assert denied is not None
    assert denied.action == "deny" and denied.decided_by == "security"
    assert denied.approval_prompt is None


def test_failures_listed_on_inject_and_ask_results() -> None:
    fold = Fold(dict(DATA))
    fold.fail("a", "error", "ignore", "bad")
    fold.apply("note", HookResult(action="inject_context", context_injection="hi"))
    assert [f.handler for f in fold.result().failures] == ["a"]
    fold.apply("asker", HookResult(action="ask_user", approval_prompt="ok?"))
    r = fold.result()
    assert r.action == "ask_user" and [f.handler for f in r.failures] == ["a"]
    assert r.context_injections == []  # the ask_user as its handler made it


@pytest.mark.parametrize("policy", ["ignore", "deny"])
def test_a_result_that_cannot_be_read_is_denied_whatever_the_policy(policy: str) -> None:
    fold = Fold(dict(DATA))
    denied = fold.fail("weird", "bad_reply", policy, "handler returned int")  # type: ignore[arg-type]
    assert denied is not None and denied.action == "deny"
    assert denied.reason == INVALID_RESULT_REASON
    assert [(f.handler, f.kind, f.policy, f.message) for f in denied.failures] == [
        ("weird", "bad_reply", "deny", "handler returned int")
    ]
