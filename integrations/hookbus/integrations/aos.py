"""The OWASP Agent Observability Standard (AOS) guardian door: AOS JSON-RPC in, hookbus out.

An AOS agent sends each step of its work (a tool call, a user message, a memory write, an MCP
message, ...) to a *guardian agent* as a JSON-RPC 2.0 request and enforces the answer
(``allow``, ``deny`` or ``modify``). `answer` is that guardian: it maps the request to a
hookbus event, emits it through an `Emit` (``HookDispatcher.emit``, or a client of the
dispatcher service), and maps the folded `HookResult` back to an `AOSSuccessResponse`. The
HTTP server that carries it is another module's; `answer` takes and returns bytes.

Methods and events (`METHOD_EVENTS`, `MESSAGE_ROLE_EVENTS`):

=================================  ===========================
``steps/toolCallRequest``          ``tool:pre``
``steps/toolCallResult``           ``tool:post``
``steps/message`` (role user)      ``prompt:submit``
``steps/message`` (role agent)     ``prompt:complete``
``steps/message`` (role system)    ``aos:system_message``
``steps/agentTrigger``             ``aos:agent_trigger``
``steps/memoryContextRetrieval``   ``aos:memory_retrieval``
``steps/memoryStore``              ``aos:memory_store``
``steps/knowledgeRetrieval``       ``aos:knowledge_retrieval``
``protocols/MCP``                  ``aos:mcp``
`A2A_METHODS`, ``protocols/A2A``   ``aos:a2a``
``ping``                           answered here, nothing emitted
=================================  ===========================

The event data is the request's ``params`` as sent, plus flattened fields hookbus workers
read: ``aos_method``, ``aos_request_id``; from ``params.context``: ``agent_id``,
``session_id``, ``turn_id``, ``step_id``, ``user_id``; ``tool:pre``: ``tool_name``
(``toolId``), ``tool_input`` (the ``inputs`` as a name -> value object), ``tool_call_id``
(``executionId``); ``tool:post``: ``tool_call_id``, ``tool_result`` (``result``), and
``tool_name`` if the agent adds ``toolId`` beside ``executionId`` (a hookbus extension);
messages: ``role`` and ``prompt`` (user) or ``response`` (agent, system), the text parts joined
by newlines; MCP: ``mcp_message``, ``mcp_method``, and for ``tools/call`` ``tool_name`` and
``tool_input``; A2A: ``a2a_message``, ``a2a_method``. So the policies that govern ``tool:pre``
govern AOS tool calls unchanged.

Decisions (`HookResult` -> ``result.decision``): deny -> ``deny`` (``message`` = the reason);
ask_user not resolved by the dispatcher's approval gate -> ``deny``; continue or
inject_context whose data a handler changed (``modified_by``) so that the AOS params differ ->
``modify`` with ``modifiedRequest`` (the whole request, params rebuilt: ``tool_input`` back as
the ``inputs`` list, ``prompt``/``response`` back as the text part, ...); otherwise ``allow``
(an injected context is in ``data.hookbus.contextInjection``). ``reasoning`` is the result's
reason, ``reasonCode`` lists ``hookbus:<action>``, ``handler:<decided_by>``, ... Any failure
to decide (NATS unreachable, a timeout, a draining dispatcher, a bad modification, a bug) is
a ``deny`` with reason code ``hookbus:emit_failed:<kind>``: fail closed, never an error the
agent could read as "no guardian, go on". Details and the error codes: docs/aos.md.

An HTTP server refusing a request before `answer` reads it (a bad token, an oversize body)
answers with `refusal`: a JSON-RPC error response too, so every answer is one.

Source: OWASP AOS specification 0.1.0 (sections 4 methods, 5 responses, 6 errors) and its
``aos_schema.json`` (OWASP's, July 2025: tests/fixtures/aos/README.md); JSON-RPC 2.0
(notifications, error object).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

import msgspec

from hookbus.schemas import (
    MAX_NESTING,
    BadRequestError,
    HookbusError,
    HookbusTimeoutError,
    HookResult,
    NotConnectedError,
    PayloadTooLargeError,
    SuspensionAbortedError,
    UnknownEventError,
    WireFormatError,
    check_nesting,
)

from ._aos_map import (
    A2A_METHODS,
    AOS_A2A,
    AOS_AGENT_TRIGGER,
    AOS_EVENTS,
    AOS_KNOWLEDGE_RETRIEVAL,
    AOS_MCP,
    AOS_MEMORY_RETRIEVAL,
    AOS_MEMORY_STORE,
    AOS_SYSTEM_MESSAGE,
    MESSAGE_ROLE_EVENTS,
    METHOD_EVENTS,
    ParamsError,
    Step,
    build,
    is_decision_method,
    rebuild,
)
from ._aos_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    PARSE_ERROR,
    STANDARD_MESSAGES,
    AOSSuccessResponse,
    AOSSuccessResult,
    JSONRPCError,
    JSONRPCErrorResponse,
    PingParams,
    PingRequestResult,
    PingRequestSuccessResponse,
    StepContext,
)
from ._emit import Emit

__all__ = [
    "A2A_METHODS",
    "AOS_A2A",
    "AOS_AGENT_TRIGGER",
    "AOS_EVENTS",
    "AOS_KNOWLEDGE_RETRIEVAL",
    "AOS_MCP",
    "AOS_MEMORY_RETRIEVAL",
    "AOS_MEMORY_STORE",
    "AOS_SYSTEM_MESSAGE",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "MAX_BODY_BYTES",
    "MESSAGE_ROLE_EVENTS",
    "METHOD_EVENTS",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "AOSSuccessResponse",
    "AOSSuccessResult",
    "JSONRPCError",
    "JSONRPCErrorResponse",
    "PingRequestResult",
    "PingRequestSuccessResponse",
    "StepContext",
    "answer",
    "refusal",
]

log = logging.getLogger("hookbus.integrations.aos")

MAX_BODY_BYTES = 1024 * 1024
"""Largest request body `answer` reads (bytes): NATS's default max_payload, which the event
built from it has to fit in anyway."""

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode
_RETRYABLE = ("not_connected", "timeout", "aborted")


def _version() -> str:
    try:
        return metadata.version("hookbus")
    except metadata.PackageNotFoundError:
        return "unknown"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _error(rid: str | int | None, code: int, detail: str, **data: Any) -> bytes:
    body = {"detail": detail, **data}
    error = JSONRPCError(code=code, message=STANDARD_MESSAGES[code], data=body)
    return _encode(JSONRPCErrorResponse(id=rid, error=error))


def refusal(reason: str, detail: str, *, code: int = INVALID_REQUEST, **data: Any) -> bytes:
    """The JSON-RPC error response for a request refused before it was read (its ``id``
    unknown, so ``null``): ``error.data = {"detail": detail, "reason": reason, **data}``.

    For an HTTP server's refusals (``payload_too_large``, ``unauthorized``, ...): `code` is
    ``-32600`` (the request as sent is not accepted) unless given, e.g. ``-32603`` for a
    failure of the server itself.
    """
    return _error(None, code, detail, reason=reason, **data)


def _success(rid: str | int, result: AOSSuccessResult) -> bytes:
    return _encode(AOSSuccessResponse(id=rid, result=result))


async def answer(
    body: bytes,
    emit: Emit,
    *,
    max_body_bytes: int = MAX_BODY_BYTES,
    timeout_s: float | None = None,
    events: Mapping[str, str] | None = None,
) -> bytes | None:
    """Answer one AOS JSON-RPC 2.0 request `body` (UTF-8 JSON bytes) as the guardian agent.

    Returns the response body (UTF-8 JSON: an `AOSSuccessResponse`, a
    `PingRequestSuccessResponse` or a `JSONRPCErrorResponse`), or None for a notification
    (a valid request without ``id``: it is still emitted, its decision is not sent). Never
    raises for any input or emit failure (only `asyncio.CancelledError` passes through).

    Errors (``error.code``; ``error.data.detail`` says what, ``error.data.path`` where):
    ``-32700`` the body is not JSON (or nested too deeply); ``-32600`` not a request object
    (``jsonrpc`` not ``"2.0"``, ``id`` not a string or an integer, ``method`` not a string),
    a batch (an array: AOS sends one request object per step; batches are refused), or a body
    over `max_body_bytes` (``data.reason = "payload_too_large"``); ``-32601`` an unknown
    method; ``-32602`` params missing a required field or of a wrong type (a ``ping``: no
    ``timestamp`` at the top level, the schema's place, nor in ``params``); ``-32603`` a
    failure of the door itself before it could decide (logged with its traceback). An ``id``
    that cannot be read is answered with ``"id": null`` (JSON-RPC 2.0).

    Args:
        body: the request body.
        emit: where the event goes (``HookDispatcher.emit`` or any `Emit`).
        max_body_bytes: larger bodies are refused unread (the HTTP server refuses them first).
        timeout_s: overall deadline of the handler chain, seconds (`Emit`'s ``timeout_s``).
        events: overrides of the method -> event map: a method name, or
            ``"steps/message:<role>"``, to a hookbus event name.
    """
    if isinstance(body, str):
        body = body.encode()
    if len(body) > max_body_bytes:
        return _error(
            None, INVALID_REQUEST, f"the request body is {len(body)} bytes; at most"
            f" {max_body_bytes} are read", reason="payload_too_large", maxBytes=max_body_bytes,
        )  # fmt: skip
    try:
        check_nesting(body)
        doc = _decode(body)
    except (WireFormatError, RecursionError):
        return _error(None, PARSE_ERROR, f"the JSON is nested too deeply (at most {MAX_NESTING})")
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return _error(None, PARSE_ERROR, str(exc))
    try:
        return await _request(doc, emit, timeout_s, events)
    except Exception:  # a bug here must not become a traceback (nor an allow)
        log.exception("the AOS request could not be answered")
        rid = doc.get("id") if isinstance(doc, dict) else None
        return _error(rid if _valid_id(rid) else None, INTERNAL_ERROR, "the guardian failed")


def _valid_id(rid: Any) -> bool:
    return isinstance(rid, str) or (isinstance(rid, int) and not isinstance(rid, bool))


async def _request(
    doc: Any, emit: Emit, timeout_s: float | None, events: Mapping[str, str] | None
) -> bytes | None:
    if isinstance(doc, list):
        return _error(None, INVALID_REQUEST, "batch requests are not supported: send one"
                      " request object per AOS step")  # fmt: skip
    if not isinstance(doc, dict):
        return _error(None, INVALID_REQUEST, "the request must be a JSON object")
    notification = "id" not in doc
    rid = doc.get("id")
    if not notification and not _valid_id(rid):
        return _error(None, INVALID_REQUEST, "`id` must be a string or an integer", path="id")
    if doc.get("jsonrpc") != "2.0":
        return _error(rid, INVALID_REQUEST, '`jsonrpc` must be "2.0"', path="jsonrpc")
    method = doc.get("method")
    if not isinstance(method, str):
        return _error(rid, INVALID_REQUEST, "`method` must be a string", path="method")
    if method != "ping" and not is_decision_method(method):
        if notification:
            return None
        return _error(rid, METHOD_NOT_FOUND, f"unknown AOS method {method!r}", method=method)
    if method == "ping":
        return _ping(rid, doc, notification)
    params = doc.get("params")
    if not isinstance(params, dict):
        if notification:
            return None
        what = "missing" if params is None else f"a {type(params).__name__}, not an object"
        return _error(rid, INVALID_PARAMS, f"`params` is {what}", path="params")
    try:
        step = build(method, params, rid, events)
    except ParamsError as exc:
        return None if notification else _error(rid, INVALID_PARAMS, str(exc))
    result = await _decide(step, rid, emit, timeout_s)
    return None if notification or rid is None else _success(rid, result)


def _ping_problem(doc: dict[str, Any]) -> tuple[str, str | None] | None:
    """What is wrong with a ``ping`` (detail, path), or None. ``timestamp`` may be at the top
    level (the schema's PingRequest, where ``params`` is optional) or in ``params`` (the
    specification's prose)."""
    params = doc.get("params")
    if params is not None and not isinstance(params, dict):
        return f"`params` is a {type(params).__name__}, not an object", "params"
    try:
        ping = msgspec.convert(params or {}, PingParams)
    except msgspec.ValidationError as exc:
        return str(exc).replace("`$", "`params", 1), None
    top = doc.get("timestamp")
    if "timestamp" in doc and not isinstance(top, str):
        return "Expected `str` - at `timestamp`", "timestamp"
    if top is None and ping.timestamp is None:
        return ("Object missing required field `timestamp`: a ping sends it at the top level"
                " (the schema) or in `params` (the specification)", "timestamp")  # fmt: skip
    return None


def _ping(rid: Any, doc: dict[str, Any], notification: bool) -> bytes | None:
    problem = _ping_problem(doc)
    if notification:
        return None
    if problem is not None:
        detail, path = problem
        return _error(rid, INVALID_PARAMS, detail, **({"path": path} if path else {}))
    result = PingRequestResult(status="connected", version=_version(), timestamp=_now())
    return _encode(PingRequestSuccessResponse(id=rid, result=result))


def _idempotency_key(step: Step, rid: Any) -> str | None:
    """A retry of the same request (same id, step, data) finds its approval again."""
    if rid is None:
        return None
    turn, stepid = step.data.get("turn_id", ""), step.data.get("step_id", "")
    return f"aos:{step.method}:{turn}:{stepid}:{rid}"


async def _decide(step: Step, rid: Any, emit: Emit, timeout_s: float | None) -> AOSSuccessResult:
    try:
        result = await emit(
            step.event, step.data, idempotency_key=_idempotency_key(step, rid), timeout_s=timeout_s
        )
    except UnknownEventError:  # a strict dispatcher, no handler declared: nothing governs it
        return AOSSuccessResult(
            decision="allow", message=f"no hook governs {step.event}",
            reasonCode=["hookbus:no_handler"], data={"hookbus": {"event": step.event}},
        )  # fmt: skip
    except Exception as exc:
        return _failed(step, exc)
    try:
        return _result(step, rid, result)
    except Exception as exc:  # a result that cannot be mapped back is not an allow
        return _failed(step, exc)


def _failed(step: Step, exc: Exception) -> AOSSuccessResult:
    """Fail closed: whatever went wrong, the step is denied and the reason code says why."""
    kind = (
        "not_connected" if isinstance(exc, NotConnectedError)
        else "timeout" if isinstance(exc, HookbusTimeoutError | TimeoutError)
        else "aborted" if isinstance(exc, SuspensionAbortedError)
        else "payload_too_large" if isinstance(exc, PayloadTooLargeError)
        else "bad_request" if isinstance(exc, BadRequestError)
        else "invalid_modification" if isinstance(exc, ParamsError)
        else "error" if isinstance(exc, HookbusError)
        else "internal_error"
    )  # fmt: skip
    if kind == "internal_error":
        log.error("AOS %s: deciding %s failed; denied", step.method, step.event, exc_info=exc)
        detail = f"{type(exc).__name__} in the guardian"
    else:
        log.warning("AOS %s: %s (%s); denied", step.method, kind, exc)
        detail = str(exc) or type(exc).__name__
    return AOSSuccessResult(
        decision="deny",
        message=f"hookbus could not decide {step.event} ({kind}: {detail}); denied (fail closed)",
        reasonCode=[f"hookbus:emit_failed:{kind}"],
        data={"hookbus": {"event": step.event, "error": kind, "retryable": kind in _RETRYABLE}},
    )


def _result(step: Step, rid: Any, result: HookResult) -> AOSSuccessResult:
    action = result.action
    codes = [f"hookbus:{action}"]
    if result.decided_by:
        codes.append(f"handler:{result.decided_by}")
    if result.approved_by:
        codes.append(f"approved_by:{result.approved_by}")
    codes.extend(f"failure:{f.kind}:{f.policy}:{f.handler}" for f in result.failures)
    info: dict[str, Any] = {"event": step.event, "action": action}
    for key, value in (
        ("decidedBy", result.decided_by), ("modifiedBy", result.modified_by),
        ("approvedBy", result.approved_by),
        ("failures", [msgspec.to_builtins(f) for f in result.failures]),
    ):  # fmt: skip
        if value:
            info[key] = value
    if result.user_message:
        info["userMessage"] = {"text": result.user_message, "level": result.user_message_level}
    reasoning = result.reason if result.reason else msgspec.UNSET

    def decided(decision: Any, message: str, **extra: Any) -> AOSSuccessResult:
        return AOSSuccessResult(
            decision=decision, message=message, reasoning=reasoning, reasonCode=codes,
            data={"hookbus": info}, **extra,
        )  # fmt: skip

    if action == "deny":
        by = f" by {result.decided_by}" if result.decided_by else ""
        return decided("deny", result.reason or f"denied{by}")
    if action == "ask_user":  # not resolved by an approval gate: no human said yes
        codes.append("hookbus:approval_required")
        info["approval"] = {"prompt": result.approval_prompt, "options": result.approval_options}
        prompt = result.approval_prompt or result.reason or "a human's approval"
        return decided("deny", f"approval required, none given: {prompt}")
    if action not in ("continue", "inject_context"):
        return _failed(step, HookbusError(f"unknown action {action!r}"))
    if action == "inject_context":
        info["contextInjection"] = {
            "text": result.context_injection, "role": result.context_injection_role,
            "ephemeral": result.ephemeral,
        }  # fmt: skip
    final = result.chained_data if result.chained_data is not None else result.data
    if result.modified_by and isinstance(final, dict):
        params = rebuild(step, final)
        if params != step.params:
            request = {"jsonrpc": "2.0", "id": rid, "method": step.method, "params": params}
            by = ", ".join(result.modified_by)
            approved = f" (approved by {result.approved_by})" if result.approved_by else ""
            return decided("modify", f"modified by {by}{approved}", modifiedRequest=request)
    if result.approved_by:
        return decided("allow", f"allowed: approved by {result.approved_by}")
    if action == "inject_context":
        return decided("allow", f"allowed, with context from {result.decided_by or 'a hook'}")
    return decided("allow", "allowed: no hook objected")
