"""What the demo's parts share: the transcript and its types, a worker process, the way a
decision is shown, and the agents' helpers (the scripted agents of `hookbus.demo._app`,
the framework agents of `hookbus.demo._agents`, the AOS door of `hookbus.demo._aos`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import click
import msgspec

from hookbus.cli import ConnectionSettings
from hookbus.integrations import Emit
from hookbus.schemas import Action, HookResult

TRANSCRIPT_FILE = "transcript.json"

APPROVER_READY = "approver ready"
DEMO_APPROVER = "demo-approver"
"""The approver name the demo's approver (the script, or the --interactive terminal)
answers as; with --secure, the identity ``approver-demo-approver`` of the auth folder."""

Credentials = Callable[[str, str], ConnectionSettings]
"""(role, name) -> the connection settings of that identity (``hookbus demo --secure``)."""
_DRAINED = re.compile(r"drained after (\d+) request")


# -- the transcript -----------------------------------------------------------------------
class _Spec(msgspec.Struct, forbid_unknown_fields=True):
    """Base of the transcript types: a misspelt key is an error, not silently ignored."""


class WorkerFile(_Spec):
    """A worker to run: ``<examples>/<file>:<attr>`` in `replicas` processes."""

    file: str
    attr: str = "worker"
    replicas: int = 1


class Expect(_Spec):
    """The decision a step must get."""

    action: Action
    decided_by: str | None = None
    """The deciding handler (deny, ask_user), the modifying one (modify), or the injecting
    ones joined by ``", "`` (inject_context). None: not checked."""


class Step(_Spec):
    """One emit of an agent."""

    event: str
    expect: Expect
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    aos: str = ""
    """The OWASP AOS hook this step replays (``steps/toolCallRequest``, ...)."""
    note: str = ""


class AgentScript(_Spec):
    """One agent of the fleet and the steps it replays, in order."""

    id: str
    session_id: str
    steps: list[Step]
    name: str = ""


class Transcript(_Spec):
    """The whole demo: worker files and agents."""

    workers: list[WorkerFile]
    agents: list[AgentScript]
    approver: str | None = None
    """A script (``<examples>/<approver> NATS_URL``) that answers approvals; it prints
    ``approver ready`` once subscribed. Replaced by a terminal prompt with --interactive."""
    description: str = ""
    source: str = ""


def load_transcript(path: Path) -> Transcript:
    """Read and check a transcript file.

    Raises:
        click.ClickException: unreadable file, invalid JSON, or a field that does not fit
            (the message has the JSON path, e.g. ``$.agents[0].steps[3].expect.action``).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise click.ClickException(f"cannot read the transcript {path}: {exc}") from exc
    try:
        transcript = msgspec.json.decode(raw, type=Transcript)
    except msgspec.DecodeError as exc:
        raise click.ClickException(f"{path} is not a valid transcript: {exc}") from exc
    if not transcript.agents or not transcript.workers:
        raise click.ClickException(f"{path}: a transcript needs at least one agent and one worker")
    for i, worker in enumerate(transcript.workers):
        if worker.replicas < 1:
            raise click.ClickException(f"{path}: $.workers[{i}].replicas must be at least 1")
    return transcript


@dataclass(eq=False)
class _WorkerProcess:
    """One worker replica: its process, everything it printed, and how it ended."""

    label: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to this process's environment (the connection settings)."""
    process: anyio.abc.Process | None = None
    lines: list[str] = field(default_factory=list)
    exited: anyio.Event = field(default_factory=anyio.Event)
    eof: anyio.Event = field(default_factory=anyio.Event)
    ready: anyio.Event = field(default_factory=anyio.Event)
    """Set when the process prints `APPROVER_READY` (the approver's ready signal)."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process else None

    @property
    def handled(self) -> int | None:
        """Requests the worker answered, from its drain log line (None if it has none)."""
        for line in reversed(self.lines):
            if match := _DRAINED.search(line):
                return int(match.group(1))
        return None

    def tail(self, n: int = 15) -> str:
        return "\n".join(f"    {line}" for line in self.lines[-n:]) or "    (no output)"

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.process = await anyio.open_process(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        tg.start_soon(self._read)
        tg.start_soon(self._wait)

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        buffer = b""
        try:
            async for chunk in self.process.stdout:
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                self.lines.extend(line.decode(errors="replace") for line in complete)
                if any(line.strip() == APPROVER_READY.encode() for line in complete):
                    self.ready.set()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            if buffer:
                self.lines.append(buffer.decode(errors="replace"))
            self.eof.set()

    async def _wait(self) -> None:
        assert self.process is not None
        await self.process.wait()
        self.exited.set()

    def send_signal(self, sig: signal.Signals) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


def shown_action(r: HookResult | None) -> str:
    """The decision as the demo shows it: the result's action, ``modify`` for a plain
    continue whose data a handler replaced (amplifier-core's emit returns it as ``continue``
    with the data), ``error`` for no result (the emit raised)."""
    if r is None:
        return "error"
    if r.action == "continue" and r.modified_by and not r.approval_prompt:
        return "modify"
    return r.action


def deciding_handler(r: HookResult | None) -> str:
    """Who decided: the deny / ask_user handler, the modifying handler(s)
    (``result.modified_by``), the injecting handler(s), the asking handler of an allowed
    approval; ``""`` for a plain continue or no result."""
    if r is None:
        return ""
    if r.action in ("deny", "ask_user"):
        return r.decided_by or "?"
    if r.action == "inject_context":
        return ", ".join(dict.fromkeys(i.hook_name for i in r.context_injections))
    if shown_action(r) == "modify":
        return ", ".join(dict.fromkeys(r.modified_by)) or "?"
    return r.decided_by or ""  # continue after an approval names the asking handler


class _AgentSetupError(Exception):
    pass


def with_ids(emit: Emit, agent_id: str, session_id: str) -> Emit:
    """`emit` with `agent_id` and `session_id` as default fields of every event's data
    (what `HookDispatcher.set_default_fields` does for an embedded one)."""

    async def with_ids(event: str, data: dict[str, Any], **options: Any) -> HookResult:
        data = {"agent_id": agent_id, "session_id": session_id, **data}
        return await emit(event, data, **options)

    return with_ids


@contextlib.contextmanager
def _single_errors() -> Iterator[None]:
    """Re-raise a task group's lone exception as itself (clear CLI errors, no group)."""
    try:
        yield
    except ExceptionGroup as group:
        if len(group.exceptions) == 1:
            exc = group.exceptions[0]
            if isinstance(exc, _AgentSetupError):
                raise click.ClickException(str(exc)) from None
            raise exc from None
        raise


_STYLE = {
    "deny": "bold red",
    "modify": "yellow",
    "inject_context": "cyan",
    "ask_user": "magenta",
    "continue": "green",
    "error": "bold red",
}
