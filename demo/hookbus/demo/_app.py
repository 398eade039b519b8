"""`hookbus demo`: a fleet of agents whose lifecycle events are decided by hook workers
running as separate processes, replayed from a transcript and checked against it.

What it does, in order:

1. reads ``<examples>/transcript.json`` (agents, their steps, the decision each step must
   get, and the worker files to run with their replica counts);
2. starts every worker as its own ``hookbus worker <file>:worker`` process and waits until
   each replica has subscribed and declared its handlers (seen as puts on a KV watch of
   the handler registry bucket: a worker declares only after its subscriptions are flushed);
3. runs the agents concurrently, each with its own connection and `HookDispatcher`
   (``agent_id`` / ``session_id`` as default fields), emitting its steps in order (with
   ``--via aos``, sending each step as an OWASP AOS request through the AOS guardian door
   instead, see `hookbus.demo._aos`). With ``--secure`` the agents run no dispatcher
   of their own: the demo starts a `DispatcherService` as the ``dispatcher`` identity and
   each agent sends its emits to it (``hookbus.v1.emit.<agent>.<event>``), as the
   least-privilege ``agent`` role allows; the service calls the handlers and asks for
   the approvals, which the approver answers;
4. prints the decision table (agent, event, tool, action, deciding handler, latency) and a
   summary, stops the workers (SIGTERM: they drain; SIGKILL after `STOP_TIMEOUT_S`), removes
   the declarations the demo added, and returns 0 if every decision matched, else 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import click
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue
from rich.console import Console
from rich.table import Table

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.consumers import watch_keys
from hookbus.cli import (
    ConnectionSettings,
    connect,
    connection_or_embedded,
    load_object,
    otel_session,
    print_denied_trace,
    run_async,
    service_emit,
)
from hookbus.cli import auth_credentials as secure_credentials
from hookbus.dispatcher import APPROVAL_LABEL_PREFIX, DispatcherService, HookDispatcher
from hookbus.integrations import Emit
from hookbus.schemas import (
    HandlerDeclaration,
    HookbusError,
    HookResult,
    handler_key,
)
from hookbus.workers import HookWorker

from ._common import (
    _STYLE,
    DEMO_APPROVER,
    TRANSCRIPT_FILE,
    AgentScript,
    Credentials,
    Step,
    Transcript,
    WorkerFile,
    _AgentSetupError,
    _single_errors,
    _WorkerProcess,
    deciding_handler,
    load_transcript,
    shown_action,
    with_ids,
)

if TYPE_CHECKING:
    from ._aos import AosOutcome

__all__ = [
    "demo_identities",
    "demo_main",
    "find_examples_dir",
    "run",
    "secure_credentials",
]

READY_TIMEOUT_S = 60.0
"""Seconds to wait for every worker replica to subscribe and declare its handlers."""
STOP_TIMEOUT_S = 10.0
"""Seconds a worker gets to drain after SIGTERM before it is killed."""


def find_examples_dir() -> Path:
    """The first folder holding a transcript of: ``./examples``; ``hookbus/cli/examples``
    (the copy an installed wheel carries, beside this package); the ``examples/`` folder
    of the source checkout this module belongs to (``demo/hookbus/demo/_app.py`` ->
    ``examples/``, an editable install).

    Raises:
        click.ClickException: none exists.
    """
    here = Path(__file__).resolve()
    candidates = [
        Path.cwd() / "examples",
        here.parents[1] / "cli" / "examples",
        here.parents[3] / "examples",
    ]
    for folder in candidates:
        if (folder / TRANSCRIPT_FILE).is_file():
            return folder
    raise click.ClickException(
        "no examples folder with a transcript.json (looked in "
        + ", ".join(str(c) for c in candidates)
        + "); pass one with --examples-dir"
    )


# -- worker processes -----------------------------------------------------------------------


class _Fleet:
    """Every worker replica of the transcript, started and stopped together."""

    def __init__(
        self,
        conn: str | ConnectionSettings,
        examples_dir: Path,
        workers: list[WorkerFile],
        approver: str | None,
        credentials: Credentials | None = None,
    ) -> None:
        if not isinstance(conn, ConnectionSettings):
            conn = ConnectionSettings(url=conn)
        url = conn.url or ""

        def env_of(role: str, name: str) -> dict[str, str]:
            return (credentials(role, name) if credentials else conn).child_env()

        self.processes: list[_WorkerProcess] = []
        self.approver: _WorkerProcess | None = None
        if approver is not None:
            script = str((examples_dir / approver).resolve())
            env = {**env_of("approver", DEMO_APPROVER), "HOOKBUS_APPROVER": DEMO_APPROVER}
            self.approver = _WorkerProcess(approver, [sys.executable, script, url], env)
        for spec in workers:
            target = f"{(examples_dir / spec.file).resolve()}:{spec.attr}"
            for replica in range(1, spec.replicas + 1):
                label = spec.file if spec.replicas == 1 else f"{spec.file} #{replica}"
                command = [
                    sys.executable,
                    "-m",
                    "hookbus.cli",
                    "--log-level",
                    "info",
                    "worker",
                    target,
                    "--url",
                    url,
                ]
                env = env_of("worker", worker_identity(spec.file))
                self.processes.append(_WorkerProcess(label, command, env))

    @property
    def all(self) -> list[_WorkerProcess]:
        """The worker replicas and the approver."""
        return [*self.processes, *([self.approver] if self.approver else [])]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Start every replica; on leaving, even on an error or a cancel, stop them all."""
        with _single_errors():
            async with anyio.create_task_group() as tg:
                try:
                    for proc in self.all:
                        await proc.start(tg)
                    yield
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.stop()

    async def stop(self) -> None:
        """SIGTERM every replica (each drains: in-flight requests are answered), wait up
        to `STOP_TIMEOUT_S` seconds, then SIGKILL what is left; wait for their output."""
        running = [p for p in self.all if p.process is not None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        with anyio.move_on_after(STOP_TIMEOUT_S):
            for proc in running:
                await proc.exited.wait()
        for proc in running:
            if not proc.exited.is_set():
                proc.lines.append(f"(killed: still running {STOP_TIMEOUT_S:g} s after SIGTERM)")
                proc.send_signal(signal.SIGKILL)
                await proc.exited.wait()
        with anyio.move_on_after(STOP_TIMEOUT_S):
            for proc in running:
                await proc.eof.wait()


def _expected_declarations(
    examples_dir: Path, transcript: Transcript
) -> dict[str, list[HandlerDeclaration]]:
    """The handler declarations of each worker file, read from its `HookWorker`.

    Raises:
        click.ClickException: a file is missing or its attribute is not a `HookWorker`.
    """
    out: dict[str, list[HandlerDeclaration]] = {}
    for spec in transcript.workers:
        path = examples_dir / spec.file
        if not path.is_file():
            raise click.ClickException(f"worker file {path} (in {TRANSCRIPT_FILE}) is missing")
        try:
            obj = load_object(f"{path.resolve()}:{spec.attr}")
        except click.BadParameter as exc:  # the message names the file when it failed to load
            named = str(path.resolve()) in exc.message
            raise click.ClickException(exc.message if named else f"{path}: {exc.message}") from exc
        except Exception as exc:  # the module itself failed while loading
            raise click.ClickException(
                f"{path} failed to load: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(obj, HookWorker):
            raise click.ClickException(
                f"{path}:{spec.attr} is a {type(obj).__name__}, not a HookWorker"
            )
        out[spec.file] = [h.declaration for h in obj.handlers]
    return out


async def _handlers_bucket(nc: NATS) -> KeyValue:
    js = nc.jetstream()
    try:
        return await js.create_key_value(config=handlers_bucket_config())
    except nats.js.errors.BadRequestError:  # exists with another config: use it as it is
        return await js.key_value(handlers_bucket_config().bucket)


async def _live_keys(watcher: Any) -> set[str]:
    """Consume a fresh watch's initial values (up to its None marker): the live keys."""
    live: set[str] = set()
    while (entry := await watcher.updates(timeout=10.0)) is not None:
        if entry.operation is None:
            live.add(entry.key)
        else:
            live.discard(entry.key)
    return live


async def _wait_ready(watcher: Any, pending: Counter[str], fleet: _Fleet, timeout_s: float) -> None:
    """Wait until every expected declaration put has been seen (each replica puts its
    declarations after its subscriptions are flushed), or fail on the first replica that
    exits, or after `timeout_s` seconds.

    Raises:
        click.ClickException: a worker exited early, or not all were ready in time.
    """
    dead: _WorkerProcess | None = None

    async def puts(tg: anyio.abc.TaskGroup) -> None:
        if fleet.approver is not None:
            await fleet.approver.ready.wait()
        while +pending:
            try:
                entry = await watcher.updates(timeout=timeout_s + 5)
            except nats.errors.TimeoutError:
                return
            if entry is not None and entry.operation is None and pending[entry.key] > 0:
                pending[entry.key] -= 1
        tg.cancel_scope.cancel()

    async def exits(proc: _WorkerProcess, tg: anyio.abc.TaskGroup) -> None:
        nonlocal dead
        await proc.exited.wait()
        dead = proc
        tg.cancel_scope.cancel()

    with anyio.move_on_after(timeout_s):
        async with anyio.create_task_group() as tg:
            tg.start_soon(puts, tg)
            for proc in fleet.all:
                tg.start_soon(exits, proc, tg)
    if dead is not None:
        await dead.eof.wait()
        raise click.ClickException(
            f"worker {dead.label} exited with code {dead.returncode} before serving:\n{dead.tail()}"
        )
    if +pending:
        missing = ", ".join(sorted(k for k, n in pending.items() if n))
        raise click.ClickException(
            f"the workers did not declare {missing} within {timeout_s:g} s:\n"
            + "\n".join(f"  {p.label}:\n{p.tail(5)}" for p in fleet.processes)
        )


APPROVER_REPORT_S = 5.0
"""Seconds to wait, after the agents, for the approver to print the answers that decided."""


async def _approver_reported(approver: _WorkerProcess, answers: int, timeout_s: float) -> None:
    """Wait until `approver` has printed `answers` "approver answered" lines (or exited,
    or `timeout_s` passed). An approver's answer decides as soon as its proof is written
    (the deciding dispatcher resolves the approval), but the approver learns that it
    decided, and prints so, only a moment later: stopping it at once would lose the line."""
    with anyio.move_on_after(timeout_s):
        while not approver.exited.is_set():
            if sum(line.startswith("approver answered") for line in approver.lines) >= answers:
                return
            await anyio.sleep(0.02)


# -- the agents --------------------------------------------------------------------------


@dataclass
class _Decision:
    """One emit of one agent and what came of it."""

    agent: str
    step_no: int
    step: Step
    sent: dict[str, Any]
    """The data as the agent emitted it, with its default fields."""
    result: HookResult | None
    error: str | None
    latency_ms: float
    aos: AosOutcome | None = None
    """With ``--via aos``: the AOS request sent and the door's answer (None: emitted
    directly, AOS has no method for the step)."""

    @property
    def tool(self) -> str:
        tool = self.step.data.get("tool_name")
        return tool if isinstance(tool, str) else ""

    @property
    def action(self) -> str:
        """The decision as shown (see `shown_action`)."""
        return shown_action(self.result)

    @property
    def handler(self) -> str:
        """Who decided (see `deciding_handler`)."""
        return deciding_handler(self.result)

    answered_in_terminal: bool = False
    """With --interactive: an approval of this step was answered in the terminal, so any
    option offered is a right answer (see `ok`)."""

    @property
    def ok(self) -> bool:
        """The decision is the transcript's; with an approval answered in the terminal
        (--interactive), the decision of any option offered (an allowing one continues as
        the transcript expects, a denying one denies, by the asking handler)."""
        want = self.step.expect
        if self.aos is not None and not self.aos_agrees:
            return False
        if self.answered_in_terminal and self.action == "deny":
            return want.decided_by is None or want.decided_by == self.handler
        if self.action != want.action:
            return False
        return want.decided_by is None or want.decided_by == self.handler

    @property
    def aos_agrees(self) -> bool:
        """The AOS decision is the hookbus decision: ``deny`` exactly when the result denies
        (deny, or an ask_user no approver allowed); ``allow`` or ``modify`` otherwise."""
        if self.aos is None:
            return True
        denied = self.result is None or self.result.action in ("deny", "ask_user")
        return (self.aos.decision == "deny") if denied else self.aos.decision in ("allow", "modify")


def _routing_warnings(
    list_handlers: Callable[[str], dict[str, list[str]]], expected: dict[str, set[str]], who: str
) -> list[str]:
    """Warnings for the handlers routed on the demo's events that the demo did not start.

    Raises:
        _AgentSetupError: a handler the demo started is not routed (`who` names the router).
    """
    warnings: list[str] = []
    for event, names in expected.items():
        routed = set(list_handlers(event)[event])
        if missing := names - routed:
            raise _AgentSetupError(f"{who}: {event} handlers {sorted(missing)} are not routed")
        extra = sorted(routed - names)
        if extra:
            warnings.append(f"{event} also has handlers the demo did not start: {', '.join(extra)}")
    return warnings


async def _run_agents(
    url: str | ConnectionSettings,
    transcript: Transcript,
    expected: dict[str, set[str]],
    credentials: Credentials | None = None,
    via: str = "direct",
    service: HookDispatcher | None = None,
) -> tuple[list[_Decision], float, list[str]]:
    """Run every agent concurrently; return the decisions in completion order, the wall
    time in seconds, and warnings (handlers on the demo's events that the demo did not start).
    `via` ``aos``: each step the AOS door can carry goes through it (`answer_step`).

    `service`: the dispatcher of the demo's `DispatcherService` (``--secure``): each agent
    sends its emits to the service (`service_emit`) instead of running a dispatcher, and
    the routing is checked once, on the service's dispatcher (an agent may not read the
    handler registry)."""
    if via == "aos":  # the AOS door is imported only for --via aos
        from ._aos import answer_step

    decisions: list[_Decision] = []
    warnings: list[str] = []
    go = anyio.Event()
    if service is not None:
        try:
            warnings += _routing_warnings(service.list_handlers, expected, "dispatcher service")
        except _AgentSetupError as exc:
            raise click.ClickException(str(exc)) from None

    async def steps(script: AgentScript, emit: Emit) -> None:
        for no, step in enumerate(script.steps, 1):
            sent = {"agent_id": script.id, "session_id": script.session_id, **step.data}
            t0 = time.perf_counter()
            aos = await answer_step(emit, script, no, step) if via == "aos" else None
            if aos is not None:  # the door never raises: a failure is its deny
                result, error = aos.result, None if aos.result else aos.message
                sent = {"agent_id": script.id, "session_id": script.session_id, **aos.sent}
            else:
                try:
                    result, error = await emit(step.event, step.data), None
                except HookbusError as exc:
                    result, error = None, f"{type(exc).__name__}: {exc}"
            ms = (time.perf_counter() - t0) * 1000
            decisions.append(_Decision(script.id, no, step, sent, result, error, ms, aos))

    async def agent(script: AgentScript, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        conn = credentials("agent", script.id) if credentials else url
        nc = await connect(conn, name=f"hookbus-demo-agent {script.id}")
        try:  # each agent acts as itself: with --secure, its NATS user allows nothing else
            if service is not None:  # a client of the dispatcher service only
                task_status.started()
                await go.wait()
                emit = service_emit(nc, agent_id=script.id)
                await steps(script, with_ids(emit, script.id, script.session_id))
                return
            async with HookDispatcher(nc, strict_events=True, agent_id=script.id) as d:
                d.set_default_fields(agent_id=script.id, session_id=script.session_id)
                for note in _routing_warnings(d.list_handlers, expected, f"agent {script.id}"):
                    if note not in warnings:
                        warnings.append(note)
                task_status.started()
                await go.wait()
                await steps(script, d.emit)
        finally:
            await nc.close()

    with _single_errors():
        async with anyio.create_task_group() as tg:
            for script in transcript.agents:
                await tg.start(agent, script)
            t0 = time.perf_counter()
            go.set()
    return decisions, time.perf_counter() - t0, warnings


# -- output ------------------------------------------------------------------------------


def _short(value: Any, limit: int = 150) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _changes(before: Any, after: Any, path: str = "") -> list[str]:
    """Leaf-level differences between two JSON values, as ``path = new`` strings."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = []
        for key in after:
            if key in ("timestamp", "modified_by", "redactions") and not path:
                continue
            sub = f"{path}.{key}" if path else str(key)
            if key not in before:
                out.append(f"{sub} = {_short(after[key])}")
            else:
                out.extend(_changes(before[key], after[key], sub))
        out.extend(f"{path + '.' if path else ''}{k} removed" for k in before if k not in after)
        return out
    return [] if before == after else [f"{path} = {_short(after)}"]


def _detail(d: _Decision) -> str:
    r = d.result
    if r is None:
        return d.error or ""
    parts = []
    if r.action in ("deny", "ask_user"):
        parts.append(r.reason or r.approval_prompt or "")
    elif r.action == "continue" and r.approval_prompt:
        parts.append(f"asked {r.approval_prompt!r}; {r.reason}")
        if r.modified_by:
            changes = "; ".join(_changes(d.sent, r.chained_data or {}))
            parts.append(f"(data modified by {', '.join(r.modified_by)}: {changes})")
    elif r.action == "inject_context":
        parts.append(f"injects ({r.context_injection_role}): {_short(r.context_injection or '')}")
    elif d.action == "modify":
        parts.append("; ".join(_changes(d.sent, r.chained_data or {})))
    parts.extend(
        f"[{f.handler} failed: {f.kind}, policy {f.policy}]"
        for f in r.failures
        if not (r.action == "deny" and f.handler == r.decided_by)
    )
    return " ".join(p for p in parts if p)


def _print_handlers(console: Console, declared: dict[str, list[HandlerDeclaration]]) -> None:
    chains: dict[str, list[HandlerDeclaration]] = {}
    for decls in declared.values():
        for decl in decls:
            chains.setdefault(decl.event, []).append(decl)
    console.print("[bold]call order per event[/] (priority; parallel runs share one round trip):")
    for event in sorted(chains):
        links = []
        for decl in sorted(chains[event], key=lambda x: (x.priority, x.name)):
            marks = [str(decl.priority)]
            if decl.failure_policy == "deny":
                marks.append("fail closed")
            if decl.parallel:
                marks.append("parallel")
            links.append(f"{decl.name} ({', '.join(marks)})")
        console.print(f"  {event:<15} {' -> '.join(links)}", highlight=False)


def _aos_table(console: Console, decisions: list[_Decision]) -> None:
    table = Table(title="sent through the AOS door (same # as above)", title_justify="left")
    table.add_column("#", justify="right", min_width=2)
    table.add_column("agent", no_wrap=True)
    table.add_column("step", justify="right", min_width=4)
    table.add_column("sent as", no_wrap=True)
    table.add_column("aos decision", no_wrap=True)
    table.add_column("aos message", no_wrap=True, overflow="ellipsis", max_width=70)
    for i, d in enumerate(decisions, 1):
        aos = d.aos
        decision = aos.decision if aos is not None else ""
        style = {"deny": "bold red", "modify": "yellow", "allow": "green"}.get(decision, "")
        table.add_row(
            str(i),
            d.agent,
            str(d.step_no),
            aos.method if aos is not None else "direct (no AOS method)",
            f"[{style}]{decision}[/]" if style else decision,
            aos.message if aos is not None else "",
        )
    console.print(table)


def _report(
    console: Console,
    decisions: list[_Decision],
    elapsed_s: float,
    fleet: _Fleet,
    warnings: list[str],
    transcript: Transcript,
) -> int:
    via_aos = any(d.aos is not None for d in decisions)
    table = Table(title="decisions (in completion order)", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("agent", no_wrap=True)
    table.add_column("step", justify="right")
    table.add_column("event", no_wrap=True)
    table.add_column("tool", no_wrap=True)
    table.add_column("action", no_wrap=True)
    table.add_column("deciding handler", no_wrap=True)
    table.add_column("approved by", no_wrap=True)
    table.add_column("latency ms", justify="right", no_wrap=True)
    table.add_column("expected", no_wrap=True)
    for i, d in enumerate(decisions, 1):
        style = _STYLE.get(d.action, "")
        table.add_row(
            str(i),
            d.agent,
            str(d.step_no),
            d.step.event,
            d.tool,
            f"[{style}]{d.action}[/]",
            d.handler,
            (d.result.approved_by or "") if d.result is not None else "",
            f"{d.latency_ms:.2f}",
            "[green]ok[/]" if d.ok else "[bold red]MISMATCH[/]",
        )
    console.print(table)
    if via_aos:  # hookbus demo --via aos: what was sent, and what the AOS agent was told
        _aos_table(console, decisions)

    console.print("[bold]what the handlers did[/] (every decision other than a plain continue):")
    for i, d in enumerate(decisions, 1):
        if d.action != "continue" or d.handler:
            console.print(
                f"  {i:>2} {d.agent} step {d.step_no} {d.step.event} {d.tool}".rstrip()
                + f" -> {d.action}"
                + (f" by {d.handler}" if d.handler else "")
                + f": {_detail(d)}",
                highlight=False,
                soft_wrap=True,
            )

    counts = Counter(d.action for d in decisions)
    latencies = sorted(d.latency_ms for d in decisions)
    agents = len(transcript.agents)
    console.print("\n[bold]summary[/]")
    console.print(
        f"  {len(decisions)} decisions from {agents} concurrent agents"
        f" in {elapsed_s * 1000:.0f} ms: "
        + ", ".join(f"{n} {action}" for action, n in counts.most_common()),
        highlight=False,
    )
    if latencies:
        p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
        console.print(
            f"  latency per emit: p50 {statistics.median(latencies):.2f} ms, p95 {p95:.2f} ms,"
            f" max {latencies[-1]:.2f} ms",
            highlight=False,
        )
    served = ", ".join(
        f"{p.label} (pid {p.pid}): {p.handled if p.handled is not None else '?'}"
        for p in fleet.processes
    )
    console.print(
        f"  requests answered per worker process (from their drain logs): {served}",
        highlight=False,
        soft_wrap=True,
    )
    if fleet.approver is not None:
        answers = [line for line in fleet.approver.lines if line.startswith("approver answered")]
        console.print(
            f"  approvals answered by the approver process (pid {fleet.approver.pid}):"
            f" {len(answers)}",
            highlight=False,
        )
        for line in answers:
            console.print(f"    {line}", highlight=False, soft_wrap=True)
        for line in fleet.approver.lines:  # what it could not answer, and why
            if line.startswith("approver: "):
                warnings = [*warnings, f"the approver process: {line.removeprefix('approver: ')}"]
    if via_aos:
        sent = [d.aos for d in decisions if d.aos is not None]
        told = Counter(a.decision for a in sent)
        console.print(
            f"  sent through the AOS door: {len(sent)} steps ("
            + ", ".join(f"{n} {decision}" for decision, n in told.most_common())
            + f"); {len(decisions) - len(sent)} emitted directly (AOS has no method for them)",
            highlight=False,
        )
    for warning in warnings:
        console.print(f"  [yellow]warning:[/] {warning}", highlight=False)
    mismatches = [d for d in decisions if not d.ok]
    if not mismatches:
        yours = sum(d.answered_in_terminal for d in decisions)
        console.print(
            f"  [bold green]all {len(decisions)} decisions match the transcript[/]"
            + (f" ({yours} decided by your answer in the terminal)" if yours else "")
        )
        return 0
    console.print(f"  [bold red]{len(mismatches)} decision(s) differ from the transcript:[/]")
    for d in mismatches:
        want = d.step.expect
        got = d.action + (f" by {d.handler}" if d.handler else "")
        wanted = want.action + (f" by {want.decided_by}" if want.decided_by else "")
        console.print(
            f"  MISMATCH {d.agent} step {d.step_no} ({d.step.event} {d.tool}".rstrip()
            + f"): expected {wanted}, got {got}"
            + (f" ({d.error})" if d.error else "")
            + (f"; the AOS door answered {d.aos.decision}" if not d.aos_agrees and d.aos else ""),
            highlight=False,
            soft_wrap=True,
        )
    return 1


def _say(console: Console, text: str) -> None:
    console.print(text, highlight=False, soft_wrap=True)


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 160))


@contextlib.asynccontextmanager
async def _terminal_approver(
    url: str | ConnectionSettings, console: Console, *, enabled: bool
) -> AsyncIterator[None]:
    """With --interactive: ask in the terminal for every pending approval while the agents run."""
    if not enabled:
        yield
        return
    nc = await connect(url, name="hookbus-demo-terminal-approver")  # approver's settings
    try:
        async with HookDispatcher(nc, approvals=False) as hooks:
            events = await hooks.hook_events()

            async def ask() -> None:
                async for event in events:
                    hook = event.hook
                    if hook.status != "pending" or not hook.label.startswith(APPROVAL_LABEL_PREFIX):
                        continue
                    options = list(hook.metadata.get("options") or ["Allow", "Deny"])
                    console.print(
                        f"\n[bold]approval needed[/]: {hook.metadata.get('prompt')}"
                        + _times_out(hook.metadata)
                    )
                    choice = await anyio.to_thread.run_sync(
                        lambda opts=options: click.prompt(  # type: ignore[misc]
                            "answer", type=click.Choice(opts), default=opts[0]
                        )
                    )
                    with contextlib.suppress(HookbusError):
                        await hooks.answer_approval(
                            hook.label, choice, approver=DEMO_APPROVER, agent_id=hook.agent_id
                        )

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
                    await events.aclose()
    finally:
        await nc.close()


def _times_out(metadata: dict[str, object]) -> str:
    """What the terminal prompt says of an approval's wait: ``" (times out in 30 s: then
    <default>)"``, from its metadata (``timeout_s``, ``default``); empty without a timeout."""
    timeout = metadata.get("timeout_s")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        return ""
    default = metadata.get("default")
    then = f": then {default}" if isinstance(default, str) and default else ""
    return f" (times out in {timeout:g} s{then})"


# -- buckets and the dispatcher service -----------------------------------------------------
async def _provision(nc: NATS, *, secure: bool) -> None:
    """Create every bucket hookbus uses (handlers, suspensions, approvals, leases) on `nc`
    before anyone else opens them.

    With `secure`, `nc` is the admin's, the only role that may create a stream: the
    buckets and the audit stream are made as ``hookbus auth provision`` makes them, and
    the workers, the approver, the agents and the dispatcher service only open them.
    Otherwise as a dispatcher creates them on an open server.

    Raises:
        click.ClickException: JetStream refused or stayed unavailable.
    """
    try:
        if secure:
            from hookbus.cli import provision  # the auth commands, only for --secure

            await provision(nc)
        else:
            async with HookDispatcher(nc, approvals=True):
                pass
    except HookbusError as exc:
        raise click.ClickException(f"cannot create hookbus's buckets: {exc}") from exc


SERVICE_GRACE_S = 5.0
"""Seconds the demo's dispatcher service gets to drain when the agents are done."""


@contextlib.asynccontextmanager
async def _dispatcher_service(
    credentials: Credentials | None,
) -> AsyncIterator[HookDispatcher | None]:
    """With `credentials` (``--secure``): a `DispatcherService` connected as the
    ``dispatcher`` identity, serving every agent's emits while the block runs; yields its
    dispatcher (started: the current declarations are routed). Without: nothing (None)."""
    if credentials is None:
        yield None
        return
    nc = await connect(credentials("dispatcher", "dispatcher"), name="hookbus-demo-dispatcher")
    try:
        dispatcher = HookDispatcher(nc, strict_events=True)
        service = DispatcherService(dispatcher, nc, grace_s=SERVICE_GRACE_S)
        try:
            await service.start()
        except HookbusError as exc:
            raise click.ClickException(f"the dispatcher service did not start: {exc}") from exc
        try:
            yield dispatcher
        finally:
            with anyio.CancelScope(shield=True):
                await service.stop()
    finally:
        with anyio.CancelScope(shield=True):
            await nc.close()


_REPORTED_IN_THE_TABLE = re.compile(r"handler '[^']*' failed \(")
"""A dispatcher's log line about a handler that failed: each failure is in the decision
table and in "what the handlers did" (the demo fails one on purpose)."""


class _Held(logging.Handler):
    """Keeps the ``hookbus`` loggers' warnings of the agents' run for the report."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if not _REPORTED_IN_THE_TABLE.match(text):
            self.lines.append(f"{record.levelname.lower()} from {record.name}: {text}")


@contextlib.contextmanager
def _warnings_after_the_table() -> Iterator[list[str]]:
    """While the agents run: the ``hookbus`` loggers' warnings are held (yielded as lines
    for the report's warnings, after the table) instead of printed bare on stderr before
    it; those about a handler that failed are dropped, the table says each. Nothing is
    held when logging says more than warnings (``--log-level info`` or ``debug``)."""
    logger = logging.getLogger("hookbus")
    lines: list[str] = []
    if logging.getLogger().getEffectiveLevel() < logging.WARNING:
        yield lines
        return
    held = _Held()
    propagate = logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    try:
        yield lines
    finally:
        logger.propagate = propagate
        logger.removeHandler(held)
        lines += held.lines


# -- entry point -------------------------------------------------------------------------
async def demo_main(
    url: str | ConnectionSettings,
    examples_dir: Path,
    *,
    interactive: bool = False,
    credentials: Credentials | None = None,
    agents: Sequence[str] = (),
    ai_python: str | None = None,
    via: str = "direct",
) -> int:
    """Run the demo against the NATS server at `url` (or with these connection settings;
    the worker processes get them too) with the workers and transcript in
    `examples_dir`; print the decision table and summary.

    With `credentials` (``hookbus demo --secure``), every process connects as its own
    identity: the demo itself as ``admin`` (it creates the buckets and removes its
    declarations), each worker file as ``worker <file stem>``, the approver as
    ``approver demo-approver``, a `DispatcherService` in this process as ``dispatcher``,
    and each agent as ``agent <id>``, a client of that service (see `demo_identities`).

    `agents` (``hookbus demo --agents``): framework agents run after the scripted ones,
    against the same server, workers and approver: ``pydantic-ai`` (in this process) and
    ``ai`` (a subprocess of `ai_python`, a Python >= 3.12; None: found as
    `find_ai_python` says). Both are checked before anything starts.

    `via` (``hookbus demo --via``): ``direct`` (each agent emits its steps) or ``aos`` (each
    step that AOS has a method for is sent as an OWASP AOS JSON-RPC request through the AOS
    guardian door, `hookbus.integrations.aos.answer`, in this process with the agent's
    dispatcher; the table adds the method sent and the AOS decision, which must agree with
    the hookbus decision: see `hookbus.demo._aos`).

    Returns:
        0 if every decision matched the transcript's expectation and every framework agent
        did what its example expects, 1 otherwise.
    Raises:
        click.ClickException: a bad transcript or worker file, a worker that exits or is
            not ready within `READY_TIMEOUT_S` seconds, NATS not reachable, or a framework
            agent that cannot run here (see `prepare_agents`).
    """
    from ._agents import prepare_agents, report_agents  # only for --agents

    console = _console()
    transcript = load_transcript(examples_dir / TRANSCRIPT_FILE)
    framework = await prepare_agents(
        agents, examples_dir, ai_python=ai_python, credentials=credentials
    )
    declared = _expected_declarations(examples_dir, transcript)
    pending: Counter[str] = Counter()
    expected: dict[str, set[str]] = {}
    for spec in transcript.workers:
        for decl in declared[spec.file]:
            pending[handler_key(decl.event, decl.name)] += spec.replicas
            expected.setdefault(decl.event, set()).add(decl.name)
    steps = sum(len(a.steps) for a in transcript.agents)

    nc = await connect(credentials("admin", "admin") if credentials else url, name="hookbus-demo")
    try:
        await _provision(nc, secure=credentials is not None)
        kv = await _handlers_bucket(nc)
        watcher = await watch_keys(kv)
        try:
            live_before = await _live_keys(watcher)
            approver = None if interactive else transcript.approver
            fleet = _Fleet(url, examples_dir, transcript.workers, approver, credentials)
            replicas = ", ".join(f"{w.file} x{w.replicas}" for w in transcript.workers)
            _say(console, f"starting {len(fleet.processes)} worker processes: {replicas}")
            t0 = time.perf_counter()
            async with fleet.running():
                await _wait_ready(watcher, pending, fleet, READY_TIMEOUT_S)
                ready_s = time.perf_counter() - t0
                _say(console, f"all replicas subscribed and declared in {ready_s:.1f} s")
                _print_handlers(console, declared)
                terminal = credentials("approver", DEMO_APPROVER) if credentials else url
                async with (
                    _dispatcher_service(credentials) as service,
                    _terminal_approver(terminal, console, enabled=interactive),
                ):
                    how = (
                        "dispatcher"
                        if service is None
                        else "the dispatcher service's client (the service, as identity"
                        " dispatcher, calls the handlers and asks for approvals)"
                    )
                    _say(
                        console,
                        f"{len(transcript.agents)} agents replay {steps} steps of"
                        f" {TRANSCRIPT_FILE} concurrently, each with its own connection and"
                        f" {how}\n",
                    )
                    with _warnings_after_the_table() as logged:
                        decisions, elapsed_s, warnings = await _run_agents(
                            url, transcript, expected, credentials, via, service
                        )
                    warnings += logged
                    for d in decisions if interactive else ():  # no scripted approver then
                        d.answered_in_terminal = bool(d.result and d.result.approved_by)
                    outcomes = await framework.run(url, console, credentials)
                if fleet.approver is not None:  # its answers are reported before it stops
                    results = [d.result for d in decisions]
                    results += [e.result for o in outcomes for e in o.emits]
                    approved = sum(1 for r in results if r is not None and r.approved_by)
                    await _approver_reported(fleet.approver, approved, APPROVER_REPORT_S)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()
        for key in set(pending) - live_before:  # the demo's own declarations go with it
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await kv.delete(key)
    finally:
        await nc.close()
    code = _report(console, decisions, elapsed_s, fleet, warnings, transcript)
    return max(code, report_agents(console, outcomes))


def run(
    conn: ConnectionSettings,
    examples_dir: str | None,
    *,
    interactive: bool,
    secure: bool,
    auth_dir: str,
    agents: tuple[str, ...],
    ai_python: str | None,
    via: str,
    otlp_endpoint: str | None,
) -> int:
    """``hookbus demo`` with its options (the CLI's command only loads this): the server is
    `conn`, else the demo's own embedded one; with `secure`, the identities of `auth_dir`.

    Returns:
        the exit code (`demo_main`'s).
    """
    folder = Path(examples_dir) if examples_dir else find_examples_dir()
    if otlp_endpoint:  # worker processes the demo starts export there too
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    with otel_session("hookbus-demo", otlp_endpoint, keep_spans=True) as otel:
        if secure:
            credentials = secure_credentials(Path(auth_dir), conn.url)
            target = credentials("admin", "admin")
            click.echo(f"secure demo: every process as its own identity from {auth_dir}/"
                       f" at {target.url}", err=True)  # fmt: skip
            code = run_async(demo_main(target, folder, interactive=interactive,
                                       credentials=credentials, agents=agents,
                                       ai_python=ai_python, via=via))  # fmt: skip
        else:
            if conn.url is None:  # nothing said where: the demo's own server
                conn = ConnectionSettings(embedded=True, inbox_prefix=conn.inbox_prefix)
            with connection_or_embedded(conn) as server:
                code = run_async(demo_main(server, folder, interactive=interactive,
                                           agents=agents, ai_python=ai_python,
                                           via=via))  # fmt: skip
        print_denied_trace(otel)
    return code


# -- identities (hookbus demo --secure) ----------------------------------------------------
def worker_identity(file: str) -> str:
    """The worker identity that serves a worker file: its stem (``security_policy.py`` ->
    ``security_policy``)."""
    return Path(file).stem


def demo_identities(
    examples_dir: Path,
) -> tuple[list[str], list[str], list[str], list[str]]:
    """The identities the demo needs besides admin and dispatcher: ``(agents,
    embedded_agents, workers, approvers)``, as ``hookbus auth init --demo`` writes them.
    The agents (the transcript's, then the pydantic-ai one of ``--agents``) are plain
    ``agent`` identities, clients of the dispatcher service; the ``ai`` agent keeps its
    runs' suspensions in hookbus itself (durable hooks), which takes an embedded agent
    identity; each worker is ``NAME:EVENT/HANDLER,EVENT/HANDLER``, every (event, handler)
    its file declares.

    Raises:
        click.ClickException: a bad transcript or worker file.
    """
    from ._agents import FRAMEWORK_AGENT_IDS  # the --agents ones act as agents too

    transcript = load_transcript(examples_dir / TRANSCRIPT_FILE)
    declared = _expected_declarations(examples_dir, transcript)
    workers: dict[str, list[str]] = {}
    for spec in transcript.workers:
        pairs = workers.setdefault(worker_identity(spec.file), [])
        pairs += [f"{d.event}/{d.name}" for d in declared[spec.file]]
    agents = [a.id for a in transcript.agents]
    embedded = [FRAMEWORK_AGENT_IDS["ai"]]
    framework = [a for a in FRAMEWORK_AGENT_IDS.values() if a not in embedded]
    return (
        list(dict.fromkeys([*agents, *framework])),
        embedded,
        [f"{name}:{','.join(sorted(set(pairs)))}" for name, pairs in workers.items()],
        [DEMO_APPROVER],
    )
