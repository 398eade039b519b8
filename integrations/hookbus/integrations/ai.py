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
import inspect
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Literal

import ai
import pydantic
from ai.agents import _middleware as ai_middleware
from ai.agents import hooks as ai_hooks
from ai.types import messages as ai_messages
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher, Suspensions
from hookbus.dispatcher.tracing import run_span
from hookbus.schemas import TOOL_ERROR, TOOL_POST, TOOL_PRE, ApprovalAnswer

from ._ai.events import AIHookEvents, ai_hook_part
from ._ai.labels import (
    AI_METADATA_KEY,
    APPROVAL_LABEL_PREFIX,
    HookTarget,
    M,
    is_tool_approval,
    label_of,
    resolution_value,
)
from ._ai.labels import AI_TRACE_KEY as AI_TRACE_KEY  # the "_ai" metadata's trace key
from ._ai.proofs import ToolApprovalProofs
from ._ai.run_claims import RunClaims, RunInProgressError, refusal_unwrapped
from ._ai.tool_approvals import ToolApprovals
from ._ai.tool_calls import ToolCalls
from ._ai.turns import ModelTurns
from ._ai.waits import AIHookWaits
from ._emit import check_timeout

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

EVENTS = (TOOL_PRE, TOOL_POST, TOOL_ERROR)
"""The events `HookbusHooks` emits for each tool call, in order (``tool:post`` after a
tool that returned, ``tool:error`` after one that raised)."""


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
        self._turns = ModelTurns()
        self._claims = RunClaims(self)
        self._proofs = ToolApprovalProofs(self)
        self._tool_approvals = ToolApprovals(self, self._claims)
        self._waits = AIHookWaits(self, self._proofs, self._claims)
        self._tool_calls = ToolCalls(self, self._tool_approvals, self.governor)

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
                made = HookDispatcher(
                    self.suspensions.connection, agent_id=self.suspensions.agent_id
                )
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
        async with self._claims.held(run_id), self.suspensions.run(run_id) as scope:
            # the run's span: its run id and session, the same on a run resuming it
            session = self.session_id or scope.run_id
            with (
                use_hooks(self),
                run_span(self.suspensions.agent_id, scope.run_id, session),
                refusal_unwrapped(),  # ai's task group: say it plainly
            ):
                async with agent.run(
                    model, list(messages), _middleware=middleware, **kwargs
                ) as stream:
                    yield stream

    async def wrap_agent_run(self, call: Any, next: Any) -> AsyncIterator[Any]:
        """``ai``'s middleware entry for the run: notes the assistant turn the model is
        giving (each model event carries it), for `resumable_messages`."""
        async with contextlib.aclosing(self._turns.follow(call, next)) as events:
            async for event in events:
                yield event

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
        return self._turns.resumable(stream)

    async def wrap_hook(self, call: Any, next: Any) -> pydantic.BaseModel:
        """``ai``'s middleware entry: every ``ai.hook(...)`` of a run this middleware is
        part of is answered by `hook` (``next``, ``ai``'s in-memory registry, is not
        called)."""
        registry = call.registry or ai_hooks._hook_registry.get(None)

        async def wait(label: str) -> Any:
            return await self._waits.wait(
                label, payload=call.payload, metadata=call.metadata,
                tool_call_id=call.tool_call_id, registry=registry, timeout_s=self.timeout_s,
            )  # fmt: skip

        if call.tool_call_id and is_tool_approval(call.label, call.payload):
            return await self._tool_approvals.ask(call, wait, self._waits)
        return await wait(call.label)

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
        return await self._tool_calls.wrap(call, next)

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
        return await self._waits.wait(
            label_of(hook),
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
        label = label_of(hook)
        if isinstance(data, BaseException):
            self._waits.raise_instead(label, data)
            return
        value = resolution_value(data, payload)
        await self.suspensions.resolve_hook(label, value, replace=replace, timeout_s=timeout_s)

    def defer_hook(self, hook_part: ai_messages.HookPart[Any]) -> None:
        """Abort this process's wait on `hook_part` with ``ai.HookDeferredException``
        (``ai.defer_hook``); if nothing waits here yet, the next hook of that label in this
        process raises it. The record stays pending."""
        self._waits.raise_instead(hook_part.hook_id, ai.HookDeferredException(hook_part))

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
        await self.suspensions.cancel_hook(label_of(hook), reason=reason, timeout_s=timeout_s)

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
        return await self._proofs.approve(label_of(hook), choice, approver=approver, wait_s=wait_s)

    def abort_pending_hook(self, hook: HookTarget) -> bool:
        """Stop this process's wait on `hook`: its ``ai.hook`` raises
        ``ai.HookDeferredException`` and the record stays pending, detached, for a later
        run to resume (in any process). Call it on the event loop's thread. Returns False
        if nothing here waits on it. A resolution that lands before the abort is returned
        instead (never lost)."""
        return self._waits.abort(label_of(hook))

    def abort_all(self) -> int:
        """`abort_pending_hook` for every hook this process waits on (e.g. a serverless
        function about to time out). Returns how many waits were aborted."""
        return sum(self._waits.abort(label) for label in self._waits.labels)

    async def events(self) -> AIHookEvents:
        """``ai``'s ``HookEvent`` for every pending / resolved / cancelled transition of
        this agent's hooks (every agent's when the store is not scoped), from any process,
        as an async iterator (close it with ``aclose`` or ``async with``). Subscribed
        before it returns."""
        return AIHookEvents(await self.suspensions.events())


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
