"""hookbus as the tool hook layer of a LangGraph agent: `HookbusToolHooks`.

``HookbusToolHooks(dispatcher).tool_node(tools)`` is a `langgraph.prebuilt.ToolNode` whose
``awrap_tool_call`` hook emits every tool call of the graph on hookbus, through a
`HookDispatcher` the application started, and applies the folded `HookResult` (an existing
``ToolNode`` takes the same hooks: ``ToolNode(tools, wrap_tool_call=h.wrap_tool_call,
awrap_tool_call=h.awrap_tool_call)``). Every tool call of the node emits:

==========================  ===============  =============================================
when                        hookbus event    data (besides ``run_id``, ``session_id``)
==========================  ===============  =============================================
before the tool             ``tool:pre``     ``tool_name``, ``tool_input``, ``tool_call_id``
the tool returned           ``tool:post``    the same and ``tool_result``
the tool failed             ``tool:error``   the same and ``error`` (``type``, ``msg``)
==========================  ===============  =============================================

``session_id`` is the hooks' `session_id`, else the graph's thread (``thread_id`` of
``config["configurable"]``: a thread spans the turns of one conversation, as an
amplifier-core session does; "Allow always" grants are per session), else the run id.
``run_id`` is the caller's ``config["run_id"]`` if it gave one, else the tool node's task
(its ``checkpoint_ns``, ``tools:<task id>``: one per step of the graph). ``tool_input`` is the
tool call's ``args``; ``tool_result`` is the content of the `ToolMessage` the model reads
(text, or a list of content blocks; a tool that returns a `Command` sends it as JSON).
``agent_id`` comes from the dispatcher.

**Idempotency keys** are ``langgraph:<thread_id>:<checkpoint_ns>:<event>:<tool call id>``.
LangGraph derives a task's id from the checkpoint it runs from, so a graph resumed from its
checkpointer after a crash replays the call under the same key and finds its approval and
its answer; the next turn of the same thread runs from a new checkpoint, so a model that
reuses a tool call id (``call_1`` in every turn) never meets an earlier answer, and neither
does another thread. A call outside a graph (no ``checkpoint_ns``) gets a key of its own.

What each action does (the dispatcher's fold decides the action, and a handler's failure is
judged by that handler's failure policy, in the dispatcher; nothing is re-decided here):

- ``deny`` on ``tool:pre``: the tool never runs; the model reads a `ToolMessage` (status
  ``error``) ``"Denied by hook: <reason>"``. On ``tool:post``: the tool has run, its result
  is withheld: ``"Tool result withheld by hook: <reason>"`` (a `Command` the tool returned
  is dropped with it). ``tool:error`` is an observation: its deny changes nothing.
- ``modify``: the final chained data's ``tool_input`` replaces the call's ``args`` (the tool
  validates them: arguments that do not validate fail the call as LangGraph fails it, with
  ``tool:error`` emitted, and the tool does not run; a ``tool_input`` that is not an object
  denies the call); ``tool_result`` on ``tool:post`` replaces the content the model reads
  (text as is, anything else as JSON). A new ``tool_result`` for a tool that returned a
  `Command` raises `HookbusError`. The final data is `HookResult.chained_data`.
- ``inject_context``: the injections of ``tool:pre``, ``tool:post`` and ``tool:error`` are
  appended to the text of the call's `ToolMessage`, framed ``<hook_injection handler="..."
  role="...">...</hook_injection>`` (amplifier-core's ``append_to_last_tool_result``; a
  message of its own between the tool results of one model turn is refused by most chat
  APIs). A tool that returns a `Command` gets no injection (a warning is logged).
- ``ask_user``: the dispatcher turns it into a durable hookbus approval (JetStream KV,
  answered from any process with `HookDispatcher.answer_approval`, ``hookbus approvals
  answer`` or ``hookbus console``) and returns the answer as continue or deny; the tool
  waits. With a durable checkpointer, a process that dies while it waits loses nothing: the
  graph resumed on the same thread (``graph.ainvoke(None, config)``) asks the same approval
  again under the same key and gets its answer, even one given while nobody waited. An
  ``ask_user`` that comes back unanswered (a dispatcher without approvals) is a deny, with
  a reason saying why.

Faults: an emit that raises (`NotConnectedError` when the connection is closed,
`PayloadTooLargeError`, ...) propagates out of the wrapper: the tool never runs, and the
``ToolNode``'s ``handle_tool_errors`` decides what follows (its default raises it and ends
the run; ``handle_tool_errors=True`` turns it into an error `ToolMessage`). Interrupts
raised by a tool (`langgraph.types.interrupt`) pass through untouched.

The graph must run asynchronously (``ainvoke``, ``astream``): the dispatcher is
asynchronous. `HookbusToolHooks.wrap_tool_call`, the synchronous hook, refuses every call
(`HookbusError`, the tool does not run); give it to the ``ToolNode`` too, as `tool_node`
does, so that a synchronous ``invoke`` cannot run a tool unchecked.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langgraph.errors import GraphBubbleUp
from langgraph.prebuilt import ToolNode
from langgraph.prebuilt.tool_node import ToolCallRequest, msg_content_output
from langgraph.types import Command

from hookbus.schemas import TOOL_ERROR, TOOL_POST, TOOL_PRE, HookbusError, HookResult

from ._emit import (
    NO_APPROVALS,
    FrameworkHooks,
    Injection,
    as_deny,
    denied,
    denied_text,
    final_data,
    framed_injections,
    injections,
    jsonable,
    withheld_text,
)

__all__ = ["EVENTS", "HookbusToolHooks"]

log = logging.getLogger("hookbus.integrations.langgraph")

EVENTS = (TOOL_PRE, TOOL_POST, TOOL_ERROR)
"""The events these hooks emit, in lifecycle order."""


ToolOutput = ToolMessage | Command[Any]
Execute = Callable[[ToolCallRequest], Awaitable[ToolOutput]]


class HookbusToolHooks(FrameworkHooks):
    """The ``ToolNode`` hooks that emit each tool call on hookbus and apply the handlers'
    decisions (see the module docstring for the events and each action).

    Args:
        dispatcher: a started `HookDispatcher` (connected, so remote handlers are called;
            made with no connection it runs in-process handlers only). It stays the caller's:
            the hooks neither start nor close it.
        session_id: the ``session_id`` of every event; None: the graph's ``thread_id``.
        timeout_s: overall deadline of each emit in seconds (all its handlers, and an
            approval's wait); None: only each handler's own timeout applies.
        timeouts: per-event deadlines in seconds (``{"tool:pre": 30.0}``), over `timeout_s`.

    Raises:
        TypeError: `dispatcher` is not a `HookDispatcher`.
        ValueError: an empty `session_id`, a timeout that is not a finite number of seconds
            above 0, or a `timeouts` key that is not an event these hooks emit.
    """

    _events = EVENTS

    def tool_node(self, tools: Sequence[BaseTool | Callable[..., Any]], **options: Any) -> ToolNode:
        """A `ToolNode` of `tools` with these hooks (`options` are the ``ToolNode``'s own:
        ``name``, ``handle_tool_errors``, ``messages_key``, ...).

        Raises:
            TypeError: `options` set ``wrap_tool_call`` or ``awrap_tool_call``.
        """
        taken = sorted({"wrap_tool_call", "awrap_tool_call"} & set(options))
        if taken:
            raise TypeError(f"tool_node sets {', '.join(taken)} itself")
        return ToolNode(
            tools,
            wrap_tool_call=self.wrap_tool_call,
            awrap_tool_call=self.awrap_tool_call,
            **options,
        )

    def wrap_tool_call(self, request: ToolCallRequest, execute: Any) -> ToolOutput:
        """The synchronous hook: refuses the call (the dispatcher is asynchronous).

        Raises:
            HookbusError: always; the tool does not run.
        """
        raise HookbusError(
            f"tool:pre of {request.tool_call['name']!r} cannot be emitted from a synchronous"
            " graph run: run the graph with ainvoke or astream (the tool did not run)"
        )

    async def awrap_tool_call(self, request: ToolCallRequest, execute: Execute) -> ToolOutput:
        """The asynchronous hook (LangGraph's `AsyncToolCallWrapper`): ``tool:pre``, the tool
        (`execute`, at most once), then ``tool:post`` or ``tool:error``.

        Returns:
            The `ToolMessage` the model reads (a denial, the tool's result as the handlers
            left it), or the `Command` the tool returned.

        Raises:
            HookbusError: an emit that raised (`NotConnectedError`, ...), or a ``tool_result``
                modify of a `Command`. What the tool raised is raised again.
        """
        call = request.tool_call
        config: Mapping[str, Any] = getattr(request.runtime, "config", None) or {}
        ids = _Ids.of(config, call)
        sent = jsonable(call["args"])
        result = await self._emit(TOOL_PRE, self._fields(ids, call, sent), ids.key(TOOL_PRE))
        if denied(result):
            deny = as_deny(result, TOOL_PRE, NO_APPROVALS, log=log)
            return _message(call, denied_text(deny), status="error")
        new_input = final_data(result).get("tool_input", sent)
        if new_input != sent:
            if not isinstance(new_input, dict):
                by = _modifier(result)
                text = (
                    f"Denied by hook: {by} replaced the arguments with a"
                    f" {type(new_input).__name__}, not an object"
                )
                return _message(call, text, status="error")
            call = {**call, "args": new_input}
            request = request.override(tool_call=call)
        added = injections(result)
        fields = self._fields(ids, call, jsonable(call["args"]))
        try:
            output = await execute(request)
        except GraphBubbleUp:
            raise  # an interrupt (or another graph signal) of the tool: LangGraph's own
        except Exception as error:
            await self._emit(
                TOOL_ERROR,
                {**fields, "error": {"type": type(error).__name__, "msg": str(error)}},
                ids.key(TOOL_ERROR),
            )
            raise
        if isinstance(output, ToolMessage) and output.status == "error":
            # a failure the ToolNode turned into text (invalid arguments, handle_tool_errors)
            error = {"type": "ToolError", "msg": _text(output.content)}
            decision = await self._emit(TOOL_ERROR, {**fields, "error": error}, ids.key(TOOL_ERROR))
            if decision.action != "deny":
                added += injections(decision)
            return _with_injections(output, added)
        return await self._tool_post(ids, call, fields, output, added)

    async def _tool_post(
        self,
        ids: _Ids,
        call: Mapping[str, Any],
        fields: dict[str, Any],
        output: Any,
        added: list[Injection],
    ) -> ToolOutput:
        is_message = isinstance(output, ToolMessage)
        sent = jsonable(output.content if is_message else output)
        data = {**fields, "tool_result": sent}
        decision = await self._emit(TOOL_POST, data, ids.key(TOOL_POST))
        if denied(decision):
            deny = as_deny(decision, TOOL_POST, NO_APPROVALS, log=log)
            return _message(call, withheld_text(deny))
        added += injections(decision)
        new_result = final_data(decision).get("tool_result", sent)
        if not is_message:
            if new_result != sent:
                raise HookbusError(
                    f"tool:post: {_modifier(decision)} modified the result of"
                    f" {call['name']!r}, a {type(output).__name__} (only a ToolMessage's"
                    " content can be replaced)"
                )
            if added:
                log.warning(
                    "%d injection(s) for %r not delivered: the tool returned a %s, not a"
                    " ToolMessage",
                    len(added),
                    call["name"],
                    type(output).__name__,
                )
            return output  # type: ignore[no-any-return]
        if new_result != sent:
            output = output.model_copy(update={"content": msg_content_output(new_result)})
        return _with_injections(output, added)

    # -- helpers -------------------------------------------------------------------------

    def _fields(self, ids: _Ids, call: Mapping[str, Any], tool_input: Any) -> dict[str, Any]:
        return {
            "run_id": ids.run_id,
            "session_id": self.session_id or ids.thread_id or ids.run_id,
            "tool_name": call["name"],
            "tool_input": tool_input,
            "tool_call_id": ids.call_id,
        }


class _Ids:
    """What names a tool call in a graph: its thread, its task, its run and its id."""

    __slots__ = ("call_id", "namespace", "run_id", "thread_id")

    def __init__(self, thread_id: str | None, namespace: str, run_id: str, call_id: str) -> None:
        self.thread_id = thread_id
        self.namespace = namespace
        self.run_id = run_id
        self.call_id = call_id

    @classmethod
    def of(cls, config: Mapping[str, Any], call: Mapping[str, Any]) -> _Ids:
        configurable = config.get("configurable") or {}
        thread = configurable.get("thread_id")
        # the task's namespace: derived from the checkpoint it runs from (stable when the
        # graph is resumed, new in every turn); outside a graph, a name of this call's own
        namespace = configurable.get("checkpoint_ns") or f"call:{uuid.uuid4().hex}"
        run_id = config.get("run_id")
        call_id = call.get("id") or f"call:{uuid.uuid4().hex}"
        return cls(
            None if thread is None else str(thread),
            str(namespace),
            str(run_id) if run_id is not None else str(namespace),
            str(call_id),
        )

    def key(self, event: str) -> str:
        """The emit's idempotency key (see the module docstring)."""
        return f"langgraph:{self.thread_id or '-'}:{self.namespace}:{event}:{self.call_id}"


def _message(call: Mapping[str, Any], text: str, *, status: str = "success") -> ToolMessage:
    return ToolMessage(
        content=text, name=call["name"], tool_call_id=call.get("id") or "", status=status
    )


def _modifier(result: HookResult) -> str:
    return result.decided_by or (result.modified_by[-1] if result.modified_by else "a hook")


def _text(content: Any) -> str:
    """A `ToolMessage`'s content as text (its text blocks, joined)."""
    if isinstance(content, str):
        return content
    parts = [b if isinstance(b, str) else b.get("text", "") for b in content]
    return "\n".join(p for p in parts if p)


def _with_injections(message: ToolMessage, added: list[Injection]) -> ToolMessage:
    """`message` with `added` appended to its text (`framed_injections`); a content of
    blocks gets one more text block."""
    if not added:
        return message
    content = message.content
    if isinstance(content, str):
        new: Any = framed_injections(content, added)
    else:
        new = [*content, {"type": "text", "text": framed_injections("", added).lstrip("\n")}]
    return message.model_copy(update={"content": new})
