"""AOS method + params -> hookbus event + data, and modified data -> AOS params (pure, no I/O).

The public names (the event constants, `METHOD_EVENTS`, ...) are re-exported and documented by
`hookbus.integrations.aos`; docs/aos.md has the tables.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hookbus.schemas import PROMPT_COMPLETE, PROMPT_SUBMIT, TOOL_POST, TOOL_PRE

from ._aos_types import (
    A2AMessageParams,
    A2ARequestParams,
    AgentTriggerParams,
    KnowledgeRetrievalParams,
    MCPParams,
    MCPRawMessage,
    MemoryParams,
    MessageParams,
    StepContext,
    ToolCallRequestParams,
    ToolCallResultParams,
)

AOS_AGENT_TRIGGER = "aos:agent_trigger"
AOS_MEMORY_RETRIEVAL = "aos:memory_retrieval"
AOS_MEMORY_STORE = "aos:memory_store"
AOS_KNOWLEDGE_RETRIEVAL = "aos:knowledge_retrieval"
AOS_SYSTEM_MESSAGE = "aos:system_message"
AOS_MCP = "aos:mcp"
AOS_A2A = "aos:a2a"
AOS_EVENTS = frozenset(
    {AOS_AGENT_TRIGGER, AOS_MEMORY_RETRIEVAL, AOS_MEMORY_STORE, AOS_KNOWLEDGE_RETRIEVAL,
     AOS_SYSTEM_MESSAGE, AOS_MCP, AOS_A2A}
)  # fmt: skip

A2A_METHODS = (
    "message/send",
    "message/stream",
    "tasks/pushNotificationConfig/set",
    "tasks/pushNotificationConfig/get",
    "tasks/resubscribe",
    "tasks/cancel",
    "tasks/get",
    # the schema's spellings of three of them (the specification and A2A say "tasks/")
    "task/pushNotificationConfig/set",
    "task/pushNotificationConfig/get",
    "task/get",
)

MESSAGE_ROLE_EVENTS: Mapping[str, str] = {
    "user": PROMPT_SUBMIT,
    "agent": PROMPT_COMPLETE,
    "system": AOS_SYSTEM_MESSAGE,
}

METHOD_EVENTS: Mapping[str, str] = {
    "steps/agentTrigger": AOS_AGENT_TRIGGER,
    "steps/toolCallRequest": TOOL_PRE,
    "steps/toolCallResult": TOOL_POST,
    "steps/memoryContextRetrieval": AOS_MEMORY_RETRIEVAL,
    "steps/memoryStore": AOS_MEMORY_STORE,
    "steps/knowledgeRetrieval": AOS_KNOWLEDGE_RETRIEVAL,
    "protocols/MCP": AOS_MCP,
    "protocols/A2A": AOS_A2A,
    **{method: AOS_A2A for method in A2A_METHODS},
}

CONTEXT_FIELDS = ("agent_id", "session_id", "turn_id", "step_id", "user_id")


class ParamsError(ValueError):
    """The params (as sent, or as a handler modified them) are not the method's."""


@dataclass
class Step:
    """One AOS request mapped to hookbus: what is emitted and what is needed to map back."""

    method: str
    params: dict[str, Any]
    """The params as sent."""
    event: str
    data: dict[str, Any]
    """The event data: the params' own keys plus the flattened fields."""
    flat: dict[str, Any] = field(default_factory=dict)
    """The flattened fields that map back into the params if a handler changes them."""
    params_type: type = dict
    wrapped: str | None = None
    """MCP/A2A: the params key holding the raw protocol message; None if params is it."""
    shadowed: frozenset[str] = frozenset()
    """Keys of the params that a hookbus field of the same name replaced in the data."""


def _check(params: dict[str, Any], params_type: type) -> Any:
    try:
        return msgspec.convert(params, params_type)
    except msgspec.ValidationError as exc:
        raise ParamsError(str(exc).replace("`$", "`params", 1)) from None


def _context_fields(ctx: StepContext) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "agent_id": ctx.agent.id,
        "session_id": ctx.session.id,
        "turn_id": ctx.turnId,
        "step_id": ctx.stepId,
    }
    if ctx.user is not None:
        fields["user_id"] = ctx.user.id
    return fields


def _text(parts: list[Any]) -> str:
    return "\n".join(p["text"] for p in parts if isinstance(p, dict) and p.get("kind") == "text")


_STEP_TYPES: dict[str, type] = {
    "steps/agentTrigger": AgentTriggerParams,
    "steps/toolCallRequest": ToolCallRequestParams,
    "steps/toolCallResult": ToolCallResultParams,
    "steps/message": MessageParams,
    "steps/memoryContextRetrieval": MemoryParams,
    "steps/memoryStore": MemoryParams,
    "steps/knowledgeRetrieval": KnowledgeRetrievalParams,
}


def is_decision_method(method: str) -> bool:
    """Whether `method` is answered with an AOS decision (every method but ``ping``)."""
    return method in _STEP_TYPES or method in METHOD_EVENTS


def build(
    method: str, params: dict[str, Any], request_id: str | int | None,
    events: Mapping[str, str] | None = None,
) -> Step:  # fmt: skip
    """Validate `params` for `method` and make the event and its data.

    `events` overrides `METHOD_EVENTS` / `MESSAGE_ROLE_EVENTS` (keys: a method, or
    ``"steps/message:<role>"``). Raises `ParamsError` (with the JSON path) on bad params.
    """
    events = events or {}
    flat: dict[str, Any] = {}
    wrapped: str | None = None
    extra: dict[str, Any] = {"aos_method": method}
    if request_id is not None:
        extra["aos_request_id"] = request_id
    params_type: type = _STEP_TYPES.get(method, dict)
    if method in _STEP_TYPES:
        extra.update(_context_fields(_check(params, params_type).context))
    if method == "steps/message":
        role = params["message"]["role"]
        event = events.get(f"{method}:{role}", MESSAGE_ROLE_EVENTS[role])
        extra["role"] = role
        flat["prompt" if role == "user" else "response"] = _text(params["message"]["content"])
    else:
        event = events.get(method, METHOD_EVENTS[method])
    if method == "steps/toolCallRequest":
        call = params["toolCallRequest"]
        flat["tool_name"] = call["toolId"]
        flat["tool_input"] = {item["name"]: item["value"] for item in call["inputs"]}
        extra["tool_call_id"] = call["executionId"]
    elif method == "steps/toolCallResult":
        done = params["toolCallResult"]
        extra["tool_call_id"] = done["executionId"]
        flat["tool_result"] = done["result"]
        if isinstance(done.get("toolId"), str):
            flat["tool_name"] = done["toolId"]
    elif method == "protocols/MCP":
        if isinstance(params.get("message"), dict):
            params_type, wrapped = MCPParams, "message"
        else:
            params_type = MCPRawMessage
        _check(params, params_type)
        message = params[wrapped] if wrapped else params
        flat["mcp_message"] = message
        if isinstance(message.get("method"), str):
            extra["mcp_method"] = message["method"]
        inner = message.get("params")
        if message.get("method") == "tools/call" and isinstance(inner, dict):
            if isinstance(inner.get("name"), str):
                flat["tool_name"] = inner["name"]
            if isinstance(inner.get("arguments"), dict):
                flat["tool_input"] = inner["arguments"]
    elif method == "protocols/A2A":
        params_type, wrapped = A2AMessageParams, "message"
    elif method in A2A_METHODS:
        params_type, wrapped = A2ARequestParams, "payload"
    if wrapped is not None and method != "protocols/MCP":  # an A2A method
        _check(params, params_type)
        flat["a2a_message"] = params[wrapped]
        a2a_method = params[wrapped].get("method") if method == "protocols/A2A" else method
        if isinstance(a2a_method, str):
            extra["a2a_method"] = a2a_method
    data = {**params, **extra, **flat}
    shadowed = frozenset(set(params) & (set(extra) | set(flat)))
    return Step(method, params, event, data, flat, params_type, wrapped, shadowed)


def _set_text(message: dict[str, Any], text: Any) -> dict[str, Any]:
    if not isinstance(text, str):
        raise ParamsError("the modified message text must be a string")
    parts: list[Any] = []
    placed = False
    for part in message.get("content") or []:
        if isinstance(part, dict) and part.get("kind") == "text":
            if not placed:
                parts.append({**part, "text": text})
                placed = True
            continue
        parts.append(part)
    if not placed:
        parts.append({"kind": "text", "text": text})
    return {**message, "content": parts}


def _set_inputs(call: dict[str, Any], tool_input: Any) -> dict[str, Any]:
    if not isinstance(tool_input, dict):
        raise ParamsError("the modified tool_input must be an object")
    inputs: list[Any] = []
    for item in call.get("inputs") or []:
        name = item.get("name") if isinstance(item, dict) else None
        if name in tool_input:
            inputs.append({**item, "value": tool_input[name]})
    present = {i["name"] for i in inputs}
    inputs.extend({"name": n, "value": v} for n, v in tool_input.items() if n not in present)
    return {**call, "inputs": inputs}


def _set_mcp_call(message: Any, final: dict[str, Any], flat: dict[str, Any]) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("params"), dict):
        return message
    inner = dict(message["params"])
    for key, name in (("tool_name", "name"), ("tool_input", "arguments")):
        if key in flat and final.get(key) != flat[key]:
            inner[name] = final.get(key)
    return {**message, "params": inner}


def rebuild(step: Step, final: dict[str, Any]) -> dict[str, Any]:
    """The params of `step` rebuilt from the event's final data `final` (a deep copy).

    The params' own keys are taken from `final` (a key a handler removed is removed); then a
    flattened field a handler changed is written back into its place (it wins over an edit of
    the same place in the params). Raises `ParamsError` if the result is not valid params of
    the method (the door then denies).
    """
    flat = step.flat
    new: dict[str, Any] = {k: copy.deepcopy(final[k]) for k in step.params if k in final}
    for key in step.shadowed:
        new[key] = copy.deepcopy(step.params[key])

    def changed(key: str) -> bool:
        return key in flat and key in final and final[key] != flat[key]

    method = step.method
    if method == "steps/message" and isinstance(new.get("message"), dict):
        for key in ("prompt", "response"):
            if changed(key):
                new["message"] = _set_text(new["message"], final[key])
    elif method == "steps/toolCallRequest" and isinstance(new.get("toolCallRequest"), dict):
        if changed("tool_input"):
            new["toolCallRequest"] = _set_inputs(new["toolCallRequest"], final["tool_input"])
        if changed("tool_name"):
            new["toolCallRequest"] = {**new["toolCallRequest"], "toolId": final["tool_name"]}
    elif method == "steps/toolCallResult" and isinstance(new.get("toolCallResult"), dict):
        if changed("tool_result"):
            new["toolCallResult"] = {**new["toolCallResult"], "result": final["tool_result"]}
        if changed("tool_name"):
            new["toolCallResult"] = {**new["toolCallResult"], "toolId": final["tool_name"]}
    elif method == "protocols/MCP":
        message = new.get(step.wrapped) if step.wrapped else new
        if changed("mcp_message"):
            message = copy.deepcopy(final["mcp_message"])
        message = _set_mcp_call(message, final, flat)
        if step.wrapped:
            new[step.wrapped] = message
        elif isinstance(message, dict):
            new = message
    elif step.wrapped and changed("a2a_message"):
        new[step.wrapped] = copy.deepcopy(final["a2a_message"])
    _check(new, step.params_type)
    return new
