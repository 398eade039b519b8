"""A handler's options have one definition: what a worker may declare, what an in-process
handler may be registered with, what the registry accepts, how tool filters match and
where the fold stops. Against a real nats-server, with real workers; nothing of the bus
is mocked.

The names of `hookbus._core.handler_options` are imported inside the tests that use
them, so every other test here runs (and fails for its own reason) on code without it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import math
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import Connect
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from test_cli_output import serve, stop
from test_registry import bucket, sentinel

from hookbus.dispatcher import HookDispatcher, require_handler
from hookbus.dispatcher._route_table import Route
from hookbus.schemas import (
    HANDLERS_BUCKET,
    BadRequestError,
    HandlerDeclaration,
    HookResult,
    decode,
    handler_key,
    required_key,
)
from hookbus.workers import HookWorker
from hookbus.workers._worker import HandlerSpec

pytestmark = pytest.mark.anyio

CLAMP_S = 60.0
"""`MAX_HANDLER_TIMEOUT_S`, spelled out so these tests run on code that lacks it too."""


async def noop(event: str, data: dict[str, Any]) -> None:
    return None


def failures(result: HookResult) -> list[tuple[str, str, str]]:
    return [(f.handler, f.kind, f.policy) for f in result.failures]


# -- one set of bounds: worker, in-process, registry ------------------------------------------
BAD_OPTIONS = [
    {"priority": 2_000_000},
    {"priority": -1_000_001},
    {"priority": True},
    {"priority": 1.5},
    {"timeout_s": math.nan},
    {"timeout_s": math.inf},
    {"timeout_s": -1},
    {"timeout_s": 0},
    {"timeout_s": "5"},
    {"failure_policy": "maybe"},
    {"tool_filter": "bash"},
    {"tool_filter": [""]},
    {"tool_filter": ["x" * 201]},
    {"tool_filter": [f"tool{i}" for i in range(65)]},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=repr)
async def test_a_worker_refuses_options_the_registry_would_refuse(
    event: str, options: dict[str, Any]
) -> None:
    """Declared, each of these would be skipped by every dispatcher while the worker
    serves it (and its deny policy would never apply): the worker refuses it at once."""
    w = HookWorker()
    with pytest.raises(BadRequestError) as raised:
        w.add_handler(event, noop, **options)
    assert isinstance(raised.value, ValueError)  # as `handler` has always raised
    assert w.handlers == []


async def test_a_worker_declares_its_options_as_every_dispatcher_reads_them(
    nc: NATS, connect: Connect, event: str
) -> None:
    """The widest options a worker may declare: the record holds the clamped timeout, a
    dispatcher routes it as declared, and a second replica with the same options starts
    (its declaration equals the live one, as a dispatcher reads it)."""
    globs = [f"tool{i}*" for i in range(64)]
    options = {"priority": 1_000_000, "timeout_s": 1e308, "tool_filter": globs}
    first, second = HookWorker(await connect()), HookWorker(await connect())
    for w in (first, second):
        w.add_handler(event, noop, name="wide", failure_policy="deny", **options)
    async with first, HookDispatcher(await connect()) as d:
        async with second:  # a replica: no conflict with the live declaration
            with anyio.fail_after(10):
                while not d.routes(event):  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            [route] = d.routes(event)
            assert (route.priority, route.timeout_s, route.failure_policy) == (
                1_000_000,
                CLAMP_S,
                "deny",
            )
            assert route.tool_filter == tuple(globs)
        entry = await (await nc.jetstream().key_value(HANDLERS_BUCKET)).get(
            handler_key(event, "wide")
        )
        assert decode(entry.value, HandlerDeclaration).timeout_s == CLAMP_S
    assert first.handlers[0].declaration.timeout_s == CLAMP_S


@pytest.mark.parametrize("options", [o for o in BAD_OPTIONS if "priority" not in o], ids=repr)
async def test_register_refuses_options_as_a_worker_does(
    event: str, options: dict[str, Any]
) -> None:
    d = HookDispatcher()
    with pytest.raises(BadRequestError):
        d.register(event, noop, name="h", **options)
    with pytest.raises(BadRequestError):  # the decorator form checks when called too
        d.register(event, name="h", **options)
    assert d.list_handlers(event) == {event: []}


async def test_register_clamps_a_timeout_and_keeps_amplifier_cores_priority_rule(
    event: str,
) -> None:
    d = HookDispatcher()
    d.register(event, noop, name="long", timeout_s=1e308)
    d.register(event, noop, name="unlimited", timeout_s=None)
    d.register(event, noop, priority=2**31 - 1, name="high")  # a 32-bit int: fine in process
    with pytest.raises(OverflowError):
        d.register(event, noop, priority=2**31, name="too-high")
    with pytest.raises(TypeError):
        d.register(event, noop, priority=1.5, name="float")
    assert {r.name: r.timeout_s for r in d.routes(event)} == {
        "long": CLAMP_S,
        "unlimited": None,
        "high": None,
    }


@pytest.mark.parametrize("timeout", [-1, math.nan, "1", None])
async def test_emit_and_collect_checks_its_timeout_with_or_without_handlers(
    event: str, timeout: Any
) -> None:
    d = HookDispatcher()
    with pytest.raises(BadRequestError, match="timeout"):
        await d.emit_and_collect(event, {}, timeout)
    d.register(event, noop)
    with pytest.raises(BadRequestError, match="timeout"):
        await d.emit_and_collect(event, {}, timeout)


@pytest.mark.parametrize("longest", [0, -1, math.nan, math.inf])
async def test_emit_refuses_an_approval_timeout_not_finite_and_positive(
    event: str, longest: float
) -> None:
    d = HookDispatcher()
    d.register(event, noop)
    with pytest.raises(BadRequestError, match="approval_timeout_s"):
        await d.emit(event, {}, approval_timeout_s=longest)


# -- tool filters: one matcher --------------------------------------------------------------
GLOB = st.text(alphabet="abAB\u00df*?[]!", min_size=1, max_size=6)
TOOL = st.one_of(st.text(alphabet="abAB\u00dfsS[]!", max_size=6), st.none(), st.integers())


def test_a_tool_filter_matches_whole_names_ignoring_case() -> None:
    """The README's filter stops Claude Code's ``Bash`` and any spelling of the shell
    tools, and still matches whole names only."""
    from hookbus.schemas import ToolFilter

    flt = ToolFilter.of(["bash", "shell*"])
    for name in ("bash", "Bash", "BASH", "bAsH", "shell", "SHELL_run", "Shell_exec"):
        assert flt.matches({"tool_name": name}) and flt.matches_name(name), name
    for name in ("bashful", "Bashful", "my_bash", "sh", "ashell", "", None, 3):
        assert not flt.matches({"tool_name": name}) and not flt.matches_name(name), name
    assert not flt.matches({})
    assert flt.patterns == ("bash", "shell*")  # kept as written
    assert flt.as_list() == ["bash", "shell*"]
    upper = ToolFilter.of(["MCP__github__*", "Web?etch", "[!a-z]*"])
    assert upper.matches_name("mcp__github__create_issue")
    assert upper.matches_name("webfetch") and upper.matches_name("WEBFETCH")
    assert not upper.matches_name("mcp__gitlab__x")
    assert upper.matches_name("_x") and not upper.matches_name("Xy")  # classes casefold too
    assert ToolFilter.of(["stra\u00dfe"]).matches_name("STRASSE")  # Unicode casefold
    assert ToolFilter.EVERY.matches_name(None) and not ToolFilter.of([]).matches_name("a")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(globs=st.one_of(st.none(), st.lists(GLOB, max_size=4)), tool=TOOL)
def test_dispatchers_and_workers_match_a_tool_filter_with_one_matcher(
    globs: list[str] | None, tool: Any
) -> None:
    from hookbus._core.handler_options import ToolFilter

    flt = ToolFilter.of(globs)
    route = Route.make(
        event="e", name="h", priority=0, timeout_s=1.0, failure_policy="ignore",
        parallel=False, tool_filter=globs, subject="s",
    )  # fmt: skip
    w = HookWorker()
    spec: HandlerSpec = w.add_handler("e", noop, name="h", tool_filter=globs)
    data = {} if tool is None else {"tool_name": tool}
    assert route.matches(data) == spec.matches(data) == flt.matches(data)
    assert spec.tool_filter.patterns == route.tool_filter == flt.patterns
    # the rule: a whole-name fnmatch of the casefolded name by a casefolded glob
    by_rule = isinstance(tool, str) and any(
        fnmatch.fnmatchcase(tool.casefold(), g.casefold()) for g in globs or ()
    )
    assert flt.matches(data) == (globs is None or by_rule)


@pytest.mark.parametrize("chains", [True, False], ids=["chain", "alone"])
async def test_a_worker_filtered_on_bash_is_called_for_claude_codes_bash_and_denies_it(
    nc: NATS, connect: Connect, event: str, chains: bool
) -> None:
    """The README's worker (``tool_filter=["bash", "shell*"]``) on a real nats-server: a
    ``Bash`` tool:pre (Claude Code's spelling) reaches it and is denied, whether the
    dispatcher sends the worker's two handlers as one chain (the worker judges each step's
    filter) or calls each alone (the dispatcher judges it)."""
    calls: list[tuple[str, str]] = []
    w = HookWorker(await connect())

    @w.handler(event, priority=10, tool_filter=["bash", "shell*"], failure_policy="deny")
    async def security(ev: str, data: dict[str, Any]) -> HookResult:
        calls.append(("security", data["tool_name"]))
        if "rm -rf" in data.get("tool_input", {}).get("command", ""):
            return HookResult(action="deny", reason="destructive command")
        return HookResult(action="continue")

    @w.handler(event, priority=20, tool_filter=["BASH*"])
    async def audit(ev: str, data: dict[str, Any]) -> None:
        calls.append(("audit", data["tool_name"]))

    def call(tool: str, command: str) -> dict[str, Any]:
        return {"tool_name": tool, "tool_input": {"command": command}}

    async with w, HookDispatcher(nc, chains=chains) as d:
        assert [(r.name, r.tool_filter, r.chain != "") for r in d.routes(event)] == [
            ("security", ("bash", "shell*"), True),  # the declaration keeps the globs as written
            ("audit", ("BASH*",), True),
        ]
        denied = await d.emit(event, call("Bash", "rm -rf /tmp/build"))
        assert (denied.action, denied.decided_by) == ("deny", "security")
        assert denied.reason == "destructive command"
        assert calls == [("security", "Bash")]

        calls.clear()
        shell = await d.emit(event, call("SHELL_run", "rm -rf /"))
        assert (shell.action, shell.decided_by) == ("deny", "security")
        fine = await d.emit(event, call("Bash", "ls"))
        assert fine.action == "continue"
        other = await d.emit(event, call("bashful", "rm -rf /"))  # not a whole-name match
        assert other.action == "continue"
        assert calls == [
            ("security", "SHELL_run"),
            ("security", "Bash"),
            ("audit", "Bash"),
            ("audit", "bashful"),
        ]


# -- the stop rule: the worker's and the dispatcher's fold ----------------------------------
OUTCOMES = ["continue", "deny", "modify", "inject_context", "ask_user", "failed", "unreadable"]


def first_handler(outcome: str) -> Callable[[str, dict[str, Any]], Awaitable[Any]]:
    async def first(event: str, data: dict[str, Any]) -> Any:
        if outcome == "failed":
            raise RuntimeError("failed")
        if outcome == "unreadable":
            return {"action": "explode"}
        extra: dict[str, Any] = {"data": {**data, "seen": 1}} if outcome == "modify" else {}
        if outcome == "inject_context":
            extra = {"context_injection": "note"}
        return HookResult(action=outcome, **extra)  # type: ignore[arg-type]

    return first


COMBOS = [(o, p, policy) for o in OUTCOMES for p in (False, True) for policy in ("ignore", "deny")]


@pytest.mark.parametrize(("outcome", "parallel", "policy"), COMBOS)
async def test_the_in_process_fold_stops_where_the_stop_rule_says(
    event: str, outcome: str, parallel: bool, policy: str
) -> None:
    from hookbus._core.fold_rules import ends_fold

    called: list[str] = []

    async def second(ev: str, data: dict[str, Any]) -> None:
        called.append("second")

    d = HookDispatcher()
    d.register(event, first_handler(outcome), priority=1, name="first",
               parallel=parallel, failure_policy=policy)  # fmt: skip
    d.register(event, second, priority=2, name="second")
    await d.emit(event, {})
    stops = ends_fold(outcome, parallel=parallel, failure_policy=policy)  # type: ignore[arg-type]
    assert (called == []) == stops


async def test_a_workers_chain_stops_where_the_stop_rule_says(nc: NATS, connect: Connect) -> None:
    """Every combination, each on an event of its own, served by one worker process: the
    dispatcher sends each pair as one chain, and the worker runs the second handler
    exactly when the stop rule says the fold goes on."""
    from hookbus._core.fold_rules import ends_fold

    prefix = f"stop{time.monotonic_ns() % 10**9}"
    called: set[str] = set()

    def second_of(ev: str) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
        async def second(e: str, data: dict[str, Any]) -> None:
            called.add(ev)

        return second

    w = HookWorker(await connect())
    events = {}
    for i, (outcome, parallel, policy) in enumerate(COMBOS):
        ev = events[(outcome, parallel, policy)] = f"{prefix}:{i}"
        w.add_handler(ev, first_handler(outcome), name="first", priority=1,
                      parallel=parallel, failure_policy=policy)  # fmt: skip
        w.add_handler(ev, second_of(ev), name="second", priority=2)
    async with w, HookDispatcher(nc, approvals=False) as d:  # ask_user passes through
        for combo, ev in events.items():
            assert [r.chain != "" for r in d.routes(ev)] == [True, True]
            await d.emit(ev, {})
            outcome, parallel, policy = combo
            stops = ends_fold(outcome, parallel=parallel, failure_policy=policy)  # type: ignore[arg-type]
            assert (ev not in called) == stops, combo


# -- a declared timeout is bounded on every path ---------------------------------------------
@pytest.mark.parametrize("key", [handler_key, required_key], ids=["declared", "required"])
async def test_a_record_with_a_huge_timeout_is_clamped(
    nc: NATS, connect: Connect, event: str, key: Callable[[str, str], str]
) -> None:
    """A record (a declaration, or a required handler's) asking for 1e308 s is routed with
    `MAX_HANDLER_TIMEOUT_S`: a call of a replica that never answers is cut there (not
    waited out here: 60 s)."""
    kv = await bucket(nc)
    raw = f'{{"event": "{event}", "name": "slow", "timeout_s": 1e308}}'.encode()
    async with HookDispatcher(await connect()) as d:
        await kv.put(key(event, "slow"), raw)
        await sentinel(kv, d, event)
        assert {r.name: r.timeout_s for r in d.routes(event)}["slow"] == CLAMP_S
    await kv.delete(key(event, "slow"))


async def test_require_handler_clamps_a_huge_timeout(nc: NATS, event: str) -> None:
    stored = await require_handler(nc, event, "sec2", timeout_s=1e308)
    assert stored.timeout_s == CLAMP_S
    await (await bucket(nc)).delete(required_key(event, "sec2"))


# -- a required handler keeps the stricter policy -------------------------------------------
async def test_a_declared_required_handler_keeps_the_requirements_deny(
    nc: NATS, connect: Connect, event: str
) -> None:
    """`hookbus handlers require EVENT sec` (deny); a worker declares `sec` with the
    default `ignore` and stops: its absence still fails closed."""
    await require_handler(nc, event, "sec")
    w = HookWorker(await connect())
    w.add_handler(event, noop, name="sec")  # failure policy ignore
    async with HookDispatcher(await connect()) as d:
        async with w:
            assert (await d.emit(event, {})).action == "continue"
        result = await d.emit(event, {})
        assert [r.failure_policy for r in d.routes(event)] == ["deny"]
    kv = await bucket(nc)
    await kv.delete(required_key(event, "sec"))
    await kv.delete(handler_key(event, "sec"))
    assert (result.action, failures(result)) == ("deny", [("sec", "no_responders", "deny")])


async def test_an_in_process_required_handler_keeps_the_stricter_policy(
    nc: NATS, connect: Connect, event: str
) -> None:
    async def sec(ev: str, data: dict[str, Any]) -> None:
        raise RuntimeError("down")

    kv = await bucket(nc)
    async with HookDispatcher(await connect()) as d:
        d.register(event, sec, name="sec")  # failure policy ignore
        await require_handler(nc, event, "sec")  # deny
        with anyio.fail_after(10):
            while [r.failure_policy for r in d.routes(event)] != ["deny"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        denied = await d.emit(event, {})
        await require_handler(nc, event, "sec", failure_policy="ignore")
        with anyio.fail_after(10):
            while [r.failure_policy for r in d.routes(event)] != ["ignore"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        d.unregister("sec")
        d.register(event, sec, name="sec", failure_policy="deny")  # the stricter one: its own
        still = await d.emit(event, {})
    await kv.delete(required_key(event, "sec"))
    assert (denied.action, failures(denied)) == ("deny", [("sec", "error", "deny")])
    assert (still.action, failures(still)) == ("deny", [("sec", "error", "deny")])


# -- hookbus worker --max-concurrency -------------------------------------------------------
SLOW_WORKER = """
import asyncio

from hookbus.workers import HookWorker

worker = HookWorker(max_concurrency=1)


@worker.handler({event!r}, timeout_s=5)
async def slow(event, data):
    await asyncio.sleep(1.0)
"""


@pytest.mark.parametrize(("flag", "bound"), [((), 1), (("--max-concurrency", "3"), 3)])
async def test_hookbus_worker_keeps_the_workers_max_concurrency_unless_given(
    tmp_path: Path, nats_url: str, nc: NATS, event: str, flag: tuple[str, ...], bound: int
) -> None:
    module = tmp_path / "bounded_worker.py"
    module.write_text(textwrap.dedent(SLOW_WORKER.format(event=event)))
    async with anyio.create_task_group() as tg:
        w = await serve(tg, "worker", f"{module}:worker", "--url", nats_url, *flag)
        banner = await w.expect("hookbus worker: serving 1 handler(s)")
        assert f"concurrency {bound}," in banner
        async with HookDispatcher(nc) as d:
            results = await asyncio.gather(*(d.emit(event, {}) for _ in range(2)))
        busy = [f for r in results for f in r.failures if "busy" in f.message]
        assert bool(busy) == (bound == 1)  # one slot: the second call is refused busy
        await stop(w)
        tg.cancel_scope.cancel()
