"""The wire contract: msgspec Structs for every message hookbus sends.

Rules (msgspec schema evolution): every field added later has a default; unknown fields
are ignored on decode; encoders omit fields left at their default, so messages stay small
and readable with the `nats` CLI. `hookbus schema` writes the JSON Schema of each type.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = [
    "Action",
    "CollectReply",
    "CollectRequest",
    "ContextInjection",
    "EmitReply",
    "EmitRequest",
    "EventEnvelope",
    "FailureKind",
    "FailurePolicy",
    "HandlerDeclaration",
    "HandlerFailure",
    "HookReply",
    "HookResult",
    "RequiredHandler",
    "WireError",
]

Action = Literal["continue", "deny", "modify", "inject_context", "ask_user"]
"""amplifier-core's `HookResult.action` values."""

FailureKind = Literal["timeout", "no_responders", "error", "bad_reply"]
"""Why a handler gave no usable answer: it ran past its timeout, no replica was subscribed
(NATS status 503, answered at once), it raised, or its reply did not decode."""

FailurePolicy = Literal["ignore", "deny"]
"""What a handler failure does: ``ignore`` skips the handler and records the fail-open
(amplifier-core's behaviour), ``deny`` fails closed."""


class _Wire(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """Base of every wire type."""


class _IgnoreUnknownFields(type(msgspec.Struct)):  # type: ignore[misc]
    """Construction ignores keyword arguments the type does not know, as decoding does
    (and as amplifier-core's pydantic `HookResult` does): a handler written for a newer
    field set still returns its decision instead of raising `TypeError`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except TypeError:
            known = cls.__struct_fields__
            unknown = [k for k in kwargs if k not in known]
            if not unknown:
                raise
            for k in unknown:
                del kwargs[k]
            return super().__call__(*args, **kwargs)


class ContextInjection(_Wire):
    """One hook's context injection, in the order the hooks ran.

    amplifier-core's `ContextInjection` (`amplifier_core/models.py`, 2.0.2): the same
    fields, names and defaults. The dispatcher stamps `hook_name` and `event`.
    """

    content: str
    """The text to inject."""
    role: Literal["system", "user", "assistant"] = "system"
    ephemeral: bool = False
    append_to_last_tool_result: bool = False
    hook_name: str = "unknown"
    """Name of the handler that returned it."""
    event: str = ""
    """The event it was returned for."""


class HandlerFailure(_Wire):
    """A handler that gave no usable answer, and the failure policy applied to it."""

    handler: str
    kind: FailureKind
    policy: FailurePolicy
    message: str = ""
    """Human-readable detail (the exception text, the decode error with its JSON path)."""


class HookResult(_Wire, omit_defaults=False, metaclass=_IgnoreUnknownFields):
    """What a handler returns and what `emit` returns.

    Encoded with every field (defaults included), so an agent in any language reads
    ``action`` and the rest without knowing the defaults.

    amplifier-core's `HookResult` (`amplifier_core/models.py`, 2.0.2): every field with the
    same name, type and default, so handlers written for amplifier-core construct it
    unchanged and code reading an emit's result reads what amplifier-core returns. hookbus's
    own fields follow (`chained_data`, `failures`, `decided_by`, `modified_by`,
    `approved_by`); amplifier-core code never reads them. Fields a newer sender adds are
    ignored, on decode and as keyword arguments alike, never an error.
    """

    action: Action = "continue"
    data: dict[str, Any] | None = None
    """From a handler: with ``action="modify"``, the data the next handler sees (whole
    replacement). From `emit`, as amplifier-core returns it: the final data for
    ``continue`` (a modify chain ends as ``continue`` with its data); for ``deny`` and
    ``ask_user`` the data the deciding handler put on its result (usually None); None for
    a merged ``inject_context``. `chained_data` has the final data whatever the action."""
    reason: str | None = None
    context_injection: str | None = None
    context_injection_role: Literal["system", "user", "assistant"] = "system"
    ephemeral: bool = False
    approval_prompt: str | None = None
    approval_options: list[str] | None = None
    approval_timeout: float = 300.0
    """Seconds to wait for the user's answer before `approval_default` applies."""
    approval_default: Literal["allow", "deny"] = "deny"
    suppress_output: bool = False
    user_message: str | None = None
    user_message_level: Literal["info", "warning", "error"] = "info"
    user_message_source: str | None = None
    """Label shown with `user_message` (amplifier-core: falls back to the hook's name)."""
    append_to_last_tool_result: bool = False
    context_injections: list[ContextInjection] = msgspec.field(default_factory=list)
    """Every injection of the emit in order, each with its hook and event (amplifier-core's
    ordered, lossless list; the scalar ``context_injection*`` fields are projected from it)."""
    # hookbus's own fields --------------------------------------------------------------
    chained_data: dict[str, Any] | None = None
    """From `emit`: the event data after every handler that ran (defaults, ``timestamp``,
    modify chaining), whatever the action; None on a handler's own result."""
    failures: list[HandlerFailure] = msgspec.field(default_factory=list)
    """Handlers that failed during the emit, with the policy applied (never silent)."""
    decided_by: str | None = None
    """Name of the handler whose result decided the action: the denying or asking handler,
    the last one that modified the data, or the first injector; None for continue."""
    modified_by: list[str] = msgspec.field(default_factory=list)
    """Handlers whose ``modify`` replaced the data, in the order they ran."""
    approved_by: str | None = None
    """The approver whose answer decided an ``ask_user`` (its name as its NATS
    permissions prove it; see `ApprovalAnswer`); None when no human answered."""


class EventEnvelope(_Wire):
    """One event as a handler receives it on ``hookbus.v1.hook.<event>.<handler>``."""

    id: str
    """Unique id of this emit (hex), shared by every handler call of the emit."""
    event: str
    """Event name, e.g. ``"tool:pre"``."""
    data: dict[str, Any]
    """The event data as the handler sees it (after defaults and earlier modifies)."""
    agent_id: str | None = None
    session_id: str | None = None
    emitted_at: float = 0.0
    """When the emit started: seconds since the Unix epoch (informational only: clocks of
    different hosts disagree, so no decision is taken on it)."""
    budget_s: float | None = None
    """Seconds the caller still waits for this call, measured when it was sent. The worker
    computes its own deadline on receipt (receipt + `budget_s`, on its monotonic clock) and
    never runs past it, so a skewed wall clock on either side changes nothing."""
    attempt: int = 1
    """1 for the first request of this handler call, 2+ for a hedged retry."""


class WireError(_Wire):
    """A structured error reply. `code` is one of ``bad_request``, ``unknown_event``,
    ``payload_too_large``, ``handler_error``, ``handler_timeout``, ``bad_result``,
    ``not_ready``, ``busy`` (over the concurrency bound: refused at once),
    ``unavailable`` (shutting down), ``deadline_exceeded`` (the caller's budget ran out
    before the work could start), ``internal``."""

    code: str
    message: str
    retryable: bool = False
    """True when the same request may succeed if sent again (``busy``, ``unavailable``,
    ``deadline_exceeded``): nothing was run."""


class HookReply(_Wire):
    """A worker's answer to one `EventEnvelope`: exactly one of `result` or `error`."""

    handler: str
    result: HookResult | None = None
    error: WireError | None = None
    instance: str = ""
    """Id of the worker process that answered (its ``nats.micro`` service id): a
    dispatcher may send a hedge to ``handler_instance_subject(event, handler, instance)``.
    Empty from workers that predate it."""


class HandlerDeclaration(_Wire):
    """A remote handler, as a worker declares it in the registry bucket.

    A declaration outlives the worker instances that serve it (like a Kubernetes webhook
    configuration): a declared handler with no live replica answers "no responders" at
    once and its failure policy applies.
    """

    event: str
    name: str
    priority: int = 0
    """Lower runs first (amplifier-core order); ties break by name."""
    tool_filter: list[str] | None = None
    """Glob patterns (`fnmatch`) over ``data["tool_name"]``; ``None`` matches every call."""
    timeout_s: float = 5.0
    """Seconds the dispatcher waits for one call of this handler."""
    failure_policy: FailurePolicy = "ignore"
    parallel: bool = False
    """May run concurrently with adjacent parallel handlers; may not modify."""
    retry_safe: bool = False
    """Running it twice for one call is harmless (it has no side effects, or they are
    idempotent): the dispatcher may hedge a slow call on another replica. Never assumed."""
    subject: str = ""
    """Request subject. Informational: dispatchers derive the subject, collect subject and
    queue group from (`event`, `name`) and refuse a declaration whose values differ."""
    collect_subject: str = ""
    queue_group: str = ""


class RequiredHandler(_Wire):
    """An operator's rule "`event` requires handler `name`", kept in the registry bucket
    under `required_key`. While no declaration of that handler exists, dispatchers route
    the event to the handler's derived subject anyway, so the call fails with
    ``no_responders`` and `failure_policy` decides (``deny``: fail closed) instead of the
    handler being silently absent. A declaration, once written, takes its place.
    """

    event: str
    name: str
    failure_policy: FailurePolicy = "deny"
    priority: int = 0
    """Where the absent handler sits in the call order (lower runs first)."""
    timeout_s: float = 5.0
    """Seconds a call waits while the handler has no declaration."""
    tool_filter: list[str] | None = None
    """Globs over ``data["tool_name"]`` the requirement applies to; None: every call."""


class EmitRequest(_Wire):
    """Body of a request to the dispatcher service on ``hookbus.v1.emit.<event>``."""

    data: dict[str, Any] = msgspec.field(default_factory=dict)
    agent_id: str | None = None
    session_id: str | None = None
    idempotency_key: str | None = None
    """The caller's id for this call: a retry of the same call (same key, after a lost reply
    or a dispatcher restart) finds its approval and its answer without asking again; a new
    call with the same content but another key asks anew."""
    timeout_s: float | None = None
    """Overall deadline of the emit in seconds (clamped by the service); None: the
    handlers' own timeouts (and an approval's) decide."""


class EmitReply(_Wire):
    """The dispatcher service's answer: exactly one of `result` or `error`."""

    result: HookResult | None = None
    error: WireError | None = None


class CollectRequest(_Wire):
    """Body of a request on ``hookbus.v1.emit_and_collect.<event>``."""

    data: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout_s: float = 1.0
    """Seconds to wait for the handlers' answers (amplifier-core's `timeout`)."""


class CollectReply(_Wire):
    """The dispatcher service's answer to a `CollectRequest`."""

    responses: list[Any] = msgspec.field(default_factory=list)
    error: WireError | None = None
