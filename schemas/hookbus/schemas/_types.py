"""The wire contract: msgspec Structs for every message hookbus sends.

Rules (msgspec schema evolution): every field added later has a default; unknown fields
are ignored on decode; encoders omit fields left at their default, so messages stay small
and readable with the `nats` CLI. `hookbus schema` writes the JSON Schema of each type.
"""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import msgspec

__all__ = [
    "WIRE_ERROR_CODES",
    "Action",
    "ChainStep",
    "CollectReply",
    "CollectRequest",
    "ContextInjection",
    "EmitOptions",
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


_construct = type(msgspec.Struct).__call__
"""msgspec's own construction, called directly: cheaper than ``super().__call__`` on the
path every handler's result takes."""


class _IgnoreUnknownFields(type(msgspec.Struct)):  # type: ignore[misc]
    """Construction ignores keyword arguments the type does not know, as decoding does
    (and as amplifier-core's pydantic `HookResult` does): a handler written for a newer
    field set still returns its decision instead of raising `TypeError`."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return _construct(cls, *args, **kwargs)
        except TypeError:
            known = cls.__struct_fields__
            unknown = [k for k in kwargs if k not in known]
            if not unknown:
                raise
            for k in unknown:
                del kwargs[k]
            return _construct(cls, *args, **kwargs)


class ContextInjection(_Wire):
    """One hook's context injection, in the order the hooks ran.

    amplifier-core's `ContextInjection` (`amplifier_core/models.py`, 2.0.2): the same
    fields, names and defaults. The dispatcher stamps `hook_name` and `event`.
    """

    content: str
    """The text to inject."""
    role: Literal["system", "user", "assistant"] = "system"
    """Role of the injected message in the model's conversation."""
    ephemeral: bool = False
    """True: the injection is for the next model call only, not kept in the history."""
    append_to_last_tool_result: bool = False
    """True (on ``tool:post``): appended to the last tool result instead of a message of its
    own."""
    hook_name: str = "unknown"
    """Name of the handler that returned it."""
    event: str = ""
    """The event it was returned for."""


class HandlerFailure(_Wire):
    """A handler that gave no usable answer, and the failure policy applied to it."""

    handler: str
    """Name of the handler that failed."""
    kind: FailureKind
    """How it failed: ``timeout``, ``no_responders``, ``error`` or ``bad_reply``."""
    policy: FailurePolicy
    """The failure policy applied: ``ignore`` (failed open, the emit went on) or ``deny``
    (failed closed)."""
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
    `approved_by`, `approval_allow_options`); amplifier-core code never reads them. Fields a
    newer sender adds are ignored, on decode and as keyword arguments alike, never an error.
    """

    action: Action = "continue"
    """What to do: ``continue``, ``deny`` (stop; later handlers do not run), ``modify`` (replace
    the data with `data`), ``inject_context`` (add `context_injection` for the model) or
    ``ask_user`` (ask a human, see ``approval_*``)."""
    data: dict[str, Any] | None = None
    """From a handler: with ``action="modify"``, the data the next handler sees (whole
    replacement). From `emit`, as amplifier-core returns it: the final data for
    ``continue`` (a modify chain ends as ``continue`` with its data); for ``deny`` and
    ``ask_user`` the data the deciding handler put on its result (usually None); None for
    a merged ``inject_context``. `chained_data` has the final data whatever the action."""
    reason: str | None = None
    """Why (for ``deny`` and ``modify``); shown to the agent and, for a deny, to the model."""
    context_injection: str | None = None
    """With ``inject_context``: the text to add to the model's context (None injects nothing)."""
    context_injection_role: Literal["system", "user", "assistant"] = "system"
    """Role of the injected message."""
    ephemeral: bool = False
    """True: the injection is for the next model call only, not kept in the history."""
    approval_prompt: str | None = None
    """With ``ask_user``: the question shown to the approver."""
    approval_options: list[str] | None = None
    """With ``ask_user``: the choices offered; None means ``["Allow", "Deny"]``. Which of
    them allow: `approval_allow_options`. An allowing ``"Allow always"`` also stores a
    grant."""
    approval_timeout: float = 300.0
    """Seconds to wait for the user's answer before `approval_default` applies."""
    approval_default: Literal["allow", "deny"] = "deny"
    """With ``ask_user``: the decision when `approval_timeout` runs out unanswered."""
    suppress_output: bool = False
    """True: hide the hook's output from the user's transcript."""
    user_message: str | None = None
    """A message to show the user (not the model), separate from the context injection."""
    user_message_level: Literal["info", "warning", "error"] = "info"
    """Severity of `user_message`."""
    user_message_source: str | None = None
    """Label shown with `user_message` (amplifier-core: falls back to the hook's name)."""
    append_to_last_tool_result: bool = False
    """True (on ``tool:post``): the injection is appended to the last tool result instead of a
    message of its own."""
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
    permissions prove it; see `ApprovalAnswer`); None when no human answered. When several
    handlers asked and every question was allowed: each approver that allowed one, in
    priority order, once each, joined by ``", "``; a deny names the approver who refused."""
    approval_allow_options: list[str] | None = None
    """With ``ask_user``: which of `approval_options` allow the call (exact text); the others
    deny. None: the options starting with "allow" (any case), as amplifier-core's callers
    read them. When no offered option allows, the dispatcher denies without asking anyone
    (the reason says the options offer no allowing answer) and logs a warning."""


class EventEnvelope(_Wire):
    """One event as a handler receives it on ``hookbus.v1.handler.<event>.<handler>``."""

    id: str
    """Unique id of this emit (32 lower-case hex digits, fresh for every emit, even two
    emits with the same idempotency key), shared by every handler call of the emit: a
    worker may de-duplicate hedged or resent requests of one call by it."""
    event: str
    """Event name, e.g. ``"tool:pre"``."""
    data: dict[str, Any]
    """The event data as the handler sees it (after defaults and earlier modifies)."""
    agent_id: str | None = None
    """The agent the emit was made for (also ``data["agent_id"]``); None: no agent."""
    session_id: str | None = None
    """The agent's session (also ``data["session_id"]``); None: no session."""
    idempotency_key: str | None = None
    """The idempotency key the agent gave the emit (`EmitRequest.idempotency_key`), the
    same on every retry of its call; None: it gave none. Not unique across agents or
    emits: two agents may choose the same key, and a retry is a new emit (a new `id`)."""
    emitted_at: float = 0.0
    """When the emit started: seconds since the Unix epoch (informational only: clocks of
    different hosts disagree, so no decision is taken on it)."""
    budget_s: float | None = None
    """Seconds the caller still waits for this call, measured when it was sent. The worker
    computes its own deadline on receipt (receipt + `budget_s`, on its monotonic clock) and
    never runs past it, so a skewed wall clock on either side changes nothing."""
    attempt: int = 1
    """1 for the first request of this handler call, 2+ for a hedged retry."""
    chain: list[ChainStep] | None = None
    """Set only on a chain request (``hookbus.v1.chain.<event>.<set>``): the handlers of
    `event` to run, in call order, one after the other with amplifier-core's semantics (see
    `ChainStep`). None: a request to the one handler its subject names."""


class ChainStep(_Wire):
    """One handler of a chain request, as the dispatcher will fold it.

    The worker runs the steps in order on the chained data: a step whose tool filter does
    not match the data is skipped (no reply); ``modify`` with data replaces the data for the
    next step; adjacent ``parallel`` steps run concurrently on the same data. It stops after
    a step that ends the fold: a ``deny``, a failure under policy ``deny``, a result that
    cannot be read, or a parallel step that modifies. Source: amplifier-core
    ``HookRegistry.emit``.
    """

    handler: str
    """The handler's name (a handler of the envelope's event served by this process)."""
    failure_policy: FailurePolicy = "ignore"
    """The policy the dispatcher applies to this handler's failure (``deny`` stops here)."""
    timeout_s: float = 5.0
    """Seconds this step may run (also cut to what is left of the request's ``budget_s``)."""
    parallel: bool = False
    """Runs concurrently with the adjacent parallel steps, on the same data."""
    tool_filter: list[str] | None = None
    """The tool filter the dispatcher judged this step by (its handler's declaration as the
    dispatcher read it; None: no filter). A worker whose own declaration of the handler
    has another filter refuses the whole chain (``stale_declaration``, nothing run): it
    would skip or run other steps than the dispatcher folds, e.g. during a rolling update."""
    traceparent: str | None = None
    """The W3C ``traceparent`` of the dispatcher's span for this handler's call: the
    step's handling span is its child, as with a request of its own. None: the request's
    own ``traceparent`` header, if any."""


WIRE_ERROR_CODES: tuple[str, ...] = (
    "bad_request",
    "unknown_event",
    "payload_too_large",
    "handler_error",
    "handler_timeout",
    "bad_result",
    "not_ready",
    "busy",
    "quota",
    "unavailable",
    "deadline_exceeded",
    "stale_declaration",
    "internal",
)
"""Every `WireError.code` a hookbus process sends (the wire contract's enum). A reader
decodes any string, so a code added later is an ``error`` to older dispatchers, not a
decode failure."""


class WireError(_Wire):
    """A structured error reply. `code` is one of ``bad_request``, ``unknown_event``,
    ``payload_too_large``, ``handler_error``, ``handler_timeout``, ``bad_result``,
    ``not_ready``, ``busy`` (over the concurrency bound, the replica's or the agent's:
    refused at once), ``quota`` (the agent is over its request rate at the dispatcher
    service: refused at once), ``unavailable`` (shutting down), ``deadline_exceeded``
    (the caller's budget ran out before the work could start), ``stale_declaration`` (a
    chain step expects another declaration of its handler than this worker serves: nothing
    was run), ``internal``."""

    code: str
    """What went wrong: one of the codes listed in the type's description (in Python,
    `WIRE_ERROR_CODES`)."""
    message: str
    """Human-readable detail (for a bad request: the JSON path of the problem)."""
    retryable: bool = False
    """True when the same request may succeed if sent again (``busy``, ``quota``,
    ``unavailable``, ``deadline_exceeded``): nothing was run."""


class HookReply(_Wire):
    """A worker's answer to one `EventEnvelope`: exactly one of `result` or `error`."""

    handler: str
    """Name of the handler that answers (the one the request subject names), as given,
    not encoded; on the answer to a chain request, the handler set's id instead (32 hex
    digits, the last token of the chain subject), and in each of its `chain` replies the
    step's handler name."""
    result: HookResult | None = None
    """The handler's result (exactly one of `result` and `error`)."""
    error: WireError | None = None
    """Why the handler gave no result (exactly one of `result` and `error`)."""
    instance: str = ""
    """Id of the worker process that answered (its ``nats.micro`` service id): a
    dispatcher may send a hedge to ``handler_instance_subject(event, handler, instance)``.
    Empty from workers that predate it."""
    chain: list[HookReply] | None = None
    """The answer to a chain request: one reply per step that ran, in step order (a step
    skipped by its tool filter, and every step after the one that ended the fold, has
    none). Then `handler` names the set and `result` and `error` are both None; an
    `error` instead means no step ran (e.g. ``busy``).

    While a chain runs, the worker also sends progress replies (`running` set): each lists
    the replies of the steps finished since its last report and names the steps running
    now. The final reply (`running` None) lists every step's reply."""
    running: list[str] | None = None
    """Set only on a chain's progress reply: the handlers of the steps running now (empty
    when between steps). None: the final reply."""
    running_for_s: float = 0.0
    """On a progress reply: seconds the running steps had run when it was sent (the
    dispatcher dates their start from it on its own clock)."""


class HandlerDeclaration(_Wire):
    """A remote handler, as a worker declares it in the registry bucket.

    A declaration outlives the worker instances that serve it (like a Kubernetes webhook
    configuration): a declared handler with no live replica answers "no responders" at
    once and its failure policy applies.
    """

    event: str
    """The event the handler serves (its key's first segment, decoded)."""
    name: str
    """The handler's name, unique per event (its key's second segment, decoded)."""
    priority: int = 0
    """Lower runs first (amplifier-core order); ties break by name."""
    tool_filter: list[str] | None = None
    """Glob patterns (`fnmatch` syntax) over ``data["tool_name"]``, each matched against the
    whole name, ignoring case (both casefolded: ``bash`` matches ``Bash``); ``None`` matches
    every call. Kept as written."""
    timeout_s: float = 5.0
    """Seconds the dispatcher waits for one call of this handler."""
    failure_policy: FailurePolicy = "ignore"
    """What a failure of this handler does: ``ignore`` (fail open, recorded on the result) or
    ``deny`` (fail closed)."""
    parallel: bool = False
    """May run concurrently with adjacent parallel handlers; may not modify."""
    retry_safe: bool = False
    """Running it twice for one call is harmless (it has no side effects, or they are
    idempotent): the dispatcher may hedge a slow call on another replica. Never assumed."""
    pure: bool = False
    """Free of side effects: a dispatcher may call a sequence of adjacent pure handlers at once,
    speculatively, and fold their results in priority order (a result computed on data a
    modify has since replaced is discarded and the handler called again). Implies
    `retry_safe`. Never assumed."""
    handler_set: list[str] | None = None
    """The names of every handler the declaring worker process serves (sorted, unique, at
    most `MAX_HANDLER_SET`), so that a sequence of adjacent handlers of one process can be sent
    as one chain request to ``hookbus.v1.chain.<event>.<set>``, ``<set>`` being
    ``handler_set_id(handler_set)``. None: send each of its calls on its own."""
    subject: str = ""
    """The handler's request subject ``hookbus.v1.handler.<event>.<handler>`` (names encoded).
    Writers put the derived value (the wire contract requires it); dispatchers derive the
    subject, collect subject and queue group from (`event`, `name`) themselves, refuse a
    declaration whose values differ, and accept one without them."""
    collect_subject: str = ""
    """The event's emit_and_collect subject ``hookbus.v1.collect.<event>``. Informational, like
    `subject`."""
    queue_group: str = ""
    """The queue group every replica subscribes with: the encoded handler name. Informational,
    like `subject`."""


class RequiredHandler(_Wire):
    """An operator's rule "`event` requires handler `name`", kept in the registry bucket
    under `required_key`. While no declaration of that handler exists, dispatchers route
    the event to the handler's derived subject anyway, so the call fails with
    ``no_responders`` and `failure_policy` decides (``deny``: fail closed) instead of the
    handler being silently absent. A declaration, once written, takes its place.
    """

    event: str
    """The event that requires the handler."""
    name: str
    """The required handler's name."""
    failure_policy: FailurePolicy = "deny"
    """What the call's failure does while the handler is not declared (``deny``: fail closed)."""
    priority: int = 0
    """Where the absent handler sits in the call order (lower runs first)."""
    timeout_s: float = 5.0
    """Seconds a call waits while the handler has no declaration."""
    tool_filter: list[str] | None = None
    """Globs over ``data["tool_name"]`` the requirement applies to (whole name, ignoring
    case, as a declaration's ``tool_filter``); None: every call."""


class EmitRequest(_Wire):
    """Body of a request to the dispatcher service on ``hookbus.v1.emit.<agent>.<event>``."""

    data: dict[str, Any] = msgspec.field(default_factory=dict)
    """The event data (a JSON object). The dispatcher adds its default fields, ``agent_id``,
    ``session_id`` and an RFC 3339 UTC ``timestamp``."""
    agent_id: str | None = None
    """The agent: must be the one the subject names (``hookbus.v1.emit.<agent>.<event>``), else
    the request is refused."""
    session_id: str | None = None
    """The agent's session; copied into the data (``data["session_id"]``)."""
    idempotency_key: str | None = None
    """The caller's id for this call: a retry of the same call (same key, after a lost reply
    or a dispatcher restart) finds its approval and its answer without asking again; a new
    call with the same content but another key asks anew."""
    timeout_s: float | None = None
    """Overall deadline of the emit in seconds (clamped by the service); None: the
    handlers' own timeouts (and an approval's) decide."""
    approval_timeout_s: float | None = None
    """Longest wait, in seconds, of an approval this emit asks (above 0, finite): a handler's
    ``approval_timeout`` is cut to it, so an approval nobody answers ends with its
    ``approval_default`` (and is no longer pending) within the caller's own wait; when the
    cut shortens the wait, a default of ``allow`` becomes ``deny`` (only the handler's full
    timeout allows by default). None: the handler's ``approval_timeout``."""


class EmitOptions(TypedDict, total=False):
    """The keyword options of an emit, ``emit(event, data, **options)`` (`HookDispatcher.emit`
    and every function of its shape): what an `EmitRequest` carries besides the data. Each
    may be left out (None)."""

    idempotency_key: str | None
    """The caller's id for this call (see `EmitRequest.idempotency_key`)."""
    timeout_s: float | None
    """Overall deadline of the emit, seconds (see `EmitRequest.timeout_s`)."""
    approval_timeout_s: float | None
    """Longest wait of an approval the emit asks, seconds (see
    `EmitRequest.approval_timeout_s`)."""


class EmitReply(_Wire):
    """The dispatcher service's answer: exactly one of `result` or `error`."""

    result: HookResult | None = None
    """The folded result of every handler (exactly one of `result` and `error`); encoded with
    every field."""
    error: WireError | None = None
    """Why the emit failed (exactly one of `result` and `error`); see `WireError.retryable`."""


class CollectRequest(_Wire):
    """Body of a request on ``hookbus.v1.emit_and_collect.<agent>.<event>``."""

    data: dict[str, Any] = msgspec.field(default_factory=dict)
    """The event data (a JSON object); every handler gets a copy (no defaults, no timestamp)."""
    timeout_s: float = 1.0
    """Seconds to wait for the handlers' answers (amplifier-core's `timeout`)."""


class CollectReply(_Wire):
    """The dispatcher service's answer to a `CollectRequest`."""

    responses: list[Any] = msgspec.field(default_factory=list)
    """The non-null ``result.data`` of each handler that answered in time, in priority order
    (amplifier-core's `emit_and_collect` return value); failures are skipped."""
    error: WireError | None = None
    """Set when the request failed as a whole (then `responses` is empty)."""
