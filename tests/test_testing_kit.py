"""`hookbus.testing.WorkerTestKit`: a worker's handlers decided in process, as on NATS.

The tests before the last need no server. The last one runs one worker both ways (through
the kit, and served on the suite's nats-server to a `HookDispatcher`) over generated
inputs and compares the results field by field.
"""

from __future__ import annotations

import ast
import asyncio
import random
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from _serving import sleeper

from hookbus.dispatcher import HookDispatcher, route_over
from hookbus.schemas import BadRequestError, HookResult, UnknownEventError
from hookbus.testing import WorkerTestKit
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

TOOL_PRE = "tool:pre"


def destructive(data: dict[str, Any]) -> bool:
    return "rm -rf" in str((data.get("tool_input") or {}).get("command", ""))


def policy_worker() -> HookWorker:
    """The README's policy: deny destructive shell commands, fail closed."""
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=10, tool_filter=["bash", "shell*"], failure_policy="deny")
    async def security(event: str, data: dict[str, Any]) -> HookResult:
        if destructive(data):
            return HookResult(action="deny", reason="destructive command")
        return HookResult(action="continue")

    return w


# -- the decision, in process ------------------------------------------------------------------
async def test_a_deny_through_a_mixed_case_tool_filter() -> None:
    """``bash`` in the filter admits Claude Code's ``Bash``; the result is the handler's."""
    async with WorkerTestKit(policy_worker()) as hooks:
        call = {"tool_name": "Bash", "tool_input": {"command": "rm -rf /"}}
        result = await hooks.emit(TOOL_PRE, call)
        assert (result.action, result.reason, result.decided_by) == (
            "deny",
            "destructive command",
            "security",
        )
        assert call == {"tool_name": "Bash", "tool_input": {"command": "rm -rf /"}}  # untouched
        shell = await hooks.emit(
            TOOL_PRE, {"tool_name": "SHELL_exec", "tool_input": call["tool_input"]}
        )
        assert shell.action == "deny"
        outside = await hooks.emit(
            TOOL_PRE, {"tool_name": "Read", "tool_input": call["tool_input"]}
        )
        assert outside.action == "continue" and outside.failures == []
        assert hooks.calls == [(TOOL_PRE, "security")] * 2  # the filter skipped the third


async def test_order_is_priority_then_name_as_on_nats() -> None:
    """Equal priorities run by name (a dispatcher's order of remote handlers), not in the
    order the worker added them; modify chains the data through them."""
    w = HookWorker()

    def tagger(name: str):
        async def tag(event: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="modify", data={**data, "trail": [*data["trail"], name]})

        tag.__name__ = name
        return tag

    w.add_handler(TOOL_PRE, tagger("zeta"), priority=5)
    w.add_handler(TOOL_PRE, tagger("beta"), priority=5)
    w.add_handler(TOOL_PRE, tagger("alpha"), priority=7)
    w.add_handler(TOOL_PRE, tagger("first"), priority=-1)
    async with WorkerTestKit(w) as hooks:
        assert hooks.list_handlers() == {TOOL_PRE: ["first", "beta", "zeta", "alpha"]}
        result = await hooks.emit(TOOL_PRE, {"trail": []})
    assert result.action == "continue"
    assert result.data is not None and result.data["trail"] == ["first", "beta", "zeta", "alpha"]
    assert result.modified_by == ["first", "beta", "zeta", "alpha"]
    assert result.decided_by == "alpha"


async def test_filters_judge_the_chained_data() -> None:
    """A modify that renames the tool changes which filtered handlers run after it."""
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=0)
    async def rename(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "tool_name": "WRITE"})

    @w.handler(TOOL_PRE, priority=1, tool_filter=["bash"])
    async def shell_only(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="deny", reason="shell")

    @w.handler(TOOL_PRE, priority=2, tool_filter=["write"])
    async def writes(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection=f"{data['tool_name']} seen")

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {"tool_name": "bash"})
    assert result.action == "inject_context" and result.context_injection == "WRITE seen"
    assert result.chained_data is not None and result.chained_data["tool_name"] == "WRITE"
    assert hooks.calls == [(TOOL_PRE, "rename"), (TOOL_PRE, "writes")]


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_a_timeout_is_judged_by_the_failure_policy(policy: str) -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, timeout_s=0.05, failure_policy=policy)  # type: ignore[arg-type]
    async def slow(event: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(5)

    @w.handler(TOOL_PRE, priority=1)
    async def after(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection="reached")

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {})
    (failure,) = result.failures
    assert (failure.handler, failure.kind, failure.policy) == ("slow", "timeout", policy)
    if policy == "deny":
        assert result.action == "deny" and result.decided_by == "slow"
        assert result.reason is not None and "failure policy is deny" in result.reason
        assert hooks.calls == [(TOOL_PRE, "slow")]
    else:
        assert result.action == "inject_context" and result.context_injection == "reached"


@pytest.mark.parametrize("policy", ["ignore", "deny"])
async def test_a_handler_that_raises(policy: str) -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, failure_policy=policy)  # type: ignore[arg-type]
    def broken(event: str, data: dict[str, Any]) -> None:  # sync: run in a thread, as served
        raise RuntimeError("no database")

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {"x": 1})
    (failure,) = result.failures
    assert (failure.kind, failure.policy) == ("error", policy)
    assert failure.message == "handler_error: RuntimeError: no database"  # the worker's words
    assert result.action == ("deny" if policy == "deny" else "continue")


async def test_a_result_that_cannot_be_read_is_denied_whatever_the_policy() -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, failure_policy="ignore")
    async def sloppy(event: str, data: dict[str, Any]) -> Any:
        return {"action": "allow"}  # not an action

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {})
    assert result.action == "deny" and result.reason == "Hook handler returned invalid response"
    (failure,) = result.failures
    assert (failure.kind, failure.policy) == ("bad_reply", "deny")
    assert failure.message.startswith("bad_result: ")


async def test_a_parallel_handler_may_not_modify() -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, parallel=True)
    async def audit(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection="audited")

    @w.handler(TOOL_PRE, parallel=True)
    async def sneaky(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={"changed": True})

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {})
    assert result.action == "deny" and result.decided_by == "sneaky"
    assert [(f.handler, f.kind) for f in result.failures] == [("sneaky", "bad_reply")]


async def test_ask_user_and_context_pass_through_as_folded() -> None:
    """No approvals in the kit: the first ``ask_user`` is the result, as a dispatcher with
    ``approvals=False`` returns it; injections are merged in order."""
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=0)
    async def hint(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection="be careful")

    @w.handler(TOOL_PRE, priority=1)
    async def ask(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="run it?")

    @w.handler(TOOL_PRE, priority=2)
    async def ask_again(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="ask_user", approval_prompt="really?")

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {})
    assert (result.action, result.approval_prompt, result.decided_by) == (
        "ask_user",
        "run it?",
        "ask",
    )
    assert result.context_injection is None  # ask_user outranks inject_context
    assert hooks.calls == [(TOOL_PRE, "hint"), (TOOL_PRE, "ask"), (TOOL_PRE, "ask_again")]


async def test_emit_and_collect() -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=2, tool_filter=["zz"])  # filters do not apply to collect
    async def second(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue", data={"from": "second"})

    @w.handler(TOOL_PRE, priority=1)
    async def first(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue", data={"from": "first", "saw": data})

    @w.handler(TOOL_PRE, priority=3, timeout_s=0.05)
    async def late(event: str, data: dict[str, Any]) -> HookResult:
        await asyncio.sleep(5)
        return HookResult(data={"from": "late"})

    @w.handler(TOOL_PRE, priority=4)
    async def broken(event: str, data: dict[str, Any]) -> None:
        raise RuntimeError("left out")

    async with WorkerTestKit(w) as hooks:
        answers = await hooks.emit_and_collect(TOOL_PRE, {"q": 1}, timeout=2.0)
    assert answers == [{"from": "first", "saw": {"q": 1}}, {"from": "second"}]


async def test_an_emit_deadline_cuts_later_handlers() -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=0, timeout_s=5)
    async def slowish(event: str, data: dict[str, Any]) -> None:
        await asyncio.sleep(0.1)

    @w.handler(TOOL_PRE, priority=1, failure_policy="deny")
    async def guard(event: str, data: dict[str, Any]) -> None:
        return None

    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {}, timeout_s=0.05)
        with pytest.raises(BadRequestError):
            await hooks.emit(TOOL_PRE, {}, timeout_s=-1)
    assert result.action == "deny" and result.decided_by == "guard"
    assert [(f.handler, f.kind) for f in result.failures] == [
        ("slowish", "timeout"),
        ("guard", "timeout"),
    ]


async def test_each_handler_gets_its_own_copy() -> None:
    w = HookWorker()

    @w.handler(TOOL_PRE, priority=0)
    async def scribble(event: str, data: dict[str, Any]) -> None:
        data["scribbled"] = True  # in place, no modify: changes nothing for the next one

    @w.handler(TOOL_PRE, priority=1)
    async def look(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection=str("scribbled" in data))

    async with WorkerTestKit(w) as hooks:
        hooks.dispatcher.set_default_fields(session_id="s1")
        result = await hooks.emit(TOOL_PRE, {"tool_name": "bash"})
    assert result.context_injection == "False"
    assert result.chained_data is not None and result.chained_data["session_id"] == "s1"
    assert isinstance(result.chained_data["timestamp"], str)  # stamped, as over NATS


async def test_in_process_handlers_fold_with_the_worker() -> None:
    """`dispatcher.register` adds a handler of the test's own; at equal priority it runs
    before the worker's, as in-process handlers run before remote ones."""
    async with WorkerTestKit(policy_worker()) as hooks:

        async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="modify", data={**data, "tool_input": {"command": "ls"}})

        hooks.dispatcher.register(TOOL_PRE, rewrite, priority=10)
        assert hooks.list_handlers(TOOL_PRE) == {TOOL_PRE: ["rewrite", "security"]}
        result = await hooks.emit(
            TOOL_PRE, {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}
        )
    assert result.action == "continue" and result.modified_by == ["rewrite"]


# -- errors --------------------------------------------------------------------------------------
async def test_an_event_without_a_handler_is_an_error() -> None:
    async with WorkerTestKit(policy_worker()) as hooks:
        with pytest.raises(UnknownEventError, match=r"'tool:post'.*handles 'tool:pre'"):
            await hooks.emit("tool:post", {})
        with pytest.raises(UnknownEventError):
            await hooks.emit_and_collect("tool:post", {})
    async with WorkerTestKit(policy_worker(), strict_events=False) as lenient:
        result = await lenient.emit("tool:post", {"a": 1})  # as HookDispatcher: continue
        assert (result.action, result.data) == ("continue", {"a": 1})
        assert await lenient.emit_and_collect("tool:post", {}) == []


async def test_a_worker_without_handlers_is_refused() -> None:
    with pytest.raises(ValueError, match="no handlers"):
        WorkerTestKit(HookWorker())


async def test_emit_needs_a_started_kit() -> None:
    kit = WorkerTestKit(policy_worker())
    with pytest.raises(RuntimeError, match="async with WorkerTestKit"):
        await kit.emit(TOOL_PRE, {})
    await kit.start()
    await kit.start()  # idempotent
    assert (await kit.emit(TOOL_PRE, {})).action == "continue"
    await kit.close()
    await kit.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        await kit.emit(TOOL_PRE, {})
    with pytest.raises(RuntimeError, match="closed"):
        await kit.start()


async def test_close_cancels_calls_still_running() -> None:
    """A handler the emit stopped waiting for (its timeout) is cancelled when the kit
    closes: nothing outlives the test."""
    w = HookWorker()
    hangs, cancelled = sleeper("hangs", 30)
    w.add_handler(TOOL_PRE, hangs, timeout_s=30)
    async with WorkerTestKit(w) as hooks:
        result = await hooks.emit(TOOL_PRE, {}, timeout_s=0.05)
        assert [f.kind for f in result.failures] == ["timeout"]
    assert cancelled.is_set()


def test_the_kit_needs_only_the_core_install() -> None:
    """Its modules import the standard library, nats-py, msgspec and the core packages only
    (schemas, the kernel, workers, dispatcher: what `pip install hookbus` installs), never
    an extra's package."""
    import hookbus.testing

    roots = set()
    for path in Path(hookbus.testing.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module, ast.dump(node)
                roots.add(node.module)
    ours = {m for m in roots if m.startswith("hookbus.")}
    packages = {".".join(m.split(".")[:2]) for m in ours}
    assert packages <= {"hookbus.schemas", "hookbus._core", "hookbus.workers", "hookbus.dispatcher"}
    others = {m.partition(".")[0] for m in roots - ours}
    assert others - sys.stdlib_module_names == {"nats", "msgspec"}, others


# -- the kit against the remote path ---------------------------------------------------------------
SLOW_TIMEOUT_S = 0.2


def fleet_worker(event: str) -> HookWorker:
    """One worker with every kind of handler: each acts on flags in the data, so one
    handler set covers deny, modify chains, context, ask_user, raising, timing out under
    both policies, unreadable results, parallel and pure handlers and mixed-case filters."""
    w = HookWorker()

    def trail(data: dict[str, Any]) -> list[str]:
        return list(data.get("trail") or [])

    def add(data: dict[str, Any], name: str, **more: Any) -> HookResult:
        return HookResult(action="modify", data={**data, "trail": [*trail(data), name], **more})

    @w.handler(event, priority=0, tool_filter=["bash", "shell*"], failure_policy="deny")
    async def guard(ev: str, data: dict[str, Any]) -> HookResult | None:
        if destructive(data):
            return HookResult(action="deny", reason=f"destructive, after {trail(data)}")
        return None

    @w.handler(event, priority=10)  # added before a_tag, same priority: runs after it
    def b_redact(ev: str, data: dict[str, Any]) -> HookResult | dict[str, Any]:  # sync
        if data.get("secret"):
            return add(data, "b_redact", secret="***")
        return {"action": "continue"}

    @w.handler(event, priority=10)
    async def a_tag(ev: str, data: dict[str, Any]) -> HookResult | None:
        return add(data, "a_tag") if data.get("tag") else None

    @w.handler(event, priority=20, tool_filter=["WRITE", "b*"])
    async def retool(ev: str, data: dict[str, Any]) -> HookResult | None:
        if not data.get("retool"):
            return None
        renamed = "Write" if str(data.get("tool_name")).casefold() == "bash" else "BASH"
        return add(data, "retool", tool_name=renamed)

    @w.handler(event, priority=30, tool_filter=["Bash"], parallel=True)
    async def ctx_shell(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("inject"):
            return HookResult(action="inject_context", context_injection=f"shell {trail(data)}")
        return None

    @w.handler(event, priority=30, tool_filter=["write"], parallel=True)
    async def ctx_write(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("parallel_modify"):
            return HookResult(action="modify", data={**data, "sneaky": True})
        if data.get("inject"):
            return HookResult(
                action="inject_context", context_injection=f"write {trail(data)}", ephemeral=True
            )
        return None

    @w.handler(event, priority=40, pure=True)
    async def pure_a(ev: str, data: dict[str, Any]) -> HookResult | None:
        return add(data, "pure_a") if data.get("pure") else None

    @w.handler(event, priority=41, pure=True)
    async def pure_b(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("pure"):
            return HookResult(action="inject_context", context_injection=f"pure {trail(data)}")
        return None

    @w.handler(event, priority=50)
    async def asker(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("ask"):
            return HookResult(action="ask_user", approval_prompt=f"allow after {trail(data)}?")
        return None

    @w.handler(event, priority=55)
    async def asker_too(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("ask") == "twice":
            return HookResult(action="ask_user", approval_prompt="and me?")
        return None

    @w.handler(event, priority=60)
    async def flaky(ev: str, data: dict[str, Any]) -> None:
        if data.get("raise"):
            raise RuntimeError(f"flaky saw {trail(data)}")

    @w.handler(event, priority=61, failure_policy="deny")
    async def strict_flaky(ev: str, data: dict[str, Any]) -> None:
        if data.get("raise") == "deny":
            raise ValueError("strict_flaky fails closed")

    @w.handler(event, priority=70, timeout_s=SLOW_TIMEOUT_S, failure_policy="ignore")
    async def slow_ignore(ev: str, data: dict[str, Any]) -> None:
        if data.get("slow") == "ignore":
            await asyncio.sleep(3)

    @w.handler(event, priority=71, timeout_s=SLOW_TIMEOUT_S, failure_policy="deny")
    async def slow_deny(ev: str, data: dict[str, Any]) -> None:
        if data.get("slow") == "deny":
            await asyncio.sleep(3)

    @w.handler(event, priority=80)
    def malformed(ev: str, data: dict[str, Any]) -> Any:  # sync
        return {"action": "explode"} if data.get("malformed") else None

    @w.handler(event, priority=90, tool_filter=["BASH"])
    async def late_deny(ev: str, data: dict[str, Any]) -> HookResult | None:
        if data.get("late_deny"):
            return HookResult(action="deny", reason=f"late, after {trail(data)}")
        return None

    return w


TOOLS = ["bash", "Bash", "BASH", "write", "Write", "shell_exec", "Read", None]

NAMED_CASES: list[dict[str, Any]] = [
    {"tool_name": "Bash", "tool_input": {"command": "rm -rf /"}},  # deny, mixed case
    {"tool_name": "bash", "secret": 1, "tag": 1, "retool": 1},  # modify chain, renamed tool
    {"tool_name": "Bash", "inject": 1, "pure": 1},  # context from parallel and pure handlers
    {"tool_name": "write", "inject": 1, "ask": "twice"},  # ask_user: the first is kept
    {"tool_name": "Read", "raise": "ignore"},  # raises, policy ignore
    {"tool_name": "Read", "raise": "deny"},  # raises, policy deny
    {"tool_name": "Write", "slow": "ignore", "inject": 1},  # times out, policy ignore
    {"tool_name": "bash", "slow": "deny", "tag": 1},  # times out, policy deny
    {"tool_name": "write", "parallel_modify": 1},  # a parallel handler's modify
    {"tool_name": "shell_exec", "malformed": 1},  # a result that cannot be read
    {"tool_name": "bash", "retool": 1, "late_deny": 1},  # bash -> Write: late_deny skipped
    {"tool_name": "write", "retool": 1, "late_deny": 1},  # write -> BASH: late_deny runs
]


def generated_cases(n: int, seed: int = 20240611) -> list[dict[str, Any]]:
    """`n` inputs drawn from every flag the handlers act on (fixed seed: the same inputs
    each run); timeouts in about one input in six."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        data: dict[str, Any] = {}
        tool = rng.choice(TOOLS)
        if tool is not None:
            data["tool_name"] = tool
        data["tool_input"] = {"command": rng.choice(["ls", "rm -rf /tmp/x"])}
        for flag in ("secret", "tag", "retool", "inject", "pure", "late_deny"):
            if rng.random() < 0.4:
                data[flag] = 1
        for flag, values in (
            ("ask", ["once", "twice"]),
            ("raise", ["ignore", "deny"]),
            ("slow", ["ignore", "deny"]),
        ):
            if rng.random() < (0.17 if flag == "slow" else 0.3):
                data[flag] = rng.choice(values)
        for flag in ("parallel_modify", "malformed"):
            if rng.random() < 0.12:
                data[flag] = 1
        cases.append(data)
    return cases


def comparable(result: HookResult) -> dict[str, Any]:
    """Every field of `result`, less what differs by nature between two runs:

    - the ``timestamp`` each emit stamps into the data (in ``data`` and ``chained_data``);
    - the message of a ``timeout`` failure, and the deny reason quoting it: who sees the
      timeout first, the dispatcher's clock (``no reply within 0.2s``) or the worker's
      (``handler_timeout: ran past 0.2s``), is a race on either path. Its handler, kind and
      policy are compared.
    """
    out: dict[str, Any] = msgspec.to_builtins(result)
    for key in ("data", "chained_data"):
        if isinstance(out.get(key), dict):
            out[key].pop("timestamp", None)
    timed_out = set()
    for failure in out["failures"]:
        if failure["kind"] == "timeout":
            timed_out.add(failure["handler"])
            failure["message"] = "(timeout)"
    if out["action"] == "deny" and out["decided_by"] in timed_out and out["reason"]:
        out["reason"] = out["reason"].partition("failure policy is deny")[0]
    return out


async def test_the_kit_decides_as_a_dispatcher_on_nats(connect: Any, event: str) -> None:
    """One worker, the same inputs: through the kit, then served on the suite's nats-server
    to a `HookDispatcher` (chain requests, speculation and all: its defaults; approvals off,
    as the kit has none). Every result must agree field by field (`comparable`), and so must
    `emit_and_collect`."""
    worker = fleet_worker(event)
    cases = NAMED_CASES + generated_cases(40)
    collect_cases = [{"tool_name": "Bash", "secret": 1}, {"tool_name": "write", "slow": "deny"}]

    async with WorkerTestKit(worker) as hooks:
        local = [await hooks.emit(event, data) for data in cases]
        local_collect = [await hooks.emit_and_collect(event, d, timeout=2.0) for d in collect_cases]

    await worker.start(await connect())  # the same worker object, served for real
    try:
        async with HookDispatcher(await connect(), approvals=False) as d:
            assert d.list_handlers(event) == hooks.list_handlers(event)
            remote = [await d.emit(event, data) for data in cases]
            remote_collect = [
                await d.emit_and_collect(event, c, timeout=2.0) for c in collect_cases
            ]
    finally:
        await worker.shutdown()
        await worker.unregister()

    differences = [
        f"input {data}:\n  kit:    {comparable(a)}\n  remote: {comparable(b)}"
        for data, a, b in zip(cases, local, remote, strict=True)
        if comparable(a) != comparable(b)
    ]
    assert differences == [], "\n".join(differences)
    assert local_collect == remote_collect
    # the inputs did reach every kind of outcome
    actions = {r.action for r in local}
    assert actions == {"deny", "continue", "inject_context", "ask_user"}, actions
    kinds = {(f.handler, f.kind, f.policy) for r in local for f in r.failures}
    assert {
        ("flaky", "error", "ignore"),
        ("strict_flaky", "error", "deny"),
        ("slow_ignore", "timeout", "ignore"),
        ("slow_deny", "timeout", "deny"),
        ("malformed", "bad_reply", "deny"),
        ("ctx_write", "bad_reply", "deny"),  # a parallel modify: always denied
    } <= kinds, kinds
    assert any(r.modified_by == ["a_tag", "b_redact", "retool"] for r in local)
    assert any(len(r.context_injections) >= 2 for r in local)


async def test_route_over_takes_only_a_dispatcher_without_a_connection_of_its_own() -> None:
    """The kit's seam into the dispatcher (`route_over`) refuses a dispatcher that routes
    over a connection of its own, or one already routed: it never rewires a live one."""
    kit_worker = HookWorker()

    @kit_worker.handler("tool:pre", name="guard")
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue")

    async with WorkerTestKit(kit_worker) as kit:  # routed over its loopback once
        with pytest.raises(RuntimeError, match="connection of its own"):
            await route_over(kit.dispatcher, object(), [])
