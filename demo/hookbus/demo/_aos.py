"""`hookbus demo --via aos`: each transcript step sent as an OWASP AOS JSON-RPC request.

The agent answers its steps through the AOS guardian door (`hookbus.integrations.aos.answer`)
in process, with its own dispatcher's emit (with ``--secure``: its emit through the
dispatcher service), instead of emitting the hookbus event itself. The transcript models
every step as the hookbus event its handlers govern, so each step is sent as the AOS method
whose event data carries what those handlers read:

======================  ===================================================================
transcript event        AOS request
======================  ===================================================================
``tool:pre``            ``steps/toolCallRequest``: ``toolId`` = ``tool_name``, ``inputs`` from
                        ``tool_input`` (a value that is not an object: one input ``input``)
``tool:post``           ``steps/toolCallResult``: ``toolId`` (hookbus's extension) =
                        ``tool_name``; ``result`` = ``tool_result`` if it is an AOS
                        ToolCallResult, else one text output with its JSON
``prompt:submit``       ``steps/message``, role ``user``, the prompt as a text part
``prompt:complete``     ``steps/message``, role ``agent``, the response as a text part
``session:start`` with  ``steps/agentTrigger``, sent to ``session:start`` (the door's event
a ``trigger``           override: AOS has no session events)
anything else           emitted directly (AOS has no method for it): shown as ``direct``
======================  ===================================================================

So the transcript's memory, knowledge and MCP steps (modelled there as tool calls of
``memory:store``, ``knowledge:search``, ``mcp:*``) go as AOS tool calls. The step's other
data keys (``reasoning``, ``citations``, ``mcp``) go into ``params``, where the door passes
them on; ``session_id`` becomes ``params.context.session.id``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import TYPE_CHECKING, Any

from hookbus.integrations.aos import MESSAGE_ROLE_EVENTS, METHOD_EVENTS, answer
from hookbus.schemas import HookResult

if TYPE_CHECKING:
    from hookbus.integrations import Emit

    from ._common import AgentScript, Step

__all__ = ["AosOutcome", "answer_step", "aos_request"]

_OWN = frozenset({"session_id", "tool_name", "tool_input", "tool_result", "role", "prompt",
                  "response", "trigger"})  # fmt: skip
"""Step data keys the request carries in AOS fields of their own."""


@dataclass
class AosOutcome:
    """One step answered through the AOS door."""

    method: str
    """The AOS method sent (with ``->event`` when the door's event map was overridden)."""
    reply: dict[str, Any] = field(default_factory=dict)
    """The door's JSON-RPC response."""
    result: HookResult | None = None
    """The dispatcher's folded result behind the AOS decision (None: the emit failed)."""
    sent: dict[str, Any] = field(default_factory=dict)
    """The event data the door emitted."""

    @property
    def decision(self) -> str:
        """``allow``, ``deny`` or ``modify``; ``error <code>`` for a JSON-RPC error."""
        if "error" in self.reply:
            return f"error {self.reply['error'].get('code')}"
        return str(self.reply.get("result", {}).get("decision", "?"))

    @property
    def message(self) -> str:
        if "error" in self.reply:
            error = self.reply["error"]
            return f"{error.get('message')}: {(error.get('data') or {}).get('detail', '')}"
        return str(self.reply.get("result", {}).get("message", ""))


def _context(script: AgentScript, step_no: int, step: Step) -> dict[str, Any]:
    try:
        version = metadata.version("hookbus")
    except metadata.PackageNotFoundError:
        version = "unknown"
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return {
        "agent": {
            "id": script.id,
            "name": script.name or script.id,
            "instructions": "replays the steps of examples/transcript.json",
            "version": version,
            "url": f"urn:hookbus:demo:{script.id}",
            "provider": {"name": "hookbus demo", "url": "urn:hookbus:demo"},
        },
        "session": {"id": step.data.get("session_id", script.session_id)},
        "turnId": f"{script.session_id}-turn",
        "stepId": f"step-{step_no}",
        "timestamp": now,
    }


def _tool_result(value: Any) -> dict[str, Any]:
    """`value` if it is an AOS ToolCallResult (text outputs, ``isError``), else one text
    output with its JSON."""
    outputs = value.get("outputs") if isinstance(value, dict) else None
    if (
        isinstance(value, dict)
        and isinstance(outputs, list)
        and isinstance(value.get("isError"), bool)
        and all(isinstance(o, dict) and o.get("kind") == "text" and isinstance(o.get("text"), str)
                for o in outputs)
    ):  # fmt: skip
        return value
    is_error = value.get("isError") if isinstance(value, dict) else None
    text = json.dumps(value, ensure_ascii=False)
    return {"outputs": [{"kind": "text", "text": text}], "isError": bool(is_error)}


def aos_request(
    script: AgentScript, step_no: int, step: Step
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The AOS request (a JSON-RPC object with a fresh id) step `step_no` of `script` is sent
    as, and the door's event override for it; None if AOS has no method for the step."""
    data = step.data
    extra = {k: v for k, v in data.items() if k not in _OWN}
    params: dict[str, Any] = {"context": _context(script, step_no, step)}
    key = ""  # the door's event map key: the method, or "steps/message:<role>"
    if step.event == "tool:pre":
        method = "steps/toolCallRequest"
        tool_input = data.get("tool_input")
        pairs = tool_input.items() if isinstance(tool_input, dict) else [("input", tool_input)]
        params["toolCallRequest"] = {
            "executionId": f"call-{step_no}",
            "toolId": str(data.get("tool_name", "")),
            "inputs": [{"name": str(k), "value": v} for k, v in pairs],
        }
    elif step.event == "tool:post":
        method = "steps/toolCallResult"
        params["toolCallResult"] = {
            "executionId": f"call-{step_no}",
            "toolId": str(data.get("tool_name", "")),
            "result": _tool_result(data.get("tool_result")),
        }
    elif step.event in ("prompt:submit", "prompt:complete"):
        method = "steps/message"
        role = "user" if step.event == "prompt:submit" else "agent"
        key = f"{method}:{role}"
        text = data.get("prompt" if role == "user" else "response")
        text = text if isinstance(text, str) else json.dumps(text)
        params["message"] = {
            "id": f"message-{step_no}",
            "role": role,
            "content": [{"kind": "text", "text": text}],
        }
    elif step.event == "session:start" and isinstance(data.get("trigger"), dict):
        method = "steps/agentTrigger"
        params["trigger"] = data["trigger"]
    else:
        return None
    params.update(extra)
    key = key or method
    role_event = MESSAGE_ROLE_EVENTS.get(key.rpartition(":")[2]) if key != method else None
    events = {} if (role_event or METHOD_EVENTS.get(method)) == step.event else {key: step.event}
    request = {"jsonrpc": "2.0", "id": uuid.uuid4().hex, "method": method, "params": params}
    return request, events


async def answer_step(
    emit_as_agent: Emit, script: AgentScript, step_no: int, step: Step
) -> AosOutcome | None:
    """Send the step through the AOS door with `emit_as_agent` (the agent's dispatcher's
    emit, or with ``--secure`` its emit through the dispatcher service); None if AOS has no
    method for it (the caller emits it directly)."""
    made = aos_request(script, step_no, step)
    if made is None:
        return None
    request, events = made
    label = request["method"] + "".join(f" -> {e}" for e in events.values())
    outcome = AosOutcome(method=label)

    async def emit(
        event: str,
        data: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        timeout_s: float | None = None,
    ) -> HookResult:
        outcome.sent = data
        outcome.result = await emit_as_agent(
            event, data, idempotency_key=idempotency_key, timeout_s=timeout_s
        )
        return outcome.result

    reply = await answer(json.dumps(request).encode(), emit, events=events)
    outcome.reply = json.loads(reply) if reply is not None else {}
    return outcome
