"""hookbus as the hook layer of an OpenAI Agents SDK agent: `HookbusGuard`.

``await HookbusGuard(dispatcher).run(agent, "pay invoice 7")`` runs ``agents.Runner.run``
with every function tool of the agent governed by hookbus handlers anywhere on NATS, through
a `HookDispatcher` the application started:

==================================  ===============  ========================================
where                               hookbus event    data (besides ``run_id``, ``session_id``)
==================================  ===============  ========================================
`HookbusGuard.run`, before the run  ``prompt:submit`` ``prompt`` (a text input only)
the tool's ``on_invoke_tool``       ``tool:pre``     ``tool_name``, ``tool_input``,
                                                     ``tool_call_id``
the same, after the tool returned   ``tool:post``    the same and ``tool_result``
==================================  ===============  ========================================

The seam is the tool's ``on_invoke_tool``: `HookbusGuard.tool` returns a copy of a
`agents.FunctionTool` whose invoker emits ``tool:pre``, calls the tool's own invoker (its
argument parsing and validation, its failure handling) and emits ``tool:post``. The SDK's
``RunHooks.on_tool_start`` cannot stop a tool, and its tool input guardrails can reject a
call but not rewrite its arguments; the invoker can do both. ``tool_input`` is the call's
arguments parsed from JSON (the raw text when they are not JSON); ``tool_result`` is the
tool's output as JSON (`pydantic_core.to_jsonable_python`; values JSON cannot hold become
strings). ``agent_id`` comes from the dispatcher (pinned ``agent_id`` or default fields).

What each action does (the dispatcher's fold decides the action, and a handler's failure is
judged by that handler's failure policy, in the dispatcher; nothing is re-decided here):

- ``deny`` on ``tool:pre``: the tool never runs; the model reads ``"Denied by hook:
  <reason>"`` as its output. On ``tool:post``: the tool has run, but the model reads ``"Tool
  result withheld by hook: <reason>"`` instead of its output. On ``prompt:submit``:
  `HookDeniedError` is raised and the run does not start.
- ``modify``: the final chained data's ``tool_input`` replaces the arguments, checked
  against the tool's ``params_json_schema`` (arguments that do not validate deny the call,
  the reason says why) and then parsed by the tool as the model's would be; ``tool_result``
  on ``tool:post`` replaces the output the model reads; ``prompt`` on ``prompt:submit``
  replaces a text input. The final data is read from ``result.chained_data``
  (`hookbus.integrations._emit.final_data`), so a fold that ends a modify chain as
  ``continue`` works alike.
- ``inject_context``: on ``prompt:submit`` each injection is an input message before the
  prompt, in its role (``system``, ``user`` or ``assistant``). On ``tool:pre`` and
  ``tool:post`` (the SDK lets a tool add no message mid-run) each is appended to the text the
  model reads for that call's output, framed ``<hook_injection handler="..." role="...">``;
  the role is named, not applied, and ``ephemeral`` does not apply (the output stays in the
  history).
- ``ask_user``: the dispatcher turns it into a durable hookbus approval (JetStream KV,
  answered from any process with `HookDispatcher.answer_approval` or ``hookbus approvals
  answer``) and returns the answer as continue or deny; the tool waits. A dispatcher without
  approvals cannot answer it: a deny, with a reason saying why. A tool's
  ``timeout_seconds`` bounds that wait too (the SDK times the whole invoker).

Faults: an emit that raises (`NotConnectedError` when the connection is closed,
`PayloadTooLargeError`, ...) propagates out of the tool and ends the run (the SDK raises it
as ``agents.exceptions.UserError`` from it): a tool whose ``tool:pre`` could not be decided
never runs.

Idempotency: every emit's key is ``openai-agents:<run id>:<event>[:<tool call id>]``. The run
id is `HookbusGuard.run`'s ``run_id``, a fresh one for each run unless given: a resumed run
(the same ``run_id``, e.g. from the SDK's `RunState`) replaying a call finds its approval
and its answer; another run never does, even when the model reuses a call id. A governed
tool invoked outside `HookbusGuard.run` (a plain ``Runner.run``) emits under a fresh run id
for each call. ``session_id`` is the guard's, else the run id.
"""

from __future__ import annotations

import contextvars
import copy
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema
from agents import Agent, FunctionTool, Runner, RunResult
from agents.tool_context import ToolContext

from hookbus.schemas import PROMPT_SUBMIT, TOOL_POST, TOOL_PRE, HookbusError

from ._emit import (
    NO_APPROVALS,
    FrameworkHooks,
    HookDeniedError,
    as_deny,
    denied,
    denied_text,
    final_data,
    framed_injections,
    injections,
    jsonable,
    withheld_text,
)

__all__ = ["EVENTS", "HookDeniedError", "HookbusGuard"]

log = logging.getLogger("hookbus.integrations.openai_agents")

EVENTS = (PROMPT_SUBMIT, TOOL_PRE, TOOL_POST)
"""The events a `HookbusGuard` emits, in lifecycle order."""

_KEY_PREFIX = "openai-agents"


@dataclass(frozen=True)
class _Run:
    run_id: str
    session_id: str


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "hookbus_openai_agents_run", default=None
)
"""The run `HookbusGuard.run` is running (the SDK runs tools in tasks that copy it)."""


class HookbusGuard(FrameworkHooks):
    """Runs OpenAI Agents SDK agents with their lifecycle on hookbus (see the module
    docstring for the events and what each action does).

    Args:
        dispatcher: a started `HookDispatcher` (connected, so remote handlers are called and
            ``ask_user`` is a durable approval). It stays the caller's: the guard neither
            starts nor closes it.
        session_id: the ``session_id`` of every event; None: the run id.
        timeout_s: overall deadline of each emit in seconds (all its handlers, and an
            approval's wait); None: only each handler's own timeout applies.
        timeouts: per-event deadlines in seconds (``{"tool:pre": 30.0}``), over `timeout_s`.

    Raises:
        TypeError: `dispatcher` is not a `HookDispatcher`.
        ValueError: an empty `session_id`, a timeout that is not a finite number of seconds
            above 0, or a `timeouts` key that is not one of `EVENTS`.
    """

    _events = EVENTS

    # -- governing tools and agents --------------------------------------------------------
    def tool(self, tool: FunctionTool) -> FunctionTool:
        """A copy of `tool` whose calls emit ``tool:pre`` and ``tool:post`` through this
        guard (`tool` itself is unchanged); a tool this guard already governs as is.

        Raises:
            TypeError: `tool` is not a `agents.FunctionTool` (hosted tools run at the
                provider, where no hook can stop them).
        """
        if not isinstance(tool, FunctionTool):
            raise TypeError(
                f"hookbus governs function tools only, not {type(tool).__name__}"
                f" ({getattr(tool, 'name', '?')!r}): a tool it cannot stop is not given to the"
                " agent"
            )
        invoker = tool.on_invoke_tool
        if isinstance(invoker, _GovernedInvoker) and invoker.guard is self:
            return tool
        governed = copy.copy(tool)
        governed.on_invoke_tool = _GovernedInvoker(self, governed, governed.on_invoke_tool)
        return governed

    def agent(self, agent: Agent[Any]) -> Agent[Any]:
        """A clone of `agent` (``Agent.clone``) whose tools are governed (`tool`), as are
        the agents it hands off to (directly listed `Agent` handoffs, recursively).

        Raises:
            TypeError: a tool is not a `agents.FunctionTool` (see `tool`).
        """
        return self._agent(agent, {})

    def _agent(self, agent: Agent[Any], done: dict[int, Agent[Any]]) -> Agent[Any]:
        if id(agent) in done:
            return done[id(agent)]
        clone = agent.clone(tools=[self.tool(t) for t in agent.tools])  # type: ignore[arg-type]
        done[id(agent)] = clone
        clone.handoffs = [
            self._agent(h, done) if isinstance(h, Agent) else h for h in agent.handoffs
        ]
        return clone

    # -- runs ------------------------------------------------------------------------------
    async def run(
        self, agent: Agent[Any], input: Any, *, run_id: str | None = None, **kwargs: Any
    ) -> RunResult:
        """``Runner.run(self.agent(agent), input, **kwargs)`` as the run `run_id`.

        Args:
            agent: the agent (governed here: `agent`).
            input: what ``Runner.run`` takes (text, input items, or a `RunState` to resume).
                A text input is emitted as ``prompt:submit`` first (a resumed run is not
                submitted again).
            run_id: the run's id in every event and idempotency key; None: a fresh one
                (``uuid4`` hex). Give the same id to resume the same run.
            kwargs: ``Runner.run``'s other arguments (``context``, ``max_turns``, ...).

        Returns:
            ``Runner.run``'s `RunResult`.

        Raises:
            HookDeniedError: ``prompt:submit`` was denied.
            HookbusError: an emit could not decide (`NotConnectedError`, ...), or a
                ``prompt:submit`` modify gave a prompt that is not text.
            ValueError: an empty `run_id`.
            Exception: whatever ``Runner.run`` raises.
        """
        if run_id is not None and (not isinstance(run_id, str) or not run_id):
            raise ValueError("run_id must be a non-empty string or None")
        rid = run_id or uuid.uuid4().hex
        run = _Run(rid, self.session_id or rid)
        governed = self.agent(agent)
        token = _RUN.set(run)
        try:
            if isinstance(input, str):
                input = await self._prompt_submit(run, input)
            return await Runner.run(governed, input, **kwargs)
        finally:
            _RUN.reset(token)

    async def _prompt_submit(self, run: _Run, prompt: str) -> str | list[Any]:
        data = {"run_id": run.run_id, "session_id": run.session_id, "prompt": prompt}
        result = await self._emit(PROMPT_SUBMIT, data, _key(run, PROMPT_SUBMIT))
        if denied(result):
            raise HookDeniedError(
                PROMPT_SUBMIT, as_deny(result, PROMPT_SUBMIT, NO_APPROVALS, log=log)
            )
        new_prompt = final_data(result).get("prompt", prompt)
        if not isinstance(new_prompt, str):
            raise HookbusError(
                f"prompt:submit: {result.decided_by or 'a hook'} modified the prompt, which can"
                " only be replaced by text"
            )
        added = injections(result)
        if not added:
            return new_prompt
        items: list[Any] = [{"role": role, "content": content} for content, role, _, _ in added]
        return [*items, {"role": "user", "content": new_prompt}]


class _GovernedInvoker:
    """A function tool's ``on_invoke_tool`` behind ``tool:pre`` and ``tool:post``."""

    def __init__(self, guard: HookbusGuard, tool: FunctionTool, inner: Any) -> None:
        self.guard = guard
        self.tool = tool
        self.inner = inner

    async def __call__(self, ctx: ToolContext[Any], input: str) -> Any:
        run = _RUN.get()
        if run is None:  # a plain Runner.run: never share a key with another run
            fresh = uuid.uuid4().hex
            run = _Run(fresh, self.guard.session_id or fresh)
        try:
            args: Any = json.loads(input) if input else {}
        except ValueError:
            args = input
        fields = {
            "run_id": run.run_id,
            "session_id": run.session_id,
            "tool_name": ctx.tool_name,
            "tool_input": args,
            "tool_call_id": ctx.tool_call_id,
        }
        pre = await self.guard._emit(TOOL_PRE, fields, _key(run, TOOL_PRE, ctx.tool_call_id))
        if denied(pre):
            return denied_text(as_deny(pre, TOOL_PRE, NO_APPROVALS, log=log))
        new_args = final_data(pre).get("tool_input", args)
        if new_args != args:
            problem = self._invalid(new_args)
            if problem is not None:
                by = pre.decided_by or (pre.modified_by[-1] if pre.modified_by else "a hook")
                return f"Denied by hook: {by} replaced the arguments with {problem}"
            input, args = json.dumps(new_args), new_args
            # the SDK's arguments, parsed before the call, were the model's: parse these
            ctx._function_tool_arguments = None
        output = await self.inner(ctx, input)
        added = injections(pre)
        sent = jsonable(output)
        data = {**fields, "tool_input": args, "tool_result": sent}
        post = await self.guard._emit(TOOL_POST, data, _key(run, TOOL_POST, ctx.tool_call_id))
        if denied(post):
            return withheld_text(as_deny(post, TOOL_POST, NO_APPROVALS, log=log))
        new_output = final_data(post).get("tool_result", sent)
        if new_output != sent:
            output = new_output
        added += injections(post)
        if not added:
            return output
        text = output if isinstance(output, str) else json.dumps(jsonable(output))
        return framed_injections(text, added)

    def _invalid(self, new_args: Any) -> str | None:
        """Why `new_args` cannot be the tool's arguments (its ``params_json_schema``), or
        None."""
        if not isinstance(new_args, dict):
            return f"a {type(new_args).__name__}, not an object"
        schema = self.tool.params_json_schema
        validator = jsonschema.validators.validator_for(schema)(schema)
        error = jsonschema.exceptions.best_match(validator.iter_errors(new_args))
        return None if error is None else f"invalid ones: {error.message}"


def _key(run: _Run, event: str, call_id: str | None = None) -> str:
    """An emit's idempotency key: the run id first, so no two runs share one."""
    base = f"{_KEY_PREFIX}:{run.run_id}:{event}"
    return base if call_id is None else f"{base}:{call_id}"
