"""hookbus as the hook layer of the Vercel AI SDK for Python (the ``ai`` package): the
fleet's workers decide every tool call, and ``ai``'s hooks are durable.

In ``ai`` (0.8) a run suspends with ``await ai.hook(label, payload=Model, metadata=...)``
(tools declared ``@ai.tool(require_approval=True)`` do it for you, on the label
``approve_<tool call id>`` with payload ``ai.tools.ToolApproval``); the suspension lives in
the run's in-memory ``ai.HookRegistry``, so only code in that process can resolve it and it
dies with the process. `HookbusHooks` moves it into hookbus's `Suspensions` (a record per
label in the ``hookbus_suspensions`` JetStream KV bucket):

.. code-block:: python

    hooks = await HookbusHooks.open(nc, agent_id="payments")
    async with hooks.run(agent, model, messages, run_id="run-42") as stream:
        async for event in stream:        # ai's events, HookEvent included
            ...

    # from any other process, on its own connection:
    other = await HookbusHooks.open(nc2, agent_id="payments")
    await other.resolve_hook("approve_call_1", {"granted": True})

**The workers decide every tool call.** ``ai``'s tool middleware (``wrap_tool``) emits each
tool call of the run through a `HookDispatcher`, as the pydantic-ai integration does (the
rules both share are in ``hookbus.integrations._emit``); the dispatcher folds the handlers'
results and judges each handler's failure by its failure policy:

=====================  ==============  =====================================================
when                   hookbus event   data (besides ``run_id``, ``session_id``)
=====================  ==============  =====================================================
before the tool        ``tool:pre``    ``tool_name``, ``tool_input``, ``tool_call_id``
after it returned      ``tool:post``   the same and ``tool_result``
after it raised        ``tool:error``  the same and ``error`` (``type``, ``msg``)
=====================  ==============  =====================================================

- ``deny`` on ``tool:pre`` (a handler's, or a failure its policy denies, or an ``ask_user``
  nothing answered): the tool does not run; its result, which the model reads, is the
  error ``"Denied by hook: <reason>"``. On ``tool:post``: the tool ran, the model reads
  ``"Tool result withheld by hook: <reason>"``.
- ``modify``: the final ``tool_input`` replaces the arguments, validated by the tool's own
  parameters (arguments that do not validate deny the call, the reason says why); a new
  ``tool_result`` on ``tool:post`` replaces the result.
- ``ask_user``: the dispatcher's durable hookbus approval (answered from any process,
  ``hookbus approvals answer``); the tool waits for it.
- ``inject_context``: ``ai`` 0.8 gives a middleware no way to add a message in the middle of
  a run (its model middleware is not called), so each injection of ``tool:pre`` and
  ``tool:post`` is appended to the text the model reads for that call's result (the tool
  result part's ``model_input``; its ``result``, what the application sees, is unchanged),
  framed ``<hook_injection handler="..." role="...">...</hook_injection>``: the role is
  named but not applied.
- an emit that raises (`NotConnectedError`, ...) ends the run: a tool whose ``tool:pre``
  could not be decided never runs.

The dispatcher is the one given (``dispatcher=``), else a ``HookDispatcher(nc,
agent_id=agent_id)`` on the store's connection, started at the first run (an approver that
only answers never starts one) and closed by `HookbusHooks.close`. ``session_id`` is the
one given, else the run id; the idempotency key of an emit is ``ai:<run id>:<event>:<tool
call id>``: a resumed run (same run id) replaying a call finds its ``ask_user`` approval and
its answer, another run never does. A tool declared ``require_approval=True`` asks its
approval (below) first; ``tool:pre`` is emitted once it is granted, just before the tool
would run. A call already run in this run (its results kept, below) is not emitted again.
Only tool calls are emitted (no ``session:*`` or ``prompt:*`` events).

With ``agent_id``, `HookbusHooks.open` scopes the store to that agent's records: it reads
only keys ``<agent>.>``, all an agent's NATS user may read on a secured server (where an
agent keeping its own hooks needs an *embedded* agent identity, ``hookbus auth init
--embedded-agent NAME``). ``scoped=False`` follows every agent's events instead.

**The seam.** ``ai.HookRegistry`` is not pluggable (``ai.hook``, ``ai.resolve_hook`` and
``ai.cancel_hook`` read its dictionaries directly), but every ``ai.hook(...)`` call goes
through the run's middleware chain (``ai.agents._middleware``, ``wrap_hook``, activated by
``Agent.run(..., _middleware=[...])``), and so does every tool execution (``wrap_tool``:
where the tool calls are emitted). `HookbusHooks` is such a middleware: it answers each
``ai.hook`` call from hookbus instead of the in-memory registry, so the built-in approval
gating and any ``ai.hook`` in your tools become durable with no change to them. Those two
names are private in ``ai``; `HookbusHooks.run` is the one place that uses them (importing
this module raises `ImportError` if an ``ai`` release drops them).

**Same names, same events.** `hook`, `resolve_hook`, `cancel_hook` keep ``ai``'s names and
arguments (a label, or an ``ai`` ``HookPart`` whose ``hook_id`` is the label; ``payload``
is a pydantic model class); `abort_pending_hook` and `defer_hook` complete them. The run's
stream carries ``ai``'s own ``HookEvent``/``HookPart`` (``ai.events.HookEvent``):
``pending`` when a hook suspends (none when a resolution was waiting: it returns at once, as
``ai``'s pre-registered resolutions do), ``resolved`` with the resolution, ``cancelled``.
`HookbusHooks.events` yields the same type for every hook of the agent, from any process.

How each ``ai`` behaviour maps onto hookbus:

- resolve (any process): the record is compare-and-set to resolved; the value is checked
  against the payload's JSON Schema first (`ResolutionRejectedError`, record unchanged);
  one of several resolvers wins (`AlreadySettledError` for the others).
- pre-registered resolution (``resolve_hook`` before the hook exists, any process): stored
  in the record and consumed exactly once by the next hook of that label, which returns
  at once. A resolution pre-registered the ``ai`` way (``ai.resolve_hook`` into the run's
  registry before iterating) is written to the record the same way.
- cancel (any process): the waiting ``ai.hook`` raises ``asyncio.CancelledError(reason)``,
  as ``ai.cancel_hook`` makes it do; a ``cancelled`` event is published.
- abort (`abort_pending_hook`, `abort_all`, ``ai.defer_hook``): this process stops waiting,
  the record stays pending, and ``ai.hook`` raises ``ai.HookDeferredException`` — approval
  gating turns it into a deferred tool result and the run ends blocked (``RunBlocked``).
  Resume anywhere later: run the agent again on the saved messages (``stream.messages``)
  with `HookbusHooks.run`; the deferred tool call is replayed and its ``ai.hook`` gets the
  resolution stored meanwhile, or waits again.
- a re-asked turn (a model gives the same tool call a new tool call id, as real models do
  when a run resumes without its assistant turn): within a run, a tool approval whose
  label has no record is decided by an earlier approval of the same run for the same tool
  with the same arguments (the approval's metadata, ``{"tool", "kwargs"}``) under another
  tool call id, if that one is still undecided or its answer unused and no live process
  waits on it: the hook waits on that label (the ``HookEvent``'s ``hook_id``), so an
  answer given to it meanwhile decides. Another run, other arguments, or an approval
  already used are asked anew.
- a retried resume (the resume's process died before it saved the messages, so the run is
  resumed again from the same ones): a tool approval's resolution is used once per tool
  call and run. When a run (`HookbusHooks.run`) uses one, its consumed record is kept past
  the run's end (until the bucket's TTL) with ``"used_in": <run id>`` and, once the tool
  has run, its results (``"ran"``) in the ``"_ai"`` metadata; the same tool call replayed
  in that run gets the same resolution at once (no ``pending``, no question) and the kept
  results instead of running the tool again. A granted tool whose results were not
  recorded (the process died while it ran) runs again.
- timeout (`HookbusHooks` ``timeout_s``): a hook raises `SuspensionTimeoutError`, except a
  tool approval: it is closed (cancelled, reason ``"timed out after <s>s; default deny
  applied"``, kept past the run's end) and ends with ``approval_default`` (deny unless
  set): the tool does not run and the model reads ``"Rejected: timed out after <s>s;
  default deny"``; the run goes on. A later answer decides nothing (`approve` raises
  `AlreadySettledError`), and the same call replayed in the run gets the same outcome. An
  answer that won the race against the close decides instead.
- kill (the process dies while a hook waits): at each ``pending`` event persist
  `HookbusHooks.resumable_messages` (``stream.messages`` lacks the assistant turn with
  the tool call until the turn's tools finish); resume from those messages as above.
- ``ai.resolve_hook`` / ``ai.cancel_hook`` / ``ai.defer_hook`` on the run's registry from
  the consumer's ``async with`` block still work: a live hook is also listed in the
  ``ai`` registry, and what they do is carried to the record.

**Tool approvals are an approver's.** A hook whose payload is ``ai``'s ``ToolApproval``
(what ``@ai.tool(require_approval=True)`` asks, on ``approve_<tool call id>``), or whose
label starts with ``approve_``, is decided only by an approver's answer proof: the key
``<agent>.<label>.<approver>`` in the suspensions bucket, which only that approver's NATS
user may write (`HookbusHooks.approve` writes it, as an `ApprovalAnswer` with the choice
``"Allow"`` or ``"Deny"``). The waiting agent resolves the record from the first valid proof
in stream order (also one written before the hook, or while nobody waited), as
``{"granted": ..., "reason": "<approver> chose 'Allow'", "choice", "answered_by",
"answered_at"}``; the resolution's ``answered_by`` is the approver, shown in the resolved
``HookEvent``. A resolution without a matching proof (``resolve_hook`` or ``ai.resolve_hook``
by anyone, the agent itself included) is refused: the hook returns ``ToolApproval(granted=
False, reason="refused: ...")`` and the tool does not run. Other hooks stay resolvable by
anyone with write access to the agent's records, as in ``ai``.

The record's metadata is ``ai``'s ``metadata`` plus one key, ``"_ai"``: ``{"hook_type":
payload class name, "tool_call_id": ...}``, with ``"used_in"`` and ``"ran"`` once a tool
approval is used (removed again in the events given here).
Differences from ``ai``: a second live hook on one label raises `DuplicateSuspensionError`
(``ai`` would replace it silently); ``cancel_hook`` of an unknown label raises
`SuspensionNotFoundError` (``ai``: ``ValueError``); an exception passed to ``resolve_hook``
(``defer_hook``) reaches only a hook waiting, or next waiting, in this process; ``ai``'s
hook telemetry span is replaced by hookbus's ``await suspension`` span. With tracing on, a
run with no span current gets an ``invoke_agent <agent>`` span (its waits are its children),
and a suspension keeps the context of the run that created it (``"_ai"`` metadata,
``"trace"``): a wait resumed later, in any run or process, links to that run's span.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal, TypeVar

import ai
import msgspec
import pydantic
from ai.agents import _middleware as ai_middleware
from ai.agents import agent as ai_agent
from ai.agents import hooks as ai_hooks
from ai.agents import runtime as ai_runtime
from ai.types import events as ai_events
from ai.types import messages as ai_messages
from ai.types import tools as ai_tools
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError

from hookbus._core.kv import kv_retry
from hookbus._core.tasks import stop_task
from hookbus.dispatcher import AnswerNotAppliedError, HookDispatcher, Suspensions
from hookbus.dispatcher._proofs import first_proof, write_proof
from hookbus.dispatcher._run_scopes import current_run_scope
from hookbus.dispatcher._suspension_events import payload_schema
from hookbus.dispatcher._telemetry import created_by, creating_traceparent, run_span
from hookbus.dispatcher._waiter import Leases
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    TOOL_ERROR,
    TOOL_POST,
    TOOL_PRE,
    AlreadySettledError,
    ApprovalAnswer,
    DuplicateSuspensionError,
    HookbusError,
    HookEvent,
    HookPart,
    HookResult,
    ResolutionRejectedError,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionTimeoutError,
    approval_answer_key,
    decode,
    run_claim_key,
)
from hookbus.schemas import telemetry as tn

from ._emit import (
    Injection,
    as_deny,
    check_timeout,
    denied,
    denied_text,
    emit_decision,
    final_data,
    framed_injections,
    injections,
    jsonable,
    withheld_text,
)

__all__ = [
    "AI_METADATA_KEY",
    "APPROVAL_LABEL_PREFIX",
    "EVENTS",
    "HookbusHooks",
    "RunInProgressError",
    "abort_pending_hook",
    "ai_hook_part",
    "cancel_hook",
    "current_hooks",
    "defer_hook",
    "hook",
    "is_tool_approval",
    "resolve_hook",
    "use_hooks",
]

if not hasattr(ai_middleware, "_Middleware") or "_middleware" not in (
    inspect.signature(ai.Agent.run).parameters
):  # pragma: no cover - depends on the installed ai release
    raise ImportError(
        "hookbus.integrations.ai needs an ai release whose Agent.run takes _middleware "
        "and whose ai.agents._middleware has _Middleware (ai 0.8)"
    )

M = TypeVar("M", bound=pydantic.BaseModel)

log = logging.getLogger("hookbus.integrations.ai")

APPROVAL_LABEL_PREFIX = "approve_"
"""``ai``'s tool approval labels start with this (``approve_<tool call id>``)."""

_PROOF_POLL_S = 2.0

EVENTS = (TOOL_PRE, TOOL_POST, TOOL_ERROR)
"""The events `HookbusHooks` emits for each tool call, in order (``tool:post`` after a
tool that returned, ``tool:error`` after one that raised)."""

_TIMED_OUT = "timed out after "
"""How the reason of a tool approval closed by its timeout starts."""

_SETTLE_S = 5.0
"""Seconds a timed-out tool approval waits for the answer that won the race against its
close (it returns at once: the answer is stored)."""

AI_METADATA_KEY = "_ai"
AI_TRACE_KEY = "trace"
"""In the ``"_ai"`` metadata, with tracing on: the W3C ``traceparent`` of the run (or emit)
that created the suspension; the ``await suspension`` span of a later wait on it (a resumed
run, in any process) links to it."""


def _creator(found: Any) -> str | None:
    extra = None if found is None else found[0].metadata.get(AI_METADATA_KEY)
    value = extra.get(AI_TRACE_KEY) if isinstance(extra, dict) else None
    return value if isinstance(value, str) and value else None


"""The key of a record's metadata that holds what ``ai``'s ``HookPart`` needs besides the
caller's metadata: ``{"hook_type": str, "tool_call_id": str | None}``; a used tool approval
adds ``"used_in"`` (the run id) and ``"ran"`` (the tool's results, ``ToolResultPart`` JSON)."""

_ABORT_POLL_S = 0.02
_ABORT_DEADLINE_S = 15.0

HookTarget = str | ai_messages.HookPart[Any] | HookPart
"""A hook as the functions here take it: its label, ``ai``'s ``HookPart`` (whose
``hook_id`` is the label) or hookbus's `HookPart` (its ``label``)."""


class RunInProgressError(DuplicateSuspensionError):
    """Another live process runs this run id: it holds the run's claim (from entering
    `HookbusHooks.run` until leaving it, rewritten by its waiter lease's heartbeat), or
    waits on one of the run's hooks with its waiter lease alive. Its run is left alone; a
    process that died gives the run up when its claim and lease lapse (one lease after its
    last heartbeat, about 15 s)."""


def _label(target: HookTarget) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, ai_messages.HookPart):
        return target.hook_id
    if isinstance(target, HookPart):
        return target.label
    raise TypeError(f"expected a label or a HookPart, got {type(target).__name__}")


def _json(value: Any) -> Any:
    """A resolution as JSON data (what the record stores)."""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(mode="json")
    return value


class _Wait:
    """One hook this process waits on. ``abort`` gets the exception to raise instead of
    the resolution (None: ``ai.HookDeferredException`` for the pending part)."""

    __slots__ = ("abort",)

    def __init__(self) -> None:
        self.abort: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )


def is_tool_approval(label: str, payload: type[Any] | None) -> bool:
    """Whether the hook `label` with `payload` is a tool approval, decided only by an
    approver's proof: its payload is ``ai``'s ``ToolApproval`` (or a subclass), or its label
    starts with ``approve_``."""
    if isinstance(payload, type) and issubclass(payload, ai_tools.ToolApproval):
        return True
    return label.startswith(APPROVAL_LABEL_PREFIX)


def _resolution(answer: ApprovalAnswer) -> dict[str, Any]:
    """The record's resolution made from an approver's `answer`: a ``ToolApproval``'s
    fields, plus who answered."""
    return {
        "granted": answer.choice == "Allow",
        "reason": f"{answer.answered_by} chose {answer.choice!r}",
        "choice": answer.choice,
        "answered_by": answer.answered_by,
        "answered_at": answer.answered_at,
    }


def _valid_proof(key: str, value: bytes, label: str, agent_id: str | None) -> ApprovalAnswer | None:
    """The proof under `key` if it answers `label`: it decodes, names the approver its key
    names, and chooses "Allow" or "Deny"."""
    try:
        answer = decode(value, ApprovalAnswer)
        if not answer.answered_by or answer.choice not in APPROVAL_DEFAULT_OPTIONS:
            return None
        if approval_answer_key(label, agent_id, answer.answered_by) != key:
            return None
    except HookbusError:
        return None
    return answer


class HookbusHooks(ai_middleware._Middleware):
    """``ai``'s hooks kept in hookbus: an ``ai`` middleware (its ``wrap_hook``) over a
    `Suspensions` store, plus ``ai``'s hook functions with the same names.

    Every tool call of a run this middleware is part of is emitted through a
    `HookDispatcher` (``tool:pre`` before the tool, ``tool:post`` or ``tool:error`` after
    it; see the module docstring), so the fleet's workers decide it.

    Args:
        suspensions: the store (``await Suspensions.open(nc, agent_id=...)``, or
            ``dispatcher.suspensions`` of a started `HookDispatcher`). Its ``agent_id``
            names whose hooks these are (records ``<agent>.<label>``).
        timeout_s: seconds a hook waits before `SuspensionTimeoutError`; None (``ai``'s
            behaviour) waits until resolved, cancelled or aborted. A tool approval that
            times out is not an error: it is closed (cancelled, with the reason) and ends
            with `approval_default`.
        dispatcher: the `HookDispatcher` that decides the tool calls (it stays the
            caller's: neither started nor closed here). None: one is made on the store's
            connection, for its agent, and started at the first run (`run`, or the first
            tool call); `close` closes it.
        approval_default: what a tool approval that timed out ends with: ``"deny"`` (the
            default: the tool does not run, its result says so) or ``"allow"``.
        session_id: the ``session_id`` of every event; None: the run id.
        emit_timeout_s: overall deadline of each emit in seconds (its handlers, and an
            ``ask_user`` approval's wait); None: only each handler's own timeout applies.

    Raises:
        ValueError: `approval_default` is neither "deny" nor "allow", or `emit_timeout_s`
            is not a finite number of seconds above 0.
    """

    def __init__(
        self,
        suspensions: Suspensions,
        *,
        timeout_s: float | None = None,
        dispatcher: HookDispatcher | None = None,
        approval_default: Literal["deny", "allow"] = "deny",
        session_id: str | None = None,
        emit_timeout_s: float | None = None,
    ) -> None:
        if approval_default not in ("deny", "allow"):
            raise ValueError(
                f"approval_default must be 'deny' or 'allow', got {approval_default!r}"
            )
        check_timeout("emit_timeout_s", emit_timeout_s)
        self.suspensions = suspensions
        self.timeout_s = timeout_s
        self.approval_default = approval_default
        self.session_id = session_id
        self.emit_timeout_s = emit_timeout_s
        self._dispatcher = dispatcher
        self._own_dispatcher = False
        self._dispatcher_lock = asyncio.Lock()
        self._owned = False
        self._waits: dict[str, _Wait] = {}
        self._stashed: dict[str, BaseException] = {}
        self._turns: dict[int, ai_messages.Message] = {}  # run context id -> model's turn
        self._granted: dict[str, str] = {}  # tool call id -> its approval's label

    @classmethod
    async def open(
        cls,
        nc: NATS,
        *,
        agent_id: str | None = None,
        scoped: bool | None = None,
        timeout_s: float | None = None,
        ttl_s: float = 7 * 24 * 3600,
        replicas: int = 1,
        dispatcher: HookDispatcher | None = None,
        approval_default: Literal["deny", "allow"] = "deny",
        session_id: str | None = None,
        emit_timeout_s: float | None = None,
    ) -> HookbusHooks:
        """Open (or create) the suspensions bucket on `nc` for `agent_id`'s hooks; `close`
        releases it. `ttl_s` (seconds) and `replicas`: see `Suspensions.open`;
        `dispatcher`, `approval_default`, `session_id`, `emit_timeout_s`: see
        `HookbusHooks`. Without `dispatcher`, a ``HookDispatcher(nc, agent_id=agent_id)``
        is started at the first run (an approver that only answers never starts one).

        `scoped` (default: True when `agent_id` is given) watches, lists and follows
        (`events`) `agent_id`'s records only, which is all an agent's NATS user may read
        on a secured server (``hookbus auth init``); there an agent that keeps its own
        hooks needs an *embedded* agent identity (``hookbus auth init --embedded-agent
        NAME``). Pass ``scoped=False`` on a connection that may read every agent's records
        to follow every agent's events.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        if scoped is None:
            scoped = agent_id is not None
        store = await Suspensions.open(
            nc, agent_id=agent_id, scoped=scoped, ttl_s=ttl_s, replicas=replicas
        )
        hooks = cls(
            store, timeout_s=timeout_s, dispatcher=dispatcher, approval_default=approval_default,
            session_id=session_id, emit_timeout_s=emit_timeout_s,
        )  # fmt: skip
        hooks._owned = True
        return hooks

    async def close(self) -> None:
        """Stop the store's watch and lease if `open` made it (waits in progress keep
        their records), and the dispatcher made here. Idempotent."""
        if self._own_dispatcher and self._dispatcher is not None:
            await self._dispatcher.close()
        if self._owned:
            await self.suspensions.close()

    @property
    def dispatcher(self) -> HookDispatcher | None:
        """The `HookDispatcher` that decides the tool calls (None until the first run
        starts the one made here)."""
        return self._dispatcher

    async def governor(self) -> HookDispatcher:
        """The started `HookDispatcher` that decides the tool calls: the one given, else
        one made on the store's connection for its agent and started now (once).

        Raises:
            HookbusError: it could not start (`NotPermittedError`: this NATS user may not
                follow the handler registry; `HookbusTimeoutError`: JetStream stayed
                unavailable). No tool runs undecided: the run stops.
        """
        async with self._dispatcher_lock:
            if self._dispatcher is None:
                made = HookDispatcher(self.suspensions._nc, agent_id=self.suspensions.agent_id)
                await made.start()
                self._dispatcher, self._own_dispatcher = made, True
        return self._dispatcher

    async def __aenter__(self) -> HookbusHooks:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- running an agent ---------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def run(
        self,
        agent: ai.Agent,
        model: ai.Model,
        messages: Sequence[ai_messages.Message],
        *,
        run_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """``agent.run(model, messages, **kwargs)`` with its hooks in hookbus; yields
        ``ai``'s ``AgentStream``.

        `run_id` scopes the run's labels (`Suspensions.run`): on exit its finished records
        and unused pre-registered resolutions are removed, except the tool approvals it
        used (kept with the tool's results, so a retried resume neither asks nor runs the
        tool again), and hooks it aborted stay for a later run. Resume with the run's saved
        messages (`resumable_messages` at a ``pending`` event, else ``stream.messages``)
        and the same `run_id`, in any process. Within the block, the module functions (`hook`,
        `resolve_hook`, ...) use these hooks.

        A run id is one live run: entering the block claims it (the key
        ``r.<agent>.<run>`` in the leases bucket, created atomically and rewritten by this
        process's lease heartbeat until the block is left, normally, by an exception or by
        cancellation). While another process holds that claim (anywhere in its block:
        between two hooks, while its model answers or a tool runs, or waiting on a hook),
        starting the run here raises `RunInProgressError` before the agent runs, and that
        process's run goes on unaffected. The same run id entered twice in this process
        (the same waiter id) is not refused. A process that was killed holds the run until
        its claim and lease lapse (one lease, about 15 s); then resume. Without `run_id`
        the run gets a fresh random id, which no other process can know: nothing is claimed.

        Before the agent runs, the dispatcher that decides its tool calls is started
        (`governor`).

        Raises:
            RunInProgressError: another live process runs `run_id`.
            BadRequestError: `run_id` is empty or too long to be a key.
            HookbusTimeoutError: the leases bucket stayed unavailable for one lease.
            HookbusError: the dispatcher could not start (see `governor`).
        """
        middleware = [self, *(kwargs.pop("_middleware", None) or [])]
        await self.governor()  # a run whose tool calls nothing can decide does not start
        claim = None
        if run_id is not None:
            claim = await self._claim_run(run_id)
        try:
            if run_id is not None:  # a hook of the run waited on elsewhere (kept: harmless)
                await self._refuse_a_live_run(run_id)
            async with self.suspensions.run(run_id) as scope:
                # the run's span: its run id and session, the same on a run resuming it
                session = self.session_id or scope.run_id
                with (
                    use_hooks(self),
                    run_span(self.suspensions.agent_id, scope.run_id, session),
                ):
                    try:
                        async with agent.run(
                            model, list(messages), _middleware=middleware, **kwargs
                        ) as stream:
                            yield stream
                    except BaseExceptionGroup as group:  # ai's task group: say it plainly
                        refused = group.subgroup(RunInProgressError)
                        if refused is None:
                            raise
                        while isinstance(refused, BaseExceptionGroup):
                            refused = refused.exceptions[0]
                        raise refused from None
        finally:
            if claim is not None:
                await claim[0].release(claim[1])  # runs to its end even when cancelled

    async def _claim_run(self, run_id: str) -> tuple[Leases, str]:
        """Claim `run_id` for this process (see `run`): its leases and claim key.

        Raises:
            RunInProgressError: another live process holds the claim.
        """
        key = run_claim_key(self.suspensions.agent_id, run_id)
        leases = await self.suspensions._lease()
        owner = await leases.claim(key)
        if owner is not None:
            raise RunInProgressError(
                f"run {run_id!r} is live in another process (waiter {owner} holds its claim):"
                f" not started here. If that process died, start it again once its claim"
                f" lapses (about {leases.lease_s:g} s)"
            )
        return leases, key

    async def _live_owner(self, record: Any, run_id: str) -> str | None:
        """The waiter id of another live process that waits on `record` for the run
        `run_id`, else None."""
        store = self.suspensions
        if record.status != "pending" or not record.attached or record.run_id != run_id:
            return None
        if record.agent_id != store.agent_id:
            return None
        if not record.owner or record.owner == store.waiter_id:
            return None
        leases = await store._lease()
        return record.owner if await leases.alive(record.owner) else None

    async def _refuse_a_live_run(self, run_id: str) -> None:
        """Raise `RunInProgressError` if another live process waits on a hook of `run_id`."""
        for record in await self.suspensions.list(status="pending"):
            owner = await self._live_owner(record, run_id)
            if owner is not None:
                raise _run_in_progress(run_id, record.label, owner)

    async def wrap_agent_run(self, call: Any, next: Any) -> AsyncIterator[Any]:
        """``ai``'s middleware entry for the run: notes the assistant turn the model is
        giving (each model event carries it), for `resumable_messages`."""
        key = id(call)
        try:
            async with contextlib.aclosing(next(call)) as events:
                async for event in events:
                    message = getattr(event, "message", None)
                    if isinstance(event, ai_events.ModelEvent) and isinstance(
                        message, ai_messages.Message
                    ):
                        self._turns[key] = message
                    yield event
        finally:
            self._turns.pop(key, None)

    async def _earlier_approval(
        self, label: str, metadata: dict[str, Any], tool_call_id: str
    ) -> str:
        """The label that decides the tool approval `label`: its own if it has a record,
        else that of an earlier approval of this run for the same tool with the same
        arguments (another tool call id: the model re-asked the turn) that is still
        undecided or whose answer is still unused and that nobody live waits on."""
        run = current_run_scope.get()
        if run is None or not metadata.get("tool"):
            return label
        store = self.suspensions
        if await store.get(label) is not None:
            return label
        for record in await store.list():
            extra = record.metadata.get(AI_METADATA_KEY)
            if record.label == label or record.label in self._waits:
                continue
            if record.run_id != run.run_id or record.agent_id != store.agent_id:
                continue
            if not isinstance(extra, dict) or extra.get("tool_call_id") in (None, tool_call_id):
                continue
            if {k: v for k, v in record.metadata.items() if k != AI_METADATA_KEY} != metadata:
                continue
            if record.consumed or record.status == "cancelled":
                continue
            if record.status == "pending" and record.attached and record.owner:
                if record.owner == store.waiter_id or await self._live_owner(record, run.run_id):
                    continue
            log.info(
                "tool approval %r: the same call as %r earlier in run %s (the model re-asked"
                " it with a new tool call id): decided by that one", label, record.label,
                run.run_id,
            )  # fmt: skip
            return record.label
        return label

    def resumable_messages(self, stream: Any) -> list[ai_messages.Message]:
        """What to persist so that a killed process's run can resume: ``stream.messages``
        plus the assistant turn whose tool calls are running (``ai`` adds that turn to
        ``stream.messages`` only once all its tool calls have finished, so at a ``pending``
        ``HookEvent`` ``stream.messages`` lacks the tool call being asked about).

        Save it at each ``pending`` ``HookEvent`` of `stream` (a run of `run`), before
        the process may die; once the run has ended, ``stream.messages`` is complete and
        this returns it. Resume with `run` on the saved messages and the same run id: the
        assistant turn is replayed (``ai`` marks it ``replay``), so its tool calls run
        again, each asking its hook again, which returns the answer stored meanwhile.
        Results of the turn's other tool calls that finished before the save are not in
        it: those tools run again on resume.
        """
        messages = list(stream.messages)
        turn = self._turns.get(id(stream.context))
        if turn is None or not turn.tool_calls:
            return messages
        if any(m is turn or m.id == turn.id for m in messages):
            return messages
        return [*messages, turn]

    async def wrap_hook(self, call: Any, next: Any) -> pydantic.BaseModel:
        """``ai``'s middleware entry: every ``ai.hook(...)`` of a run this middleware is
        part of is answered by `hook` (``next``, ``ai``'s in-memory registry, is not
        called)."""
        registry = call.registry or ai_hooks._hook_registry.get(None)
        label = call.label
        approval = bool(call.tool_call_id) and is_tool_approval(label, call.payload)
        if approval:
            used = await self._used_approval(label)
            if used is not None:  # this tool call was decided (and maybe ran): not asked again
                value = call.payload.model_validate(used.resolution)
                self._note_decided(call.tool_call_id, label, value)
                return value
            expired = await self._timed_out_approval(label, call.payload)
            if expired is not None:  # it timed out: its default, never a question again
                self._note_decided(call.tool_call_id, label, expired)
                return expired
            label = await self._earlier_approval(label, call.metadata, call.tool_call_id)
        value = await self._hook(
            label,
            payload=call.payload,
            metadata=call.metadata,
            tool_call_id=call.tool_call_id,
            registry=registry,
            timeout_s=self.timeout_s,
        )
        if approval:
            await self._mark_used(label, ran=None)
            self._note_decided(call.tool_call_id, label, value)
        return value

    async def _timed_out_approval(self, label: str, payload: type[M]) -> M | None:
        """The outcome of the tool approval `label` if it was closed by its timeout (kept,
        cancelled, with ``"timed out after ..."`` as its reason), else None."""
        if not issubclass(payload, ai_tools.ToolApproval):
            return None
        found = await self.suspensions.get(label)
        record = None if found is None else found[0]
        if record is None or record.status != "cancelled":
            return None
        why = (record.reason or "").removesuffix(" applied")
        if not why.startswith(_TIMED_OUT):
            return None
        return payload.model_validate({"granted": why.endswith("default allow"), "reason": why})

    def _note_decided(self, tool_call_id: str, label: str, value: Any) -> None:
        if getattr(value, "granted", False):
            self._granted[tool_call_id] = label

    async def _used_approval(self, label: str) -> Any:
        """The record of the tool approval `label` if this run already used its resolution
        (kept after the run's end with ``"used_in": <run id>`` in its ``"_ai"`` metadata),
        else None."""
        run = current_run_scope.get()
        if run is None:
            return None
        found = await self.suspensions.get(label)
        if found is None:
            return None
        record = found[0]
        extra = record.metadata.get(AI_METADATA_KEY)
        if record.status != "resolved" or not record.consumed:
            return None
        if not isinstance(extra, dict) or extra.get("used_in") != run.run_id:
            return None
        run.labels.discard(label)  # kept by the run's end, for a later retry
        return record

    async def _mark_used(self, label: str, *, ran: list[Any] | None) -> None:
        """Keep the consumed record of the tool approval `label` past the run's end, with
        ``"used_in": <run id>`` (and `ran`, the tool's results) in its ``"_ai"`` metadata: a retried
        resume of the same run gets that resolution (and result) again, never a new
        question or a second run of the tool. Best effort (logged)."""
        store = self.suspensions
        run = current_run_scope.get()
        try:
            await store._deliveries.flush(timeout_s=store.records.deadline_s)
            for _ in range(5):
                entry = await store.records.read(label)
                record = None if entry is None else entry.record
                if entry is None or record is None or record.status != "resolved":
                    return
                extra = record.metadata.get(AI_METADATA_KEY)
                extra = dict(extra if isinstance(extra, dict) else {})
                if run is not None:
                    extra["used_in"] = run.run_id
                if ran is not None:
                    extra["ran"] = ran
                marked = msgspec.structs.replace(
                    record, metadata={**record.metadata, AI_METADATA_KEY: extra}
                )
                if await store.records.swap(marked, last=entry.revision) is not None:
                    if run is not None:
                        run.labels.discard(label)
                    return
        except (HookbusError, NatsError) as exc:
            log.warning("tool approval %r: its use not recorded (%r)", label, exc)

    async def wrap_tool(self, call: Any, next: Any) -> Any:
        """``ai``'s middleware entry for a tool call: the workers decide it.

        ``tool:pre`` is emitted before the tool runs: a deny (or an ``ask_user`` nobody
        answered, or an emit that failed closed) returns the tool result ``"Denied by
        hook: <reason>"`` (an error result) and the tool does not run; a modify replaces
        the arguments (validated by the tool's own parameters: arguments that do not
        validate deny the call). After it, ``tool:post`` (deny: the model reads ``"Tool
        result withheld by hook: <reason>"``; modify: the new ``tool_result``) or, for a
        tool that raised, ``tool:error`` (observed). Injections of both are appended to
        the text the model reads for this call's result (``model_input``).

        A call whose approval was granted runs once per run: its results are kept in the
        approval's record, and a replay of the same call (a retried resume) gets them
        instead of running the tool again (nothing is emitted then: it was decided when
        it ran).

        Raises:
            HookbusError: an emit raised (`NotConnectedError`, ...): the tool does not run
                (from ``tool:pre``), or ran and its result is not returned (``tool:post``).
        """
        label = self._granted.pop(call.tool_call_id, None)
        if label is not None:
            found = await self.suspensions.get(label)
            extra = None if found is None else found[0].metadata.get(AI_METADATA_KEY)
            ran = extra.get("ran") if isinstance(extra, dict) else None
            if isinstance(ran, list) and ran:
                parts = [ai_messages.ToolResultPart.model_validate(part) for part in ran]
                return ai_agent.tool_result(*parts)
        dispatcher = await self.governor()
        run_id = self._run_id()
        sent = jsonable(call.kwargs)
        fields = {
            "run_id": run_id,
            "session_id": self.session_id or run_id,
            "tool_name": call.tool_name,
            "tool_input": sent,
            "tool_call_id": call.tool_call_id,
        }
        pre = await self._emit(dispatcher, TOOL_PRE, fields, run_id, call.tool_call_id)
        if denied(pre):
            text = denied_text(_as_deny(pre, TOOL_PRE))
            return ai_agent.tool_result(
                tool_call_id=call.tool_call_id, tool_name=call.tool_name, result=text,
                is_error=True,
            )  # fmt: skip
        new_input = final_data(pre).get("tool_input", sent)
        if new_input != sent:
            problem = _invalid_arguments(call, new_input)
            if problem is not None:
                by = pre.decided_by or (pre.modified_by[-1] if pre.modified_by else "a hook")
                return ai_agent.tool_result(
                    tool_call_id=call.tool_call_id, tool_name=call.tool_name, is_error=True,
                    result=f"Denied by hook: {by} replaced the arguments with {problem}",
                )  # fmt: skip
            call = dataclasses.replace(call, kwargs=new_input)
            fields = {**fields, "tool_input": new_input}
        added = injections(pre)
        result = await next(call)
        final = result
        try:
            final, more = await self._after(dispatcher, fields, run_id, call, result)
            added += more
            if added:
                final = _with_injections(final, added)
        finally:
            if label is not None:
                await self._mark_used(label, ran=[p.model_dump(mode="json") for p in final.results])
        return final

    async def _after(
        self,
        dispatcher: HookDispatcher,
        fields: dict[str, Any],
        run_id: str,
        call: Any,
        result: Any,
    ) -> tuple[Any, list[Injection]]:
        """``tool:post`` (or ``tool:error``) of a tool that ran: the result the model gets
        and the injections to append to it."""
        parts = list(result.results)
        failed = result.exception is not None or any(p.is_error for p in parts)
        if failed:
            error = result.exception
            data = {
                **fields,
                "error": {
                    "type": type(error).__name__ if error is not None else "ToolError",
                    "msg": str(error)
                    if error is not None
                    else str(parts[0].result if parts else ""),
                },
            }
            decision = await self._emit(dispatcher, TOOL_ERROR, data, run_id, call.tool_call_id)
            return result, ([] if decision.action == "deny" else injections(decision))
        sent = jsonable(parts[0].result) if len(parts) == 1 else [jsonable(p.result) for p in parts]
        data = {**fields, "tool_result": sent}
        decision = await self._emit(dispatcher, TOOL_POST, data, run_id, call.tool_call_id)
        if denied(decision):
            text = withheld_text(_as_deny(decision, TOOL_POST))
            return ai_agent.tool_result(
                tool_call_id=call.tool_call_id, tool_name=call.tool_name, result=text
            ), []
        new = final_data(decision).get("tool_result", sent)
        if new != sent:
            part = ai_messages.ToolResultPart(
                tool_call_id=call.tool_call_id, tool_name=call.tool_name, result=new,
                result_kind=ai_messages.ToolResultPart.kind_for(new),
            )  # fmt: skip
            result = ai_agent.tool_result(part)
        return result, injections(decision)

    async def _emit(
        self,
        dispatcher: HookDispatcher,
        event: str,
        data: dict[str, Any],
        run_id: str,
        tool_call_id: str,
    ) -> HookResult:
        """Emit `event` for the tool call `tool_call_id` of the run `run_id`; its
        idempotency key is ``ai:<run id>:<event>:<tool call id>``: the same call replayed
        in the same run (a resume) finds its approval, another run never does."""
        key = f"ai:{run_id}:{event}:{tool_call_id}"
        return await emit_decision(
            dispatcher.emit, event, data, key=key, timeout_s=self.emit_timeout_s
        )

    @staticmethod
    def _run_id() -> str:
        """The current run's id (`run`'s scope); a run not entered through `run` gets a
        fresh one per call (its emits are never retries of another's)."""
        run = current_run_scope.get()
        return run.run_id if run is not None else uuid.uuid4().hex

    # -- ai's hook functions ------------------------------------------------------------------
    async def hook(
        self,
        hook: HookTarget,
        *,
        payload: type[M],
        metadata: dict[str, Any] | None = None,
        tool_call_id: str | None = None,
        timeout_s: float | None = None,
    ) -> M:
        """Suspend until `hook` (a label) is resolved; return the resolution validated as
        `payload` (``ai.hook``).

        Inside an ``ai`` run it emits ``ai``'s ``HookEvent``s on the run's stream.
        `metadata` must be JSON data; `timeout_s` (seconds) defaults to the instance's.

        Raises:
            asyncio.CancelledError: the hook was cancelled (args: the reason), as ``ai``.
            ai.HookDeferredException: the wait was aborted (`abort_pending_hook`,
                `abort_all`, ``defer_hook``); the record stays pending for a later run.
            DuplicateSuspensionError: a live hook of this label waits elsewhere.
            ResolutionRejectedError: the stored resolution does not fit `payload`.
            SuspensionTimeoutError: no resolution within `timeout_s`.
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        return await self._hook(
            _label(hook),
            payload=payload,
            metadata=metadata,
            tool_call_id=tool_call_id,
            registry=ai_hooks._hook_registry.get(None),
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
        )

    async def resolve_hook(
        self,
        hook: HookTarget,
        data: pydantic.BaseModel | dict[str, Any] | BaseException,
        *,
        payload: type[pydantic.BaseModel] | None = None,
        replace: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Resolve `hook` with `data` from any process, or pre-register it for the next
        hook of that label (``ai.resolve_hook``; here a coroutine), its store calls ended
        by `timeout_s` seconds (None: the store's deadline).

        `data` is a pydantic model or a dict (validated as `payload` first when given), or
        an exception: that one is raised by the hook waiting (or next waiting) on the label
        in *this* process, and the record stays pending (``ai.defer_hook`` passes
        ``ai.HookDeferredException``). `replace` replaces a resolution not consumed yet
        (see `Suspensions.resolve_hook`).

        Raises:
            pydantic.ValidationError: `data` does not validate as `payload`.
            ResolutionRejectedError: it does not fit the waiting hook's payload schema.
            AlreadySettledError: already resolved (without `replace`), consumed or cancelled.
            TypeError: `data` is none of the above.
            HookbusTimeoutError: JetStream stayed unavailable (until `timeout_s`).
        """
        label = _label(hook)
        if isinstance(data, BaseException):
            wait = self._waits.get(label)
            if wait is not None and not wait.abort.done():
                wait.abort.set_result(data)
            else:
                self._stashed[label] = data
            return
        if isinstance(data, pydantic.BaseModel):
            value = data.model_dump(mode="json")
        elif isinstance(data, dict):
            value = payload(**data).model_dump(mode="json") if payload is not None else data
        else:
            raise TypeError(f"expected a dict or a pydantic model, got {type(data).__name__}")
        await self.suspensions.resolve_hook(label, value, replace=replace, timeout_s=timeout_s)

    def defer_hook(self, hook_part: ai_messages.HookPart[Any]) -> None:
        """Abort this process's wait on `hook_part` with ``ai.HookDeferredException``
        (``ai.defer_hook``); if nothing waits here yet, the next hook of that label in this
        process raises it. The record stays pending."""
        exc = ai.HookDeferredException(hook_part)
        wait = self._waits.get(hook_part.hook_id)
        if wait is not None and not wait.abort.done():
            wait.abort.set_result(exc)
        else:
            self._stashed[hook_part.hook_id] = exc

    async def cancel_hook(
        self, hook: HookTarget, *, reason: str | None = None, timeout_s: float | None = None
    ) -> None:
        """Cancel the pending hook `hook` from any process (``ai.cancel_hook``): its
        waiter raises ``asyncio.CancelledError(reason)``. Its store calls end by
        `timeout_s` seconds (None: the store's deadline).

        Raises:
            SuspensionNotFoundError: no hook of that label (``ai`` raises ``ValueError``).
            AlreadySettledError: it is already resolved or cancelled.
            HookbusTimeoutError: JetStream stayed unavailable (until `timeout_s`).
        """
        await self.suspensions.cancel_hook(_label(hook), reason=reason, timeout_s=timeout_s)

    async def approve(
        self, hook: HookTarget, choice: str, *, approver: str, wait_s: float = 5.0
    ) -> ApprovalAnswer:
        """Answer the tool approval `hook` with `choice` (``"Allow"`` or ``"Deny"``) as
        `approver`, from any process: write the answer proof ``<agent>.<label>.<approver>``
        (the key only this approver's NATS user may write), then wait up to `wait_s`
        seconds for the waiting agent to resolve the approval with it. A proof written
        before the hook exists decides it when it starts (returned at once).

        Returns:
            The answer that decided it (this one).
        Raises:
            ResolutionRejectedError: `choice` is neither "Allow" nor "Deny".
            AlreadySettledError: it was decided first (by another approver's answer: the
                message names it, or cancelled), or this approver already answered
                otherwise.
            AnswerNotAppliedError: recorded, but nobody applied it within `wait_s`: it
                decides when the agent next waits on the hook.
            BadRequestError: `approver` is empty or too long.
            HookbusTimeoutError: JetStream stayed unavailable, or this NATS user may not
                write the proof.
        """
        label = _label(hook)
        if choice not in APPROVAL_DEFAULT_OPTIONS:
            raise ResolutionRejectedError(
                f"choice {choice!r} is not one of the options {list(APPROVAL_DEFAULT_OPTIONS)}"
            )
        store = self.suspensions
        answer = ApprovalAnswer(choice=choice, answered_by=approver, answered_at=time.time())
        key = approval_answer_key(label, store.agent_id, approver)
        found = await store.get(label)
        if found is not None and found[0].status != "pending":
            raise AlreadySettledError(f"tool approval {label!r} is already {found[0].status}")
        answer = await write_proof(
            store.records.kv, key, answer, deadline_s=store.records.deadline_s
        )
        if found is None:
            return answer  # the hook takes it when it starts
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            got = await store.get(label)
            record = None if got is None else got[0]
            if record is None:  # consumed and removed by the run's end: who decided it?
                first = await first_proof(
                    store.records.kv, store.records.key(label),
                    lambda k, v: _valid_proof(k, v, label, store.agent_id),
                    deadline_s=store.records.deadline_s,
                )  # fmt: skip
                if first is not None and first.answered_by == approver:
                    return answer
                raise AlreadySettledError(
                    f"tool approval {label!r} was decided first by"
                    f" {first.answered_by if first is not None else 'another resolution'}"
                )
            if record.status == "cancelled":
                raise AlreadySettledError(f"tool approval {label!r} was cancelled first")
            if record.status == "resolved":
                won = record.resolution if isinstance(record.resolution, dict) else {}
                if (won.get("answered_by"), won.get("choice")) == (approver, answer.choice):
                    return answer
                raise AlreadySettledError(
                    f"tool approval {label!r} was decided first by"
                    f" {won.get('answered_by') or 'an unproven resolution'}"
                    f" ({won.get('choice') or won.get('granted')!r})"
                )
            if loop.time() >= deadline:
                raise AnswerNotAppliedError(
                    f"the answer {choice!r} of {approver} to tool approval {label!r} is"
                    f" recorded, but the agent did not apply it within {wait_s:g} s: it decides"
                    " when the agent next waits on it"
                )
            await asyncio.sleep(0.05)

    async def _apply_proof(self, label: str) -> bool:
        """Resolve the tool approval `label` (pending, or not created yet: pre-registered)
        from its first valid proof in stream order. True once it is settled."""
        store = self.suspensions
        found = await store.get(label)
        if found is not None and found[0].status == "resolved" and found[0].consumed:
            return False  # a used one, kept (see `_mark_used`): the next hook makes it anew
        if found is not None and found[0].status != "pending":
            return True
        answer = await first_proof(
            store.records.kv, store.records.key(label),
            lambda key, value: _valid_proof(key, value, label, store.agent_id),
            deadline_s=store.records.deadline_s,
        )  # fmt: skip
        if answer is None:
            return False
        with contextlib.suppress(AlreadySettledError):  # settled meanwhile
            await store.resolve_hook(label, _resolution(answer))
        return True

    async def _pump(self, label: str) -> None:
        """While a tool approval is waited on: at once, at each proof the store's watch
        delivers, and every few seconds, resolve it from its first valid proof."""
        store = self.suspensions
        key = store.records.key(label)
        signal = store.watch.listen_proofs(key)
        try:
            while True:
                signal.clear()
                try:
                    if await self._apply_proof(label):
                        return
                except (HookbusError, NatsError) as exc:
                    log.info("tool approval %r: proofs not read (%r)", label, exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_PROOF_POLL_S):
                        await signal.wait()
        finally:
            store.watch.unlisten_proofs(key, signal)

    async def _proven(self, label: str, value: Any, payload: type[M]) -> M:
        """The tool approval's resolution `value` as `payload` if an approver's proof holds
        it; else a refusal (``granted=False``) for a ``ToolApproval``, or
        `ResolutionRejectedError`."""
        problem = None
        who = value.get("answered_by") if isinstance(value, dict) else None
        if not isinstance(who, str) or not who:
            problem = "it names no approver"
        else:
            store = self.suspensions
            key = approval_answer_key(label, store.agent_id, who)

            async def get() -> bytes | None:
                try:
                    return (await store.records.kv.get(key)).value or None
                except KeyNotFoundError:
                    return None

            raw = await kv_retry(get, deadline_s=store.records.deadline_s, what=f"reading {key}")
            proof = None if raw is None else _valid_proof(key, raw, label, store.agent_id)
            if proof is None:
                problem = f"no answer of approver {who!r} is on record"
            elif _resolution(proof) != value:
                problem = f"{who!r} answered {proof.choice!r}, which the resolution does not say"
        if problem is None:
            return payload.model_validate(value)
        log.warning("tool approval %r: resolution refused: %s", label, problem)
        if issubclass(payload, ai_tools.ToolApproval):
            return payload.model_validate({"granted": False, "reason": f"refused: {problem}"})
        raise ResolutionRejectedError(f"tool approval {label!r}: resolution refused: {problem}")

    def abort_pending_hook(self, hook: HookTarget) -> bool:
        """Stop this process's wait on `hook`: its ``ai.hook`` raises
        ``ai.HookDeferredException`` and the record stays pending, detached, for a later
        run to resume (in any process). Call it on the event loop's thread. Returns False
        if nothing here waits on it. A resolution that lands before the abort is returned
        instead (never lost)."""
        wait = self._waits.get(_label(hook))
        if wait is None or wait.abort.done():
            return False
        wait.abort.set_result(None)
        return True

    def abort_all(self) -> int:
        """`abort_pending_hook` for every hook this process waits on (e.g. a serverless
        function about to time out). Returns how many waits were aborted."""
        return sum(self.abort_pending_hook(label) for label in list(self._waits))

    async def events(self) -> _AIHookEvents:
        """``ai``'s ``HookEvent`` for every pending / resolved / cancelled transition of
        this agent's hooks (every agent's when the store is not scoped), from any process,
        as an async iterator (close it with ``aclose`` or ``async with``). Subscribed
        before it returns."""
        return _AIHookEvents(await self.suspensions.events())

    # -- the hook -----------------------------------------------------------------------------
    async def _hook(
        self,
        label: str,
        *,
        payload: type[M],
        metadata: dict[str, Any] | None,
        tool_call_id: str | None,
        registry: ai.HookRegistry | None,
        timeout_s: float | None,
    ) -> M:
        metadata = dict(metadata or {})
        stashed = self._stashed.pop(label, None)
        if stashed is not None:
            raise stashed
        if registry is not None:  # pre-registered the ai way: into the run's registry
            local = registry._pending_resolutions.pop(label, None)
            if isinstance(local, BaseException):
                raise local
            if local is not None:
                with contextlib.suppress(AlreadySettledError):  # a resolution there wins
                    await self.suspensions.resolve_hook(label, _json(local))
        rt = _runtime()
        part: ai_messages.HookPart[Any] = ai_messages.HookPart(
            hook_id=label,
            hook_type=payload.__name__,
            status="pending",
            metadata=metadata,
            tool_call_id=tool_call_id,
        )
        stored = {
            **metadata,
            AI_METADATA_KEY: {"hook_type": payload.__name__, "tool_call_id": tool_call_id},
        }
        run = current_run_scope.get()
        if run is not None:  # never take a hook over from a live process running this run
            found = await self.suspensions.get(label)
            owner = None if found is None else await self._live_owner(found[0], run.run_id)
            if owner is not None:
                raise _run_in_progress(run.run_id, label, owner)
        approval = is_tool_approval(label, payload)
        if approval:  # a proof written before the hook: pre-registered, taken at once
            try:
                await self._apply_proof(label)
            except (HookbusError, NatsError) as exc:
                log.info("tool approval %r: proofs not read (%r)", label, exc)
        found = await self.suspensions.get(label)
        waiting_value = (
            found is not None and found[0].status == "resolved" and not found[0].consumed
        )
        # the run (or emit) that created the suspension: kept with the record, so a wait
        # resumed later (another run, another process) links to it
        creator = _creator(found) or creating_traceparent()
        if creator is not None:
            stored[AI_METADATA_KEY][AI_TRACE_KEY] = creator

        wait = _Wait()
        self._waits[label] = wait
        local_future: asyncio.Future[dict[str, Any]] | None = None
        if registry is not None and rt is not None:  # ai.resolve_hook & co. find it
            local_future = asyncio.get_running_loop().create_future()
            registry._live_hooks[label] = (local_future, metadata, rt)
        run_id = run.run_id if run is not None else None
        span_attributes = {  # shared by the run and a run resuming it: found by attribute
            tn.GEN_AI_AGENT_ID: self.suspensions.agent_id,
            tn.RUN_ID: run_id,
            tn.GEN_AI_CONVERSATION_ID: self.session_id or run_id,
        }
        with created_by(creator):  # the wait's span links to the creator (the task copies it)
            kv = asyncio.ensure_future(
                self.suspensions.hook(
                    label,
                    payload=None if approval else payload,
                    metadata=stored,
                    timeout_s=timeout_s,
                    schema=payload_schema(payload) if approval else None,
                    span_attributes=span_attributes,
                )
            )
        pump = asyncio.ensure_future(self._pump(label)) if approval else None
        instead: BaseException | None = None  # what an abort raises
        cancelled_locally = False
        announced = False  # pending was emitted (ai: not for a resolution already there)
        try:
            if not waiting_value and rt is not None and await self._until_waiting(label, kv):
                await rt.put_hook(part)  # once other services can resolve it
                announced = True
            sources: set[asyncio.Future[Any]] = {kv, wait.abort}
            if local_future is not None:
                sources.add(local_future)
            done, _ = await asyncio.wait(sources, return_when=asyncio.FIRST_COMPLETED)
            if kv not in done:
                if local_future is not None and local_future in done:
                    instead, cancelled_locally = await self._carry(label, local_future, kv)
                else:
                    instead = wait.abort.result()
                    await self._abort(label, kv)
                await asyncio.wait({kv})
            proven = (lambda value: self._proven(label, value, payload)) if approval else None
            try:
                return await self._outcome(
                    kv, part, rt if announced else None,
                    instead=instead, cancelled_locally=cancelled_locally, proven=proven,
                )  # fmt: skip
            except SuspensionTimeoutError:
                if not (approval and issubclass(payload, ai_tools.ToolApproval)):
                    raise
                timed_out = (label, payload, part, rt if announced else None, timeout_s)
        finally:
            if pump is not None:
                await stop_task(pump, "a tool approval's proof reads")
            if not kv.done():
                kv.cancel()
                with contextlib.suppress(BaseException):
                    await kv
            if self._waits.get(label) is wait:
                del self._waits[label]
            if registry is not None and local_future is not None:
                live = registry._live_hooks.get(label)
                if live is not None and live[0] is local_future:
                    del registry._live_hooks[label]
        return await self._approval_timed_out(*timed_out)

    async def _approval_timed_out(
        self,
        label: str,
        payload: type[M],
        part: ai_messages.HookPart[Any],
        rt: ai_runtime.Runtime | None,
        timeout_s: float | None,
    ) -> M:
        """End the tool approval `label` that got no answer within `timeout_s` seconds with
        `approval_default`: close its record (cancelled, the reason saying so, so a later
        answer decides nothing) and return ``ToolApproval(granted=..., reason="timed out
        after <s>s; default <deny|allow>")``, which the model reads (a deny is the tool
        result ``"Rejected: timed out ..."``). An answer that won the race decides instead."""
        why = f"{_TIMED_OUT}{timeout_s:g}s; default {self.approval_default}"
        with contextlib.suppress(HookbusError, NatsError):  # an answer written at the last moment
            await self._apply_proof(label)
        try:
            await self.suspensions.cancel_hook(label, reason=f"{why} applied")
        except AlreadySettledError:  # an answer (or a cancel) won: it decides, not the clock
            return await self._hook(
                label, payload=payload, metadata=part.metadata, tool_call_id=part.tool_call_id,
                registry=None, timeout_s=_SETTLE_S,
            )  # fmt: skip
        except (SuspensionNotFoundError, HookbusError, NatsError) as exc:
            log.warning(
                "tool approval %r: not closed at its timeout (%r); default applied", label, exc
            )
        else:  # kept past the run's end: a later answer, or a replay, finds it closed
            run = current_run_scope.get()
            if run is not None:
                run.labels.discard(label)
        log.info("tool approval %r: %s", label, why)
        if rt is not None:
            await rt.put_hook(part.model_copy(update={"status": "cancelled"}))
        return payload.model_validate({"granted": self.approval_default == "allow", "reason": why})

    async def _carry(
        self, label: str, local: asyncio.Future[dict[str, Any]], kv: asyncio.Future[Any]
    ) -> tuple[BaseException | None, bool]:
        """Carry what ``ai.resolve_hook`` / ``ai.cancel_hook`` / ``ai.defer_hook`` did to
        the run's registry over to the record; return (exception to raise instead, whether
        ``ai.cancel_hook`` did it: it published its own ``cancelled`` event)."""
        if local.cancelled():
            reason = _cancel_reason(local)
            with contextlib.suppress(SuspensionNotFoundError, AlreadySettledError):
                await self.suspensions.cancel_hook(label, reason=reason)
            return None, True
        exc = local.exception()
        if exc is not None:
            await self._abort(label, kv)
            return exc, False
        try:
            await self.suspensions.resolve_hook(label, _json(local.result()))
        except AlreadySettledError:
            pass  # another resolution or a cancel won: the waiter reports it
        except ResolutionRejectedError as exc:
            await self._abort(label, kv)
            return exc, False
        return None, False

    async def _until_waiting(self, label: str, kv: asyncio.Future[Any]) -> bool:
        """Wait until the store's wait holds a pending record of `label` (True), or ended
        first (False)."""
        while not kv.done():
            found = await self.suspensions.get(label)
            if found is not None:
                record = found[0]
                if record.status == "pending" and record.attached:
                    if record.owner and record.owner == self.suspensions.waiter_id:
                        return True
            await asyncio.wait({kv}, timeout=_ABORT_POLL_S)
        return False

    async def _abort(self, label: str, kv: asyncio.Future[Any]) -> None:
        """Abort the store's wait on `label` (by its hook id, read from the record once the
        wait has created or attached it); the record stays pending, detached."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ABORT_DEADLINE_S
        while not kv.done():
            found = await self.suspensions.get(label)
            if found is not None and found[0].status == "pending":
                if self.suspensions.abort_pending_hook(found[0].hook_id):
                    return
            if loop.time() > deadline:
                kv.cancel()
                return
            await asyncio.sleep(_ABORT_POLL_S)

    async def _outcome(
        self,
        kv: asyncio.Future[M],
        part: ai_messages.HookPart[Any],
        rt: ai_runtime.Runtime | None,
        *,
        instead: BaseException | None,
        cancelled_locally: bool,
        proven: Any = None,
    ) -> M:
        if kv.cancelled():  # an abort that could not reach the store's wait
            raise instead or ai.HookDeferredException(part)
        exc = kv.exception()
        if isinstance(exc, SuspensionAbortedError):
            raise (instead or ai.HookDeferredException(part)) from None
        if isinstance(exc, SuspensionCancelledError):
            if rt is not None and not cancelled_locally:
                await rt.put_hook(part.model_copy(update={"status": "cancelled"}))
            raise asyncio.CancelledError(exc.reason)
        if exc is not None:
            raise exc
        value = kv.result()
        raw = value
        if proven is not None:  # a tool approval: the approver's proof must hold it
            value = await proven(raw)
        if rt is not None:
            resolution = value.model_dump() if isinstance(value, pydantic.BaseModel) else value
            if proven is not None and isinstance(raw, dict) and raw.get("answered_by"):
                if getattr(value, "granted", None) == raw.get("granted"):  # not refused
                    resolution = {**resolution, "answered_by": raw["answered_by"]}
            await rt.put_hook(
                part.model_copy(update={"status": "resolved", "resolution": resolution})
            )
        return value


def _as_deny(result: HookResult, event: str) -> HookResult:
    return as_deny(
        result, event,
        "the dispatcher does not run hookbus approvals (a connected, started HookDispatcher"
        " with approvals on does)",
        log=log,
    )  # fmt: skip


def _invalid_arguments(call: Any, new_input: Any) -> str | None:
    """Why `new_input` cannot replace the arguments of the tool call `call` (validated by
    the tool's own parameters, as ``ai`` validates the model's), else None."""
    if not isinstance(new_input, dict):
        return f"a {type(new_input).__name__}, not an object"
    current = ai_agent._current_tool_call.get(None)
    tool = getattr(current, "_tool", None)
    if tool is None or getattr(current, "id", None) != call.tool_call_id:
        return None  # not ai's bound tool call: ai validates them before the tool runs
    try:
        ai_agent._validate_kwargs(tool, new_input)
    except pydantic.ValidationError as exc:
        return f"invalid ones: {exc}"
    return None


def _with_injections(result: Any, added: list[Injection]) -> Any:
    """`result` (``ai``'s ``ToolCallResult``) with `added` appended to the text the model
    reads for its first part (``model_input``; ``result``, what the application sees, is
    unchanged). Each injection is framed ``<hook_injection handler="..." role="...">``."""
    parts = list(result.results)
    if not parts:
        return result
    first = parts[0]
    seen = first.get_model_input()
    text = framed_injections(seen if isinstance(seen, str) else json.dumps(jsonable(seen)), added)
    parts[0] = first.model_copy(update={"model_input": text, "model_input_kind": "json"})
    return ai_agent.tool_result(*parts, exception=result.exception)


def _run_in_progress(run_id: str, label: str, owner: str) -> RunInProgressError:
    return RunInProgressError(
        f"run {run_id!r} is live in another process (waiter {owner}, waiting on hook"
        f" {label!r}): not started here. If that process died, resume once its lease lapses"
        " (about 15 s)"
    )


def _runtime() -> ai_runtime.Runtime | None:
    try:
        return ai_runtime.get_runtime()
    except LookupError:
        return None


def _cancel_reason(future: asyncio.Future[Any]) -> str | None:
    try:
        future.result()
    except asyncio.CancelledError as exc:
        return str(exc.args[0]) if exc.args and exc.args[0] is not None else None
    return None  # pragma: no cover - only called on a cancelled future


def ai_hook_part(part: HookPart) -> ai_messages.HookPart[Any]:
    """hookbus's `HookPart` as ``ai``'s (``hook_id`` = the label; ``hook_type`` and
    ``tool_call_id`` from the ``"_ai"`` metadata key, which is removed)."""
    metadata = dict(part.metadata)
    extra = metadata.pop(AI_METADATA_KEY, None)
    extra = extra if isinstance(extra, dict) else {}
    return ai_messages.HookPart(
        hook_id=part.label,
        hook_type=str(extra.get("hook_type") or ""),
        status=part.status,
        metadata=metadata,
        resolution=part.resolution,
        tool_call_id=extra.get("tool_call_id"),
    )


class _AIHookEvents:
    """hookbus hook events as ``ai``'s ``HookEvent`` (see `HookbusHooks.events`)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __aiter__(self) -> _AIHookEvents:
        return self

    async def __anext__(self) -> ai_events.HookEvent:
        event: HookEvent = await self._stream.__anext__()
        part = ai_hook_part(event.hook)
        message = ai_messages.Message(role="internal", parts=[part])
        return ai_events.HookEvent(message=message, hook=part)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _AIHookEvents:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# -- module functions: ai's names, on the current HookbusHooks --------------------------------
_current: contextvars.ContextVar[HookbusHooks] = contextvars.ContextVar("hookbus_ai_hooks")


def current_hooks() -> HookbusHooks:
    """The `HookbusHooks` of the current context (inside `HookbusHooks.run` or
    `use_hooks`).

    Raises:
        LookupError: there is none (as ``ai.get_hook_registry``).
    """
    try:
        return _current.get()
    except LookupError:
        raise LookupError(
            "no current HookbusHooks: use hooks.run(...) or use_hooks(hooks), or pass hooks="
        ) from None


@contextlib.contextmanager
def use_hooks(hooks: HookbusHooks) -> Iterator[HookbusHooks]:
    """Make `hooks` current for the module functions, in this task and the tasks it
    starts, until the block exits."""
    token = _current.set(hooks)
    try:
        yield hooks
    finally:
        _current.reset(token)


def _pick(hooks: HookbusHooks | None) -> HookbusHooks:
    return hooks if hooks is not None else current_hooks()


async def hook(
    hook: HookTarget,
    *,
    payload: type[M],
    metadata: dict[str, Any] | None = None,
    tool_call_id: str | None = None,
    timeout_s: float | None = None,
    hooks: HookbusHooks | None = None,
) -> M:
    """``ai.hook`` on `hooks` (default: `current_hooks`); see `HookbusHooks.hook`."""
    return await _pick(hooks).hook(
        hook, payload=payload, metadata=metadata, tool_call_id=tool_call_id, timeout_s=timeout_s
    )


async def resolve_hook(
    hook: HookTarget,
    data: pydantic.BaseModel | dict[str, Any] | BaseException,
    *,
    payload: type[pydantic.BaseModel] | None = None,
    replace: bool = False,
    hooks: HookbusHooks | None = None,
    timeout_s: float | None = None,
) -> None:
    """``ai.resolve_hook`` on `hooks` (default: `current_hooks`); a coroutine here. See
    `HookbusHooks.resolve_hook`."""
    await _pick(hooks).resolve_hook(
        hook, data, payload=payload, replace=replace, timeout_s=timeout_s
    )


def defer_hook(hook_part: ai_messages.HookPart[Any], *, hooks: HookbusHooks | None = None) -> None:
    """``ai.defer_hook`` on `hooks` (default: `current_hooks`); see `HookbusHooks.defer_hook`."""
    _pick(hooks).defer_hook(hook_part)


async def cancel_hook(
    hook: HookTarget,
    *,
    reason: str | None = None,
    hooks: HookbusHooks | None = None,
    timeout_s: float | None = None,
) -> None:
    """``ai.cancel_hook`` on `hooks` (default: `current_hooks`); see `HookbusHooks.cancel_hook`."""
    await _pick(hooks).cancel_hook(hook, reason=reason, timeout_s=timeout_s)


def abort_pending_hook(hook: HookTarget, *, hooks: HookbusHooks | None = None) -> bool:
    """Stop waiting on `hook` here, leaving it pending (see
    `HookbusHooks.abort_pending_hook`); `hooks` defaults to `current_hooks`."""
    return _pick(hooks).abort_pending_hook(hook)
