"""The fold's rules and the handler option set, each written once in `hookbus._core`: the
signatures that spell the options out for IDEs list exactly the one definition's options,
with its defaults, and both sides of a chain group, chain and stop by the same functions."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from hookbus._core.declarations import COMPARED_FIELDS
from hookbus._core.fold_rules import (
    failure_policy_applied,
    group_end,
    modifies,
    parallel_groups,
    refused_modify,
    widest_group,
)
from hookbus._core.handler_options import (
    DEFAULT_FAILURE_POLICY,
    DEFAULT_PRIORITY,
    DEFAULT_TIMEOUT_S,
    DEFAULTS,
    LOCAL_OPTIONS,
    OPTIONS,
    HandlerOptions,
    ToolFilter,
)
from hookbus.dispatcher import HookDispatcher
from hookbus.dispatcher._local_handlers import LocalHandlers
from hookbus.dispatcher._route_table import Route
from hookbus.schemas import ChainStep, HandlerDeclaration, HookResult, RequiredHandler
from hookbus.workers import HookWorker

ROOT = Path(__file__).resolve().parents[1]
NOT_OPTIONS = {"self", "event", "fn", "handler", "name", "replace"}


def _options(fn: Callable[..., Any]) -> dict[str, Any]:
    """The option parameters of `fn` and their defaults."""
    params = inspect.signature(fn).parameters
    return {n: p.default for n, p in params.items() if n not in NOT_OPTIONS}


def _defaults(options: tuple[str, ...], **overrides: Any) -> dict[str, Any]:
    out = {o: getattr(DEFAULTS, o) for o in options}
    out["tool_filter"] = None  # ToolFilter.EVERY, as a signature spells it
    return out | overrides


def test_the_defaults_are_the_wire_contracts() -> None:
    fields = {f.name: f.default for f in msgspec.structs.fields(HandlerDeclaration)}
    assert {o: fields[o] for o in OPTIONS} == DEFAULTS.declared()
    assert (DEFAULT_PRIORITY, DEFAULT_TIMEOUT_S, DEFAULT_FAILURE_POLICY) == (0, 5.0, "ignore")
    assert DEFAULTS.tool_filter is ToolFilter.EVERY
    assert ChainStep(handler="h").timeout_s == DEFAULT_TIMEOUT_S
    assert RequiredHandler(event="e", name="h").timeout_s == DEFAULT_TIMEOUT_S
    assert COMPARED_FIELDS == OPTIONS


@pytest.mark.parametrize("fn", [HookWorker.handler, HookWorker.add_handler, HandlerOptions.remote])
def test_a_workers_signatures_list_the_option_set_with_its_defaults(
    fn: Callable[..., Any],
) -> None:
    assert _options(fn) == _defaults(OPTIONS)


def _register_signatures() -> list[Callable[..., Any]]:
    overloads = typing.get_overloads(HookDispatcher.register)
    return [HookDispatcher.register, LocalHandlers.register, HandlerOptions.local, *overloads]


@pytest.mark.parametrize("fn", _register_signatures())
def test_register_lists_the_in_process_option_set_with_its_defaults(
    fn: Callable[..., Any],
) -> None:
    assert _options(fn) == _defaults(LOCAL_OPTIONS, timeout_s=None)


def test_routes_and_declarations_take_every_option() -> None:
    make = inspect.signature(Route.make).parameters
    assert set(OPTIONS) <= set(make)
    fields = {f.name for f in msgspec.structs.fields(HandlerDeclaration)}
    assert set(OPTIONS) <= fields
    assert set(LOCAL_OPTIONS) == set(OPTIONS) - {"retry_safe"}


def test_a_declaration_round_trips_through_the_options() -> None:
    options = HandlerOptions.remote(
        priority=3, timeout_s=1.5, failure_policy="deny", tool_filter=["Bash"], pure=True
    )
    decl = HandlerDeclaration(event="e", name="h", **options.declared())
    route = Route.from_declaration(decl)
    assert {o: getattr(route, o) for o in OPTIONS} == {
        "priority": 3,
        "tool_filter": ("Bash",),
        "failure_policy": "deny",
        "timeout_s": 1.5,
        "parallel": False,
        "retry_safe": True,
        "pure": True,
    }


# -- the fold's rules ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "groups"),
    [
        ([], []),
        ([False, False], [(0, 1), (1, 2)]),
        ([True, True, False, True], [(0, 2), (2, 3), (3, 4)]),
        ([False, True, True, True], [(0, 1), (1, 4)]),
    ],
)
def test_parallel_groups(flags: list[bool], groups: list[tuple[int, int]]) -> None:
    assert list(parallel_groups(flags)) == groups
    assert [group_end(flags, i) for i, _ in groups] == [j for _, j in groups]
    assert widest_group(flags) == max((j - i for i, j in groups), default=1)


def test_chaining_and_the_failure_rules() -> None:
    assert modifies(HookResult(action="modify", data={"a": 1}))
    assert not modifies(HookResult(action="modify"))
    assert not modifies(HookResult(action="continue", data={"a": 1}))
    assert failure_policy_applied("bad_reply", "ignore") == "deny"
    assert failure_policy_applied("timeout", "ignore") == "ignore"
    assert refused_modify("modify", parallel=True)
    assert not refused_modify("modify", parallel=False)
    assert not refused_modify("continue", parallel=True)


def test_both_sides_fold_by_the_one_set_of_rules() -> None:
    """The dispatcher's fold and a worker serving a chain import the rules, never a copy."""
    for path in (
        "dispatcher/hookbus/dispatcher/_fold.py",
        "dispatcher/hookbus/dispatcher/_folding.py",
        "workers/hookbus/workers/_chains.py",
    ):
        assert "from hookbus._core.fold_rules import" in (ROOT / path).read_text(), path
    for path in (
        "dispatcher/hookbus/dispatcher/_calls.py",
        "dispatcher/hookbus/dispatcher/_chain_calls.py",
        "dispatcher/hookbus/dispatcher/_requester.py",
        "workers/hookbus/workers/_worker.py",
        "workers/hookbus/workers/_chains.py",
        "workers/hookbus/workers/_handler_call.py",
        "workers/hookbus/workers/_requests.py",
    ):
        text = (ROOT / path).read_text()
        assert "DEFAULT_TIMEOUT_S = " not in text and "timeout_s: float = 5.0" not in text
