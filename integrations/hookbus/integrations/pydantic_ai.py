"""hookbus as the hook layer of a pydantic-ai agent: `HookbusCapability`.

``Agent(model, capabilities=[HookbusCapability(dispatcher)])`` routes the agent's lifecycle to
hookbus handlers anywhere on NATS, through a `HookDispatcher` the application started. It is a
pydantic-ai capability (`pydantic_ai.capabilities.AbstractCapability`); each pydantic-ai hook
below emits one amplifier-core event and applies the folded `HookResult`:

============================  ==================  ===========================================
pydantic-ai hook              hookbus event       data (besides ``run_id``, ``session_id``)
============================  ==================  ===========================================
``wrap_run`` (before)         ``session:start``   ``prompt``
``before_model_request``      ``prompt:submit``   ``prompt`` (first model request of a run)
``before_tool_execute``       ``tool:pre``        ``tool_name``, ``tool_input``, ``tool_call_id``
``after_tool_execute``        ``tool:post``       the same and ``tool_result``
``on_tool_execute_error``     ``tool:error``      the same and ``error`` (``type``, ``msg``)
``wrap_run`` (run completed)  ``prompt:complete`` ``prompt``, ``response`` (the output)
``wrap_run`` (after)          ``session:end``     ``status``, ``error``
============================  ==================  ===========================================

``run_id`` is pydantic-ai's run id; ``session_id`` is the capability's `session_id`, else
pydantic-ai's ``conversation_id`` (a conversation spans the runs that share a history, as an
amplifier-core session does; "Allow always" grants are per session). ``agent_id`` comes from
the dispatcher (pinned ``agent_id`` or default fields). ``tool_input`` and ``tool_result`` are
sent as JSON (`pydantic_core.to_jsonable_python`; values JSON cannot hold become strings).

What each action does (the dispatcher's fold decides the action, and a handler's failure is
judged by that handler's failure policy, in the dispatcher; nothing is re-decided here):

- ``deny`` on ``tool:pre``: `SkipToolExecution` — the tool never runs and the model sees
  ``"Denied by hook: <reason>"`` as its result. On ``tool:post``: the tool has run, but its
  result is withheld — the model sees ``"Tool result withheld by hook: <reason>"``. On
  ``session:start``, ``prompt:submit`` or ``prompt:complete``: `HookDeniedError` is raised
  and the run stops without an output (a denial is never turned into text that could pass
  for the model's answer).
- ``modify``: the final chained data's ``tool_input`` reaches the tool, validated again with
  the tool's own argument validator (arguments that do not validate deny the call);
  ``tool_result`` on ``tool:post`` replaces the result the model sees; ``prompt`` on
  ``prompt:submit`` replaces the text of the user prompt, in this request and in the history;
  ``response`` on ``prompt:complete`` replaces a text output (the history keeps the model's
  text). A modify that cannot be applied raises `HookbusError`. The final data is read
  from ``result.chained_data`` if the dispatcher has it, else from ``result.data`` (for
  continue, modify and inject_context): ``action == "modify"`` is never required, so a fold
  that ends a modify chain as ``continue`` (amplifier-core) works alike.
- ``inject_context``: each injection (``result.context_injections``, one per handler) is
  queued with `RunContext.enqueue` and reaches the model's next request. During a tool call
  it goes right after that call's tool result (amplifier-core's
  ``append_to_last_tool_result``, in pydantic-ai's terms). With a pydantic-ai that has
  capability parts (`pydantic_ai.messages.CapabilityPart`: not 2.68 and earlier, 2.78 has
  them; `CAPABILITY_PARTS` says which) each injection is a `HookInjectionPart` (kind
  ``hookbus.hook_injection``, an `InstructionCapabilityPart` whose ``handler`` and ``role``
  say who injected it), found in the run's messages by type; pydantic-ai renders it:

  - a ``system`` or ``assistant`` role: in the application's voice (operator authority), as a
    mid-conversation system message, as a `SystemPromptPart` was;
  - a ``user`` role: at the user's authority, in the user's turn, framed as
    ``<hook_injection>...</hook_injection>`` after pydantic-ai's note that the application
    attached it on the user's behalf (it was a bare `UserPromptPart`: the model read it as
    the user's own words);
  - ``ephemeral`` → ``scope='request'``: only the request it goes into sees it, later ones
    leave it out (the ``user`` role included, which had no scope before);
  - text pydantic-ai refuses in the application's voice (something that looks like a
    framework frame, such as a ``<system>`` tag) is sent at no authority instead: framed,
    after pydantic-ai's note that it is information, not instructions (and a warning is
    logged). The run goes on.

  On an older pydantic-ai (the extra allows 2.60 and later): a ``system`` or ``assistant``
  role is a `SystemPromptPart` (``ephemeral`` → ``scope='request'``), a ``user`` role a
  `UserPromptPart` (no scope), both as they were.
- ``ask_user``: with ``approvals="hookbus"`` (the default) the dispatcher turns it into a
  durable hookbus approval (JetStream KV, answered from any process with
  `ApprovalsClient.answer_approval` or ``hookbus approvals answer``) and returns the answer as
  continue or deny; the tool waits. With ``approvals="deferred"`` (and a dispatcher made with
  ``approvals=False``, so that ``ask_user`` comes back unresolved) ``tool:pre`` raises
  pydantic-ai's `ApprovalRequired`: the call is deferred into the run's
  `DeferredToolRequests` (metadata ``{"hookbus": {...}}``: prompt, options, reason, handler),
  and once approved through `DeferredToolResults` the call emits ``tool:pre`` again with
  ``approved: true`` (a deny or modify still applies; a new ``ask_user`` does not ask twice).
  An ``ask_user`` that nothing here can answer (another event in deferred mode, or a
  dispatcher without approvals) is a deny, with a reason saying why.

Faults: `HookDispatcher.emit` decides handler failures (timeout, no responders, error, bad
reply) by each handler's failure policy; a ``deny`` policy reaches this capability as a deny.
An emit that raises (`NotConnectedError` when the connection is closed,
`PayloadTooLargeError`, ...) propagates out of the hook and ends the run: a tool whose
``tool:pre`` could not be decided never runs. Only ``session:end`` (an observation after
the run) is logged instead of raised, so it never hides the run's own outcome.

Tool filters are the handlers' own (``tool_filter`` globs in their declarations): the
capability emits every call and the dispatcher skips handlers whose filter does not match,
so whoever owns a policy decides which tools it sees. Timeouts: each handler's ``timeout_s``
applies per call; the capability's `timeout_s` / `timeouts` bound a whole emit (the
dispatcher's ``emit(timeout_s=...)``, which also cuts an approval's wait).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import anyio
import msgspec
from pydantic import ValidationError
from pydantic_ai.capabilities import AbstractCapability, WrapRunHandler
from pydantic_ai.exceptions import ApprovalRequired, SkipToolExecution, UserError
from pydantic_ai.messages import (
    ModelRequest,
    ModelRequestPart,
    SystemPromptPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.tools import AgentDepsT, DeferredToolRequests, RunContext, ToolDefinition

# CAPABILITY_PARTS: whether this pydantic-ai has typed capability parts (`CapabilityPart`: not
# 2.68 and earlier, 2.78 has them), decided once, here. True: injections are
# `HookInjectionPart`s; False: `SystemPromptPart`s and `UserPromptPart`s, as they always were.
try:
    from pydantic_ai.messages import (
        CapabilitySource,
        InstructionCapabilityPart,
        OperatorSource,
        OperatorText,
    )
except ImportError:
    CAPABILITY_PARTS = False
else:
    CAPABILITY_PARTS = True

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    PROMPT_COMPLETE,
    PROMPT_SUBMIT,
    SESSION_END,
    SESSION_START,
    TOOL_ERROR,
    TOOL_POST,
    TOOL_PRE,
    HookbusError,
    HookResult,
)

from ._emit import HookDeniedError, as_deny, check_options, emit_decision
from ._emit import denied as _denied
from ._emit import denied_text as _denied_text
from ._emit import final_data as _final_data
from ._emit import injections as _injections
from ._emit import jsonable as _jsonable
from ._emit import withheld_text as _withheld_text

if TYPE_CHECKING:
    from pydantic_ai.models import ModelRequestContext
    from pydantic_ai.run import AgentRunResult

__all__ = [
    "CAPABILITY_PARTS",
    "EVENTS",
    "ApprovalMode",
    "HookDeniedError",
    "HookbusCapability",
]

log = logging.getLogger("hookbus.integrations.pydantic_ai")

ApprovalMode = Literal["hookbus", "deferred"]
"""How an ``ask_user`` on ``tool:pre`` is answered: a durable hookbus approval the dispatcher
waits for (``"hookbus"``), or pydantic-ai's deferred-tools flow (``"deferred"``)."""


EVENTS = (
    SESSION_START,
    PROMPT_SUBMIT,
    TOOL_PRE,
    TOOL_POST,
    TOOL_ERROR,
    PROMPT_COMPLETE,
    SESSION_END,
)
"""The events this capability emits, in lifecycle order."""

_SESSION_END_BUDGET_S = 10.0
"""Longest wait, in seconds, for the ``session:end`` emit when no `timeouts` entry bounds it
(it runs shielded from the run's cancellation, so it needs a bound of its own)."""


InjectionRole = Literal["system", "user", "assistant"]
"""A hook result's ``context_injection_role`` (amplifier-core's roles)."""

if CAPABILITY_PARTS:
    __all__ += ["HookInjectionPart"]

    @dataclass(repr=False, kw_only=True)
    class HookInjectionPart(InstructionCapabilityPart, namespace="hookbus"):
        """A hook handler's ``inject_context``, as the model's next request receives it (kind
        ``hookbus.hook_injection``; defined when pydantic-ai has `CapabilityPart`, see
        `CAPABILITY_PARTS`). Find them in a run's messages by type.

        ``content`` is the injected text; ``scope`` is ``"request"`` for an ``ephemeral``
        injection (only the request it goes into sees it), else ``"conversation"``; ``source``
        gives its voice: `OperatorSource` (the application's voice, a system message) for the
        ``system`` and ``assistant`` roles, a `CapabilitySource` at ``"user"`` authority (the
        user's turn, framed as ``<hook_injection>``, attached on the user's behalf) for
        ``user``, and at ``"none"`` (framed, information rather than instructions) for text
        pydantic-ai refuses in the application's voice. ``metadata["hookbus"]`` holds the same
        ``handler`` and ``role`` as on older pydantic-ai.
        """

        handler: str | None = None
        """The handler that injected it (amplifier-core's ``hook_name``), if known."""

        role: InjectionRole = "system"
        """The role the handler asked for (`HookResult.context_injection_role`)."""


@dataclass(init=False)
class HookbusCapability(AbstractCapability[AgentDepsT]):
    """A pydantic-ai capability that emits the agent's lifecycle on hookbus and applies the
    handlers' decisions (see the module docstring for the event table and each action).

    Args:
        dispatcher: a started `HookDispatcher` (connected, so remote handlers are called;
            made with no connection it runs in-process handlers only). It stays the caller's:
            the capability neither starts nor closes it.
        approvals: ``"hookbus"`` (default): ``ask_user`` becomes a durable hookbus approval
            that the dispatcher waits for (it needs approvals on, the default of a connected
            `HookDispatcher`). ``"deferred"``: ``ask_user`` on ``tool:pre`` raises pydantic-ai's
            `ApprovalRequired` (give a dispatcher made with ``approvals=False``).
        session_id: the ``session_id`` of every event; None: pydantic-ai's
            ``conversation_id`` of the run.
        timeout_s: overall deadline of each emit in seconds (all its handlers, and an
            approval's wait); None: only each handler's own timeout applies.
        timeouts: per-event deadlines in seconds (``{"tool:pre": 30.0}``), over `timeout_s`.
        id, description: pydantic-ai's `AbstractCapability` fields.

    Raises:
        TypeError: `dispatcher` is not a `HookDispatcher`.
        ValueError: an unknown `approvals` mode, a timeout that is not a finite number of
            seconds above 0, or a `timeouts` key that is not an event this capability emits.
    """

    dispatcher: HookDispatcher
    approvals: ApprovalMode
    session_id: str | None
    timeout_s: float | None
    timeouts: dict[str, float | None]
    _prompt_sent: bool = field(default=False, init=False, repr=False, compare=False)

    def __init__(
        self,
        dispatcher: HookDispatcher,
        *,
        approvals: ApprovalMode = "hookbus",
        session_id: str | None = None,
        timeout_s: float | None = None,
        timeouts: Mapping[str, float | None] | None = None,
        id: str | None = None,
        description: str | None = None,
    ) -> None:
        per_event = check_options(
            "HookbusCapability", dispatcher, events=EVENTS, session_id=session_id,
            timeout_s=timeout_s, timeouts=timeouts,
        )  # fmt: skip
        if approvals not in ("hookbus", "deferred"):
            raise ValueError(f"approvals must be 'hookbus' or 'deferred', got {approvals!r}")
        self.dispatcher = dispatcher
        self.approvals = approvals
        self.session_id = session_id
        self.timeout_s = timeout_s
        self.timeouts = per_event
        self.id = id
        self.description = description
        self.defer_loading = False
        self._prompt_sent = False

    # -- per run -------------------------------------------------------------------------
    async def for_run(self, ctx: RunContext[AgentDepsT]) -> AbstractCapability[AgentDepsT]:
        """A copy per run: whether this run's prompt was emitted is the run's own state."""
        run = copy.copy(self)
        run._prompt_sent = False
        return run

    async def wrap_run(
        self, ctx: RunContext[AgentDepsT], *, handler: WrapRunHandler
    ) -> AgentRunResult[Any]:
        """``session:start`` before the run (a deny raises `HookDeniedError`, injections go
        to the first model request); ``prompt:complete`` once it completed; ``session:end``
        after it, whatever its outcome (``status``: completed, failed or cancelled)."""
        if self.approvals == "deferred" and _runs_approvals(self.dispatcher):
            log.warning(
                "approvals='deferred', but the dispatcher runs hookbus approvals itself: each"
                " ask_user is answered as a hookbus approval; make it with"
                " HookDispatcher(nc, approvals=False)"
            )
        data = {**self._run_fields(ctx), "prompt": _prompt_text(ctx.prompt)}
        result = await self._emit(SESSION_START, data, key=self._key(ctx, SESSION_START))
        if _denied(result):
            raise HookDeniedError(SESSION_START, _as_deny(result, SESSION_START, self.approvals))
        self._inject(ctx, result)
        status, error = "failed", None
        try:
            run_result = await self._prompt_complete(ctx, await handler())
            status = "completed"
            return run_result
        except anyio.get_cancelled_exc_class():
            status = "cancelled"
            raise
        except BaseException as exc:
            error = {"type": type(exc).__name__, "msg": str(exc)}
            raise
        finally:
            await self._session_end(ctx, status, error)

    async def _prompt_complete(
        self, ctx: RunContext[AgentDepsT], run_result: AgentRunResult[Any]
    ) -> AgentRunResult[Any]:
        """``prompt:complete`` with the run's output as ``response``: a deny raises
        `HookDeniedError` (the output never reaches the caller); a new ``response`` replaces
        a text output (the history keeps the model's own text). A run paused on deferred
        tool calls has not completed: nothing is emitted."""
        output = run_result.output
        if isinstance(output, DeferredToolRequests):
            return run_result
        sent = _jsonable(output)
        data = {**self._run_fields(ctx), "prompt": _prompt_text(ctx.prompt), "response": sent}
        result = await self._emit(PROMPT_COMPLETE, data, key=self._key(ctx, PROMPT_COMPLETE))
        if _denied(result):
            raise HookDeniedError(
                PROMPT_COMPLETE, _as_deny(result, PROMPT_COMPLETE, self.approvals)
            )
        new = _final_data(result).get("response", sent)
        if new != sent and isinstance(output, str) and isinstance(new, str):
            return dataclasses.replace(run_result, output=new)
        if new != sent:
            raise HookbusError(
                f"prompt:complete: {result.decided_by or 'a hook'} modified the response, which"
                " can only replace a text output with text"
            )
        return run_result

    async def _session_end(
        self, ctx: RunContext[AgentDepsT], status: str, error: dict[str, str] | None
    ) -> None:
        data: dict[str, Any] = {**self._run_fields(ctx), "status": status}
        if error is not None:
            data["error"] = error
        budget = self.timeouts.get(SESSION_END, self.timeout_s) or _SESSION_END_BUDGET_S
        with anyio.CancelScope(shield=True), anyio.move_on_after(budget + 1.0):
            try:
                await self._emit(SESSION_END, data, key=self._key(ctx, SESSION_END))
                return
            except HookbusError as exc:  # observation only: never hide the run's outcome
                log.warning("session:end of run %s not delivered: %s", ctx.run_id, exc)
                return
        log.warning("session:end of run %s not delivered within %ss", ctx.run_id, budget)

    # -- model requests ------------------------------------------------------------------
    async def before_model_request(
        self, ctx: RunContext[AgentDepsT], request_context: ModelRequestContext
    ) -> ModelRequestContext:
        """``prompt:submit`` before the run's first model request that carries its prompt.

        Deny: `HookDeniedError`. Modify: a new ``prompt`` text replaces the user prompt (in
        place, so the history holds the new text too; a `HookbusError` if the prompt is not
        plain text). Injections go into this request.
        """
        if self._prompt_sent or ctx.prompt is None:
            return request_context
        self._prompt_sent = True
        prompt = _prompt_text(ctx.prompt)
        data = {**self._run_fields(ctx), "prompt": prompt}
        result = await self._emit(PROMPT_SUBMIT, data, key=self._key(ctx, PROMPT_SUBMIT))
        if _denied(result):
            raise HookDeniedError(PROMPT_SUBMIT, _as_deny(result, PROMPT_SUBMIT, self.approvals))
        new_prompt = _final_data(result).get("prompt", prompt)
        if new_prompt != prompt:
            _replace_prompt(request_context.messages, ctx.prompt, new_prompt, result)
        self._inject(ctx, result)
        return request_context

    # -- tool calls ----------------------------------------------------------------------
    async def before_tool_execute(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: dict[str, Any],
    ) -> dict[str, Any]:
        """``tool:pre``: deny → `SkipToolExecution` (the reason is the tool's result); modify
        → the new ``tool_input``, validated by the tool's validator; ask_user → a hookbus
        approval, or `ApprovalRequired` (``approvals="deferred"``); injections → the next
        request, after this call's result."""
        sent = _jsonable(args)
        data = self._tool_fields(ctx, call, sent)
        if ctx.tool_call_approved:
            data["approved"] = True  # approved through pydantic-ai's deferred tool results
        result = await self._emit(TOOL_PRE, data, key=self._key(ctx, TOOL_PRE, call))
        if result.action == "ask_user" and self.approvals == "deferred":
            if not ctx.tool_call_approved:
                raise ApprovalRequired(metadata={"hookbus": _approval_metadata(result)})
            # approved through DeferredToolResults: a deny or modify still applies, but the
            # human who answered is not asked again
            result = msgspec.structs.replace(result, action="continue")
        if _denied(result):
            raise SkipToolExecution(_denied_text(_as_deny(result, TOOL_PRE, self.approvals)))
        new_input = _final_data(result).get("tool_input", sent)
        if new_input != sent:
            args = self._revalidate(ctx, call, new_input, result)
        self._inject(ctx, result)
        return args

    async def after_tool_execute(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: dict[str, Any],
        result: Any,
    ) -> Any:
        """``tool:post``: deny → the result is withheld (the model sees the reason; the tool
        did run); modify → the new ``tool_result`` (JSON) is what the model sees."""
        sent = _jsonable(result)
        data = {**self._tool_fields(ctx, call, _jsonable(args)), "tool_result": sent}
        decision = await self._emit(TOOL_POST, data, key=self._key(ctx, TOOL_POST, call))
        if _denied(decision):
            decision = _as_deny(decision, TOOL_POST, self.approvals)
            return _withheld_text(decision)
        self._inject(ctx, decision)
        new_result = _final_data(decision).get("tool_result", sent)
        return result if new_result == sent else new_result

    async def on_tool_execute_error(
        self,
        ctx: RunContext[AgentDepsT],
        *,
        call: ToolCallPart,
        tool_def: ToolDefinition,
        args: dict[str, Any],
        error: Exception,
    ) -> Any:
        """``tool:error`` (observation; injections are applied), then the error goes on."""
        data = {
            **self._tool_fields(ctx, call, _jsonable(args)),
            "error": {"type": type(error).__name__, "msg": str(error)},
        }
        try:
            decision = await self._emit(TOOL_ERROR, data, key=self._key(ctx, TOOL_ERROR, call))
            if decision.action != "deny":
                self._inject(ctx, decision)
            raise error
        finally:
            del error  # the traceback holds this frame (pydantic-ai's own advice)

    # -- helpers -------------------------------------------------------------------------
    async def _emit(self, event: str, data: dict[str, Any], *, key: str) -> HookResult:
        timeout = self.timeouts.get(event, self.timeout_s)
        return await emit_decision(self.dispatcher.emit, event, data, key=key, timeout_s=timeout)

    def _run_fields(self, ctx: RunContext[AgentDepsT]) -> dict[str, Any]:
        return {"run_id": ctx.run_id, "session_id": self.session_id or ctx.conversation_id}

    def _tool_fields(
        self, ctx: RunContext[AgentDepsT], call: ToolCallPart, tool_input: Any
    ) -> dict[str, Any]:
        return {
            **self._run_fields(ctx),
            "tool_name": call.tool_name,
            "tool_input": tool_input,
            "tool_call_id": call.tool_call_id,
        }

    @staticmethod
    def _key(ctx: RunContext[AgentDepsT], event: str, call: ToolCallPart | None = None) -> str:
        """The emit's idempotency key: a retried emit of the same call (same run id and tool
        call id, e.g. a durable run re-executed) finds its approval and its answer."""
        base = f"pydantic-ai:{ctx.run_id}:{event}"
        return base if call is None else f"{base}:{call.tool_call_id}"

    @staticmethod
    def _revalidate(
        ctx: RunContext[AgentDepsT], call: ToolCallPart, new_input: Any, result: HookResult
    ) -> dict[str, Any]:
        by = result.decided_by or (result.modified_by[-1] if result.modified_by else "a hook")
        if not isinstance(new_input, dict):
            raise SkipToolExecution(
                f"Denied by hook: {by} replaced the arguments with a"
                f" {type(new_input).__name__}, not an object"
            )
        tools = ctx.tool_manager.tools if ctx.tool_manager is not None else None
        tool = tools.get(call.tool_name) if tools else None
        if tool is None:
            return new_input
        try:
            validated = tool.args_validator.validate_python(
                new_input, context=ctx.validation_context
            )
        except ValidationError as exc:
            raise SkipToolExecution(
                f"Denied by hook: {by} replaced the arguments with invalid ones: {exc}"
            ) from None
        return validated if isinstance(validated, dict) else new_input

    def _inject(self, ctx: RunContext[AgentDepsT], result: HookResult) -> None:
        """Queue the result's injections for the next model request (`RunContext.enqueue`):
        `HookInjectionPart`s, or on a pydantic-ai without `CapabilityPart` a `SystemPromptPart`
        (``system``, ``assistant``) or a `UserPromptPart` (``user``) each."""
        injections = _injections(result)
        if not injections:
            return
        if not CAPABILITY_PARTS:
            ctx.enqueue(*(_legacy_part(*injection) for injection in injections))
            return
        parts = [self._injection_part(*injection) for injection in injections]
        try:
            ctx.enqueue(*parts)
            return
        except UserError:
            # pydantic-ai refuses text that looks like a framework frame (a `<system>` tag) in
            # the application's voice, and queues nothing: find which part, and send it as data
            if not any(part.source.authority == "operator" for part in parts):
                raise
        for part in parts:
            try:
                ctx.enqueue(part)
            except UserError:
                if part.source.authority != "operator":
                    raise
                ctx.enqueue(dataclasses.replace(part, source=self._source("none")))
                log.warning(
                    "%s injected text that pydantic-ai refuses in the application's voice (it"
                    " looks like a framework frame, such as a <system> tag): the model reads it"
                    " as data, without authority",
                    part.handler or "a hook",
                )

    def _injection_part(
        self, content: str, role: InjectionRole, ephemeral: bool, handler: str | None
    ) -> HookInjectionPart:
        """One injection as a `HookInjectionPart`: the ``system`` and ``assistant`` roles in the
        application's voice, ``user`` at the user's authority (see the module docstring)."""
        return HookInjectionPart(
            content=OperatorText(content),
            source=self._source("user") if role == "user" else OperatorSource(),
            scope="request" if ephemeral else "conversation",
            handler=handler,
            role=role,
            metadata={"hookbus": {"handler": handler, "role": role}},
        )

    def _source(self, authority: Literal["user", "none"]) -> CapabilitySource:
        """The source of an injection below the application's authority: this capability,
        named by its `id` (else ``hookbus``) in pydantic-ai's notes about it."""
        return CapabilitySource(self.id or "hookbus", authority=authority)


# -- module helpers ------------------------------------------------------------------------
def _legacy_part(
    content: str, role: InjectionRole, ephemeral: bool, handler: str | None
) -> ModelRequestPart:
    """One injection on a pydantic-ai without `CapabilityPart`: a `UserPromptPart` for the
    ``user`` role (``ephemeral`` does not apply), else a `SystemPromptPart`."""
    if role == "user":
        return UserPromptPart(content)
    return SystemPromptPart(
        content,
        scope="request" if ephemeral else "conversation",
        metadata={"hookbus": {"handler": handler, "role": role}},
    )


def _runs_approvals(dispatcher: HookDispatcher) -> bool:
    try:
        dispatcher.approvals  # noqa: B018  (raises when approvals are off or not started)
    except HookbusError:
        return False
    return True


def _prompt_text(prompt: str | Sequence[Any] | None) -> str | None:
    """The user prompt as text: a string as is, the string parts of a multi-part prompt
    joined by a blank line (images and other content are not sent)."""
    if prompt is None or isinstance(prompt, str):
        return prompt
    return "\n\n".join(p for p in prompt if isinstance(p, str))


def _as_deny(result: HookResult, event: str, approvals: ApprovalMode) -> HookResult:
    """`result` as a deny with its reason (an unanswerable ``ask_user`` says why)."""
    why = (
        "approvals='deferred' defers tool calls only (tool:pre)"
        if approvals == "deferred"
        else "the dispatcher does not run hookbus approvals (a connected, started"
        " HookDispatcher with approvals on does)"
    )
    return as_deny(result, event, why, log=log)


def _approval_metadata(result: HookResult) -> dict[str, Any]:
    """What `DeferredToolRequests.metadata` carries for an ``ask_user`` (amplifier-core's
    approval fields)."""
    return {
        "prompt": result.approval_prompt,
        "options": result.approval_options,
        "timeout_s": result.approval_timeout,
        "default": result.approval_default,
        "reason": result.reason,
        "handler": result.decided_by,
    }


def _replace_prompt(messages: list[Any], prompt: Any, new_prompt: Any, result: HookResult) -> None:
    """Rewrite the user prompt part of the last request in place (history included)."""
    if not isinstance(new_prompt, str) or not isinstance(prompt, str):
        raise HookbusError(
            f"prompt:submit: {result.decided_by or 'a hook'} modified the prompt, which can only"
            " be replaced by text, in a run whose prompt is text"
        )
    for message in reversed(messages):
        if not isinstance(message, ModelRequest):
            continue
        for part in message.parts:
            if isinstance(part, UserPromptPart) and part.content == prompt:
                part.content = new_prompt
                return
        break
    raise HookbusError("prompt:submit modified the prompt, but its part is not in this request")
