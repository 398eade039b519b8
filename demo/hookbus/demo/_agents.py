"""`hookbus demo --agents`: framework agents governed by the demo's own workers.

After the scripted agents of the transcript, while the demo's workers and approver are
still running, the demo runs the examples' framework agents against the same server:

- ``pydantic-ai``: ``<examples>/pydantic_ai_agent.py``'s ``run_agent``, in this process (a
  pydantic-ai ``Agent`` on a scripted ``FunctionModel`` with `HookbusCapability`), as agent
  ``payments-agent`` (with ``--secure``, its emits go to the demo's dispatcher service).
  Every emit of its capability is recorded and shown; the example's own expectations
  (which tool calls run, what the model reads) decide whether it passed. Needs the
  ``pydantic-ai`` extra.
- ``ai``: ``<examples>/ai_agent.py`` (the Vercel AI SDK for Python, ``ai.testing.FakeModel``)
  as a subprocess of a Python >= 3.12 interpreter, as agent ``ai-agent``. Its ``transfer``
  tool waits for the durable hook ``approve_<tool call id>``; the demo hears it pending
  (hook events of ``ai-agent``), emits it as ``tool:pre`` of ``payments:create_transfer``
  through the demo's workers (``transfer_approval`` asks, the demo's approver answers) and
  answers the tool approval as the demo's approver: an answer proof ``Allow`` (not
  denied) or ``Deny``, from which the agent resolves the hook (the ``ai`` integration
  takes a tool approval from an approver's proof only). With ``--secure`` the process
  connects as the agent identity ``ai-agent`` (its seed in ``NATS_NKEY``); the demo's
  side is a plain agent too (the emit goes to the dispatcher service, the hook events are
  the agent's own) and writes the proof as the approver identity ``demo-approver``.

Both act as agent identities of ``hookbus auth init --demo`` (`FRAMEWORK_AGENT_IDS`).
Neither needs a network or an API key: both models are scripted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import click
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from rich.console import Console
from rich.table import Table

from hookbus.cli import ConnectionSettings, connect, load_object, service_emit
from hookbus.dispatcher import HookDispatcher, Suspensions
from hookbus.integrations import Emit
from hookbus.schemas import (
    SUSPENSIONS_BUCKET,
    TOOL_PRE,
    ApprovalAnswer,
    HookbusError,
    HookEvent,
    HookResult,
    approval_answer_key,
    encode,
)

from ._common import (
    _STYLE,
    DEMO_APPROVER,
    Credentials,
    _single_errors,
    _WorkerProcess,
    deciding_handler,
    shown_action,
    with_ids,
)

__all__ = [
    "AI_AGENT_ID",
    "FRAMEWORK_AGENTS",
    "FRAMEWORK_AGENT_IDS",
    "PYDANTIC_AI_AGENT_ID",
    "FrameworkAgents",
    "parse_agents",
    "prepare_agents",
]

FRAMEWORK_AGENTS = ("pydantic-ai", "ai")
"""The names ``hookbus demo --agents`` takes."""
PYDANTIC_AI_EXAMPLE = "pydantic_ai_agent.py"
AI_EXAMPLE = "ai_agent.py"
PYDANTIC_AI_AGENT_ID = "payments-agent"
AI_AGENT_ID = "ai-agent"
AI_SESSION_ID = "ai-session-1"
AI_TIMEOUT_S = 60.0
"""Seconds the ``ai`` agent's process gets to finish (then it is killed: a failure)."""
RESOLVED_WAIT_S = 5.0
"""Seconds the bridge waits to hear the agent resolve a tool approval from its proof."""
DECIDE_GRACE_S = 10.0
"""Seconds the bridge's decisions in flight get to end once the ``ai`` agent's process did."""
PROBE_TIMEOUT_S = 60.0
"""Seconds to check that an interpreter is a Python >= 3.12 with hookbus and ``ai``."""
AI_TOOLS = {"transfer": "payments:create_transfer"}
"""The ``ai`` example's tools as the demo's policies name them: its ``transfer`` is the
payments agents' transfer (``approval_gate.py`` asks for it)."""
_PROBE = (
    "import sys; assert sys.version_info >= (3, 12), 'Python ' + sys.version.split()[0];"
    " import ai, hookbus.integrations.ai"
)
_AI_NEEDS = (
    "--agents ai needs a Python >= 3.12 with hookbus and its ai extra (the ai package needs"
    " 3.12+): e.g. `python3.12 -m venv .venv312 && .venv312/bin/pip install -e '.[ai]'`, then"
    " --ai-python .venv312/bin/python"
)


def parse_agents(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    """The click callback of ``--agents``: ``"pydantic-ai,ai"`` -> ``("pydantic-ai", "ai")``
    (order kept, duplicates dropped; empty: none).

    Raises:
        click.BadParameter: a name that is not one of `FRAMEWORK_AGENTS`.
    """
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    for name in names:
        if name not in FRAMEWORK_AGENTS:
            raise click.BadParameter(
                f"unknown agent {name!r} (choose from {', '.join(FRAMEWORK_AGENTS)})"
            )
    return tuple(dict.fromkeys(names))


# -- what the agents did ---------------------------------------------------------------------
@dataclass
class _Emit:
    """One emit of a framework agent and its decision."""

    agent: str
    framework: str
    event: str
    tool: str
    result: HookResult | None
    latency_ms: float
    tool_call_id: str = ""
    error: str = ""


@dataclass
class _Outcome:
    """What a framework agent did: its emits, one line per tool call, whether it passed."""

    framework: str
    emits: list[_Emit] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    ok: bool = False
    summary: str = ""


class _RecordingDispatcher(HookDispatcher):
    """A `HookDispatcher` that keeps every emit's event, tool, result and latency, in the
    order the emits were made.

    With `via` (``--secure``: `service_emit` of the agent's connection) it runs nothing
    itself: it is made without a connection and every emit goes to the dispatcher service
    (a plain ``agent`` identity may not call handlers nor ask for approvals)."""

    def __init__(self, nc: Any, *, agent_id: str, framework: str, via: Emit | None = None) -> None:
        super().__init__(None if via is not None else nc, agent_id=agent_id)
        self.framework = framework
        self.emits: list[_Emit] = []
        self._via = via
        self._recorded_agent = agent_id  # the agent each `_Emit` names

    async def emit(self, event: str, data: dict[str, Any], **options: Any) -> HookResult:
        t0 = time.perf_counter()
        tool = data.get("tool_name")
        call_id = data.get("tool_call_id")
        record = _Emit(
            self._recorded_agent, self.framework, event, tool if isinstance(tool, str) else "",
            None, 0.0, call_id if isinstance(call_id, str) else "",
        )  # fmt: skip
        # in the order the emits were made: an agent's parallel tool calls end in any order
        self.emits.append(record)
        try:
            emit = super().emit if self._via is None else self._via
            result = await emit(event, data, **options)
        except HookbusError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            record.latency_ms = (time.perf_counter() - t0) * 1000
        record.result = result
        return result


def _decision(result: HookResult | None) -> str:
    """``deny by security_policy``, ``continue by transfer_approval, approved by X``, ..."""
    action, handler = shown_action(result), deciding_handler(result)
    text = action + (f" by {handler}" if handler else "")
    if result is not None and result.approved_by:
        text += f", approved by {result.approved_by}"
    return text


# -- pydantic-ai -----------------------------------------------------------------------------
RunAgent = Callable[[HookDispatcher], Awaitable[Any]]


def _load_pydantic_ai(examples_dir: Path) -> RunAgent:
    """The example's ``run_agent``.

    Raises:
        click.ClickException: the extra is not installed, or the example is missing or
            does not load.
    """

    def needs_extra(why: str) -> click.ClickException:
        return click.ClickException(
            f"--agents pydantic-ai needs the pydantic-ai extra ({why}):"
            " pip install 'hookbus[pydantic-ai]'"
        )

    try:
        importlib.import_module("pydantic_ai")
    except ImportError as exc:
        raise needs_extra(f"{type(exc).__name__}: {exc}") from None
    path = examples_dir / PYDANTIC_AI_EXAMPLE
    if not path.is_file():
        raise click.ClickException(f"--agents pydantic-ai runs {path}, which is missing")
    try:
        run_agent = load_object(f"{path.resolve()}:run_agent")
    except click.BadParameter as exc:
        if exc.message.startswith("cannot import"):  # e.g. a pydantic-ai release too old
            raise needs_extra(exc.message) from None
        raise click.ClickException(f"{path}: {exc.message}") from None
    except Exception as exc:
        raise click.ClickException(f"{path} failed to load: {type(exc).__name__}: {exc}") from None
    if not callable(run_agent):
        raise click.ClickException(f"{path}: run_agent is not a function")
    return run_agent  # type: ignore[no-any-return]


async def _run_pydantic_ai(
    conn: str | ConnectionSettings, run_agent: RunAgent, *, through_service: bool = False
) -> _Outcome:
    """Run the example's agent as `PYDANTIC_AI_AGENT_ID`, its emits recorded; with
    `through_service` (``--secure``), sent to the dispatcher service."""
    out = _Outcome("pydantic-ai")
    nc = await connect(conn, name="hookbus-demo-agent pydantic-ai")
    try:
        via = service_emit(nc, agent_id=PYDANTIC_AI_AGENT_ID) if through_service else None
        dispatcher = _RecordingDispatcher(
            nc, agent_id=PYDANTIC_AI_AGENT_ID, framework="pydantic-ai", via=via
        )
        async with dispatcher:
            try:
                run = await run_agent(dispatcher)
            except HookbusError as exc:
                out.emits = dispatcher.emits
                out.summary = f"the run failed: {type(exc).__name__}: {exc}"
                return out
        out.emits = dispatcher.emits
    finally:
        await nc.close()
    decided = {e.tool_call_id: e for e in out.emits if e.event == TOOL_PRE and e.tool_call_id}
    for call in run.calls:
        emit = decided.get(call.tool_call_id)
        decision = _decision(emit.result) if emit else "no tool:pre"
        did = (
            f"ran with {_json_text(call.ran)}"
            if call.ran is not None
            else f"not run; the model read {call.model_read!r}"
        )
        mark = "" if call.ok else "  [bold red]MISMATCH[/] (not what the example expects)"
        out.lines.append(f"{call.tool_name}: {decision} -> {did}{mark}")
    out.lines.append(f"answer: {run.answer}")
    good = sum(call.ok for call in run.calls)
    out.ok = bool(run.ok)
    out.summary = f"{good} of {len(run.calls)} tool calls as {PYDANTIC_AI_EXAMPLE} expects"
    return out


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- ai (a Python >= 3.12 subprocess) --------------------------------------------------------
def ai_venv(checkout: Path) -> Path:
    """The default venv of a Python >= 3.12 with this checkout installed, for the ``ai``
    agent: ``${XDG_CACHE_HOME:-~/.cache}/hookbus/venv-py312-<hash of the checkout's path>``
    (outside the work tree; one per checkout, as the install is editable)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(checkout.resolve()).encode()).hexdigest()[:12]
    return cache / "hookbus" / f"venv-py312-{digest}"


def _venv_candidates() -> list[Path]:
    here = Path(__file__).resolve().parents[3]  # demo/hookbus/demo/_agents.py -> root
    venvs = [Path(v) for v in [os.environ.get("HOOKBUS_PY312_VENV")] if v]
    venvs += [ai_venv(Path.cwd()), ai_venv(here)]
    return [v / "bin" / "python" for v in dict.fromkeys(venvs)]


def _probe(python: str) -> str | None:
    """None if `python` can run the ``ai`` example, else why not."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["exit status " + str(done.returncode)])[-1]
    return last


def find_ai_python(given: str | None) -> str:
    """The interpreter that runs the ``ai`` agent: `given` (``--ai-python``), else the first
    that works of ``$HOOKBUS_PY312_VENV/bin/python``, `ai_venv`'s python (of the current
    folder, then of the source checkout: the venv the ``ai`` runner test builds) and
    ``$HOOKBUS_PY312``. Each is checked: Python >= 3.12 that imports ``ai``
    and ``hookbus.integrations.ai``.

    Raises:
        click.ClickException: `given` does not work, or none was found; the message says
            what is needed and what was tried.
    """
    if given:
        why = _probe(given)
        if why is not None:
            raise click.ClickException(f"--ai-python {given} cannot run the ai agent ({why}); "
                                       + _AI_NEEDS)  # fmt: skip
        return given
    tried = []
    candidates = [str(p) for p in _venv_candidates() if p.exists()]
    if os.environ.get("HOOKBUS_PY312"):
        candidates.append(os.environ["HOOKBUS_PY312"])
    for python in dict.fromkeys(candidates):
        why = _probe(python)
        if why is None:
            return python
        tried.append(f"{python}: {why}")
    looked = (
        "tried " + "; ".join(tried)
        if tried
        else f"found none in {ai_venv(Path.cwd())} (the ai runner test builds it; or"
        " --ai-python a venv of your own) nor in HOOKBUS_PY312"
    )
    raise click.ClickException(f"{_AI_NEEDS} ({looked})")


def _as_demo_tool(tool: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``ai`` tool call as the demo's policies see it (`AI_TOOLS`): the transfer gets
    the ``amount`` (units, 2 decimals) and ``currency`` the approval prompt names."""
    name = AI_TOOLS.get(tool, tool)
    tool_input = dict(kwargs)
    cents = kwargs.get("amount_cents")
    if name == "payments:create_transfer" and isinstance(cents, int):
        tool_input.setdefault("amount", f"{cents / 100:.2f}")
        tool_input.setdefault("currency", "USD")
    return name, tool_input


@dataclass
class _AiBridge:
    """What the demo's side of the ``ai`` agent uses."""

    emit: Emit
    """Emits as agent `AI_AGENT_ID` (with its ``agent_id`` and ``session_id``)."""
    store: Suspensions
    """The agent's suspensions: its hook events, its records."""
    proofs: KeyValue
    """The suspensions bucket, as the approver that answers the agent's tool approvals."""


@contextlib.asynccontextmanager
async def _ai_bridge(nc: NATS, approver_nc: NATS | None) -> AsyncIterator[_AiBridge]:
    """The bridge on `nc`: an embedded `HookDispatcher` of agent `AI_AGENT_ID`, whose
    connection writes the answer proofs too. With `approver_nc` (``--secure``: `nc` is
    the agent identity's, `approver_nc` the demo approver's), what a plain ``agent`` may
    use: the dispatcher service's client and the agent's own suspensions; the proofs are
    written on `approver_nc`, as only that approver's NATS user may write them."""
    if approver_nc is None:
        async with HookDispatcher(nc, agent_id=AI_AGENT_ID) as hooks:
            hooks.set_default_fields(agent_id=AI_AGENT_ID, session_id=AI_SESSION_ID)
            yield _AiBridge(hooks.emit, hooks.suspensions, hooks.suspensions.records.kv)
        return
    store = await Suspensions.open(nc, agent_id=AI_AGENT_ID, scoped=True)
    try:
        emit = with_ids(service_emit(nc, agent_id=AI_AGENT_ID), AI_AGENT_ID, AI_SESSION_ID)
        proofs = await approver_nc.jetstream().key_value(SUSPENSIONS_BUCKET)
        yield _AiBridge(emit, store, proofs)
    finally:
        await store.close()


async def _prove_tool_approval(ours: _AiBridge, label: str, *, granted: bool) -> None:
    """Answer the ``ai`` agent's tool approval `label` as `DEMO_APPROVER`: its answer proof
    ``<agent>.<label>.<approver>``, ``Allow`` or ``Deny`` (the ``ai`` integration resolves
    a tool approval only from such a proof; the waiting agent does it).

    Raises:
        HookbusError: the proof could not be written.
    """
    choice = "Allow" if granted else "Deny"
    answer = ApprovalAnswer(choice=choice, answered_by=DEMO_APPROVER, answered_at=time.time())
    key = approval_answer_key(label, AI_AGENT_ID, DEMO_APPROVER)
    try:
        await ours.proofs.create(key, encode(answer))
    except nats.js.errors.KeyWrongLastSequenceError:
        pass  # answered before, by this bridge
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        raise HookbusError(f"the answer proof {key} was not written: {exc!r}") from exc


@dataclass
class _Resolution:
    """A tool approval's resolution as its ``resolved`` hook event tells it."""

    heard: anyio.Event = field(default_factory=anyio.Event)
    granted: bool | None = None


async def _run_ai(
    conn: str | ConnectionSettings,
    examples_dir: Path,
    python: str,
    *,
    approver: ConnectionSettings | None = None,
) -> _Outcome:
    """Run the ``ai`` example as agent `AI_AGENT_ID` (its process connects with `conn`'s
    settings too), decide its tool approvals through the demo's workers and answer them
    as `DEMO_APPROVER`. With `approver` (``--secure``: the demo approver's settings; `conn`
    the agent identity's), the decisions are asked of the dispatcher service."""
    out = _Outcome("ai")
    script = examples_dir / AI_EXAMPLE
    if not script.is_file():
        out.summary = f"{script} is missing"
        return out
    url = conn.url if isinstance(conn, ConnectionSettings) else conn
    env = conn.child_env() if isinstance(conn, ConnectionSettings) else {}
    nc = await connect(conn, name="hookbus-demo ai bridge")
    approver_nc = None
    try:
        if approver is not None:
            approver_nc = await connect(approver, name="hookbus-demo ai bridge (approver)")
        async with _ai_bridge(nc, approver_nc) as ours:
            events = await ours.store.events()  # before the agent starts: no event missed
            answered: list[str] = []
            resolutions: dict[str, _Resolution] = {}

            async def decide(event: HookEvent) -> None:
                hook = event.hook
                tool = str(hook.metadata.get("tool") or "?")
                kwargs = hook.metadata.get("kwargs")
                name, tool_input = _as_demo_tool(tool, kwargs if isinstance(kwargs, dict) else {})
                data = {"tool_name": name, "tool_input": tool_input, "tool_call_id": hook.label}
                record = _Emit(AI_AGENT_ID, "ai", TOOL_PRE, name, None, 0.0, hook.label)
                t0 = time.perf_counter()
                try:
                    record.result = await ours.emit(TOOL_PRE, data, idempotency_key=hook.label)
                except HookbusError as exc:
                    record.error = f"{type(exc).__name__}: {exc}"
                record.latency_ms = (time.perf_counter() - t0) * 1000
                out.emits.append(record)
                granted = record.result is not None and record.result.action != "deny"
                resolution = resolutions.setdefault(hook.label, _Resolution())  # before the proof
                try:
                    await _prove_tool_approval(ours, hook.label, granted=granted)
                except HookbusError as exc:
                    out.lines.append(f"answering {hook.label} failed: {exc}")
                    return
                with anyio.move_on_after(RESOLVED_WAIT_S):
                    await resolution.heard.wait()
                shown = tool if name == tool else f"{tool} (asked as {name})"
                outcome = (
                    f"resolved granted={resolution.granted}"
                    if resolution.heard.is_set()
                    else f"not resolved within {RESOLVED_WAIT_S:g} s"
                )
                answered.append(
                    f"{shown}: {_decision(record.result)} -> hook {hook.label} {outcome}"
                    f" (answered {'Allow' if granted else 'Deny'} as {DEMO_APPROVER})"
                )

            async def bridge(tg: anyio.abc.TaskGroup) -> None:
                async for event in events:
                    hook = event.hook
                    if hook.status == "pending" and hook.label.startswith("approve_"):
                        tg.start_soon(decide, event)
                    elif hook.status == "resolved" and hook.label in resolutions:
                        value = hook.resolution
                        heard = resolutions[hook.label]
                        heard.granted = value.get("granted") if isinstance(value, dict) else None
                        heard.heard.set()

            with tempfile.TemporaryDirectory(prefix="hookbus-demo-ai-") as tmp:
                state = str(Path(tmp) / "state.json")
                command = [python, str(script.resolve()), "--url", url or "",
                           "--agent", AI_AGENT_ID, "--state", state]  # fmt: skip
                proc = _WorkerProcess(AI_EXAMPLE, command, env)
                with _single_errors():
                    async with anyio.create_task_group() as deciding:
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(bridge, deciding)
                            await proc.start(tg)
                            with anyio.move_on_after(AI_TIMEOUT_S):
                                await proc.exited.wait()
                            if not proc.exited.is_set():
                                proc.lines.append(
                                    f"(killed: still running after {AI_TIMEOUT_S:g} s)"
                                )
                                proc.send_signal(signal.SIGKILL)
                                await proc.exited.wait()
                            await proc.eof.wait()
                            tg.cancel_scope.cancel()
                        # the agent may end before the bridge saw its hook resolved
                        deciding.cancel_scope.deadline = anyio.current_time() + DECIDE_GRACE_S
            await events.aclose()
    finally:
        if approver_nc is not None:
            await approver_nc.close()
        await nc.close()
    results = [line.removeprefix("tool result: ") for line in proc.lines
               if line.startswith("tool result: ")]  # fmt: skip
    out.lines.extend(answered)
    out.lines.extend(f"tool result: {r}" for r in results)
    transferred = any(r.startswith("transferred ") for r in results)
    out.ok = proc.returncode == 0 and bool(answered) and transferred
    if out.ok:
        out.summary = f"ran on {python}: its approval answered through the demo's workers"
    else:
        out.summary = (
            f"{AI_EXAMPLE} on {python} exited with {proc.returncode}"
            + ("" if answered else ", no approval asked")
            + ("" if transferred else ", no transfer")
            + f":\n{proc.tail()}"
        )
    return out


# -- the option's entry points ---------------------------------------------------------------
@dataclass
class FrameworkAgents:
    """The framework agents to run, checked before the demo starts (see `prepare_agents`)."""

    names: tuple[str, ...]
    examples_dir: Path
    run_pydantic_ai: RunAgent | None = None
    ai_python: str | None = None

    async def run(
        self,
        url: str | ConnectionSettings,
        console: Console,
        credentials: Credentials | None = None,
    ) -> list[_Outcome]:
        """Run each agent in turn against the demo's server (its workers and approver are
        running); return what each did."""
        outcomes = []
        for name in self.names:
            console.print(f"running the {name} agent", highlight=False)
            if name == "pydantic-ai" and self.run_pydantic_ai is not None:
                conn = credentials("agent", PYDANTIC_AI_AGENT_ID) if credentials else url
                outcomes.append(
                    await _run_pydantic_ai(
                        conn, self.run_pydantic_ai, through_service=credentials is not None
                    )
                )
            elif name == "ai" and self.ai_python is not None:
                conn = credentials("agent", AI_AGENT_ID) if credentials else url
                approver = credentials("approver", DEMO_APPROVER) if credentials else None
                outcomes.append(
                    await _run_ai(conn, self.examples_dir, self.ai_python, approver=approver)
                )
        return outcomes


FRAMEWORK_AGENT_IDS = {"pydantic-ai": PYDANTIC_AI_AGENT_ID, "ai": AI_AGENT_ID}
"""The agent identity each framework agent acts as (``hookbus auth init --demo`` makes them)."""


async def prepare_agents(
    names: Sequence[str],
    examples_dir: Path,
    *,
    ai_python: str | None,
    credentials: Credentials | None = None,
) -> FrameworkAgents:
    """Check that every agent of `names` can run, before the demo starts anything (with
    `credentials`, ``--secure``: that the auth folder has its agent identity).

    Raises:
        click.ClickException: ``pydantic-ai`` without its extra (the message names
            ``pip install 'hookbus[pydantic-ai]'``) or without its example file; ``ai``
            with no usable Python >= 3.12 (the message says what is needed); an agent
            identity missing from the auth folder (the message says how to add it).
    """
    for name in names:
        if credentials is not None:
            credentials("agent", FRAMEWORK_AGENT_IDS[name])
    agents = FrameworkAgents(tuple(names), examples_dir)
    if "pydantic-ai" in names:
        agents.run_pydantic_ai = _load_pydantic_ai(examples_dir)
    if "ai" in names:
        if not (examples_dir / AI_EXAMPLE).is_file():
            missing = examples_dir / AI_EXAMPLE
            raise click.ClickException(f"--agents ai runs {missing}, which is missing")
        agents.ai_python = await anyio.to_thread.run_sync(find_ai_python, ai_python)
    return agents


def report_agents(console: Console, outcomes: list[_Outcome]) -> int:
    """Print the framework agents' decisions (a table), one line per tool call and a verdict
    per agent. Returns 0 if every agent did what its example expects, else 1."""
    if not outcomes:
        return 0
    table = Table(
        title="framework agents (after the scripted ones; same server, workers and approver)",
        title_justify="left",
    )
    for name, justify in [("#", "right"), ("agent", "left"), ("framework", "left"),
                          ("event", "left"), ("tool", "left"), ("action", "left"),
                          ("deciding handler", "left"), ("approved by", "left"),
                          ("latency ms", "right")]:  # fmt: skip
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    emits = [e for o in outcomes for e in o.emits]
    for i, e in enumerate(emits, 1):
        action = shown_action(e.result)
        table.add_row(
            str(i), e.agent, e.framework, e.event, e.tool,
            f"[{_STYLE.get(action, '')}]{action}[/]", deciding_handler(e.result),
            (e.result.approved_by or "") if e.result else "", f"{e.latency_ms:.2f}",
        )  # fmt: skip
    console.print(table)
    console.print("[bold]what the framework agents' tools did[/]:")
    for o in outcomes:
        for line in o.lines:
            console.print(f"  {o.framework}: {line}", highlight=False, soft_wrap=True)
    code = 0
    for o in outcomes:
        if o.ok:
            console.print(f"  [bold green]{o.framework} agent ok[/]: {o.summary}", highlight=False)
        else:
            code = 1
            console.print(
                f"  [bold red]{o.framework} agent FAILED[/]: {o.summary}",
                highlight=False,
                soft_wrap=True,
            )
    return code
