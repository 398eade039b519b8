"""Every tool call of a run emitted through a `HookDispatcher`, so the fleet's workers
decide it: ``tool:pre`` before the tool, ``tool:post`` or ``tool:error`` after it (the
rules the integrations share are in ``hookbus.integrations._emit``)."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic
from ai.agents import agent as ai_agent
from ai.types import messages as ai_messages

from hookbus.dispatcher import HookDispatcher, RunScope
from hookbus.schemas import TOOL_ERROR, TOOL_POST, TOOL_PRE, HookResult

from .._emit import (
    Injection,
    as_deny,
    denied,
    denied_text,
    emit_decision,
    final_data,
    framed_injections,
    injections,
    jsonable,
    withheld_text,
)
from .labels import HooksSettings, log
from .tool_approvals import ToolApprovals

__all__ = ["ToolCalls", "current_run_id"]


def current_run_id() -> str:
    """The current run's id (`HookbusHooks.run`'s scope); a run not entered through it gets
    a fresh one per call (its emits are never retries of another's)."""
    run = RunScope.current()
    return run.run_id if run is not None else uuid.uuid4().hex


class ToolCalls:
    """``ai``'s ``wrap_tool`` for the `HookbusHooks` whose settings are `settings`: each
    tool call decided by the dispatcher `governor` gives (see `HookbusHooks.wrap_tool`); a
    call granted by a tool approval (`approvals`) runs once per run."""

    def __init__(
        self,
        settings: HooksSettings,
        approvals: ToolApprovals,
        governor: Callable[[], Awaitable[HookDispatcher]],
    ) -> None:
        self._settings = settings
        self._approvals = approvals
        self._governor = governor

    async def wrap(self, call: Any, next: Any) -> Any:
        """The tool call `call` decided, run by `next` unless denied, its result decided;
        see `HookbusHooks.wrap_tool`."""
        label = self._approvals.take_granted(call.tool_call_id)
        if label is not None:
            ran = await self._approvals.ran(label)
            if ran is not None:
                parts = [ai_messages.ToolResultPart.model_validate(part) for part in ran]
                return ai_agent.tool_result(*parts)
        dispatcher = await self._governor()
        run_id = current_run_id()
        sent = jsonable(call.kwargs)
        fields = {
            "run_id": run_id,
            "session_id": self._settings.session_id or run_id,
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
                results = [p.model_dump(mode="json") for p in final.results]
                await self._approvals.mark_used(label, ran=results)
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
            dispatcher.emit, event, data, key=key, timeout_s=self._settings.emit_timeout_s
        )


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
