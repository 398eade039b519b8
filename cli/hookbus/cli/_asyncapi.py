"""The wire contract as an AsyncAPI 3.0 document, generated (no I/O).

`asyncapi_document` is what ``hookbus asyncapi`` prints. Every address is built by the
functions of `_subjects` themselves (called with placeholder names, then the placeholders
become ``{parameters}``), the payloads are `json_schemas`' definitions, and the bucket and
stream settings come from `hookbus._core.buckets` and `hookbus.schemas`: nothing here
restates a subject, a key or a field, so the document follows the code.

What it holds (AsyncAPI 3.0, NATS):

- a channel per subject family, with its parameters (encoded names, see `encode_token`);
- the JetStream KV buckets as channels of their ``$KV.<bucket>.<key>`` subjects (a put is a
  message with the value; a delete a message with header ``KV-Operation``), each with the
  bucket's settings in ``x-hookbus-kv``;
- request/reply operations (AsyncAPI 3 ``reply``; the reply goes to the request's NATS
  reply subject, an inbox: a channel whose address is null);
- queue groups: the NATS operation binding ``queue`` where the group is one fixed name
  (the dispatcher service), ``x-hookbus-queue-group`` where it is a parameter (a handler's
  group is its encoded name);
- the two NATS services API (ADR-32) services, ``hookbus-worker`` (every worker process;
  its ``handlers`` metadata is what liveness reads) and ``hookbus-dispatcher``, as channels
  of their ``$SRV.<verb>.<name>`` subjects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from hookbus._core.buckets import (
    approvals_bucket_config,
    handlers_bucket_config,
    leases_bucket_config,
    suspensions_bucket_config,
)
from hookbus.schemas import (
    DISPATCHER_QUEUE_GROUP,
    DISPATCHER_SERVICE_NAME,
    GRANT_NONE,
    NO_AGENT,
    REGISTRY_CHANGES_WILDCARD,
    SUBJECT_PREFIX,
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSION_SUBJECT_PREFIX,
    WORKER_SERVICE_NAME,
    approval_answer_key,
    chain_instance_subject,
    chain_subject,
    collect_service_subject,
    collect_subject,
    decisions_stream_config,
    decisions_subject,
    emit_service_subject,
    grant_key,
    handler_instance_subject,
    handler_key,
    handler_subject,
    lease_key,
    required_key,
    schema_definitions,
    suspension_event_subject,
    suspension_key,
)

__all__ = ["ASYNCAPI_VERSION", "asyncapi_document"]

ASYNCAPI_VERSION: Final = "3.0.0"
NATS_BINDING_VERSION: Final = "0.1.0"

_ENCODED = (
    "encoded as one subject token: `[A-Za-z0-9_-]` as is, every other byte of its UTF-8 "
    "text as `=XX` (upper-case hex), e.g. `tool:pre` is `tool=3Apre`"
)

PARAMETERS: Final[dict[str, dict[str, Any]]] = {
    "event": {"description": f"The event name, {_ENCODED}.", "examples": ["tool=3Apre"]},
    "handler": {
        "description": f"The handler's name, {_ENCODED}. It is also the handler's queue group.",
        "examples": ["security_policy"],
    },
    "instance": {
        "description": "A worker process's instance id (its NATS services API id, as "
        f"`$SRV.INFO.{WORKER_SERVICE_NAME}` reports it and `HookReply.instance` names it), "
        "encoded like a name.",
    },
    "agent": {
        "description": f"The agent id, {_ENCODED}; `{NO_AGENT}` for a call without an agent "
        "id. Only that agent's NATS user may publish or read on subjects and keys that name it.",
        "examples": ["payments", NO_AGENT],
    },
    "label": {
        "description": f"A suspension's label, {_ENCODED}. Approval labels are "
        "`approval:` and 32 hex digits (encoded `approval=3A...`).",
    },
    "status": {
        "description": "The transition the suspension event reports.",
        "enum": ["pending", "resolved", "cancelled"],
    },
    "approver": {"description": f"The approver's name, {_ENCODED}."},
    "session": {"description": f"The session id, {_ENCODED}."},
    "tool": {
        "description": f"The tool name, {_ENCODED}; `{GRANT_NONE}` for a call naming no tool."
    },
    "grantAgent": {
        "description": f"The agent id, {_ENCODED}; `{GRANT_NONE}` for calls without an agent id.",
    },
    "waiter": {"description": "A process's waiter id: 1 to 64 lower-case hex digits."},
    "verb": {
        "description": "The NATS services API (ADR-32) request: `PING` (who is there), "
        "`INFO` (endpoints and metadata) or `STATS` (request counts). Each also exists as "
        "`$SRV.<verb>` (every service) and `$SRV.<verb>.<name>.<id>` (one instance).",
        "enum": ["PING", "INFO", "STATS"],
    },
    "set": {
        "description": "A handler set's id: 32 lower-case hex digits of SHA-256 over the "
        "sorted, unique, encoded names of every handler one worker process serves, one per "
        "line (`HandlerDeclaration.handler_set`). It is also the set's queue group.",
    },
}


def _address(build: Callable[..., str], *params: str) -> str:
    """The address `build` makes for placeholder names, with ``{param}`` in their place."""
    marks = {f"X0{p}0X": p for p in params}
    address = build(*marks)
    for mark, param in marks.items():
        address = address.replace(mark, "{" + param + "}")
    return address


def _waiter_address() -> str:
    return lease_key("0123456789abcdef").replace("0123456789abcdef", "{waiter}")


def _kv(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


def _kv_channel(
    config: Any, key: str, description: str, message: str, params: dict[str, Any]
) -> dict[str, Any]:
    """The channel of the KV bucket `config`'s ``$KV.<bucket>.<key>`` subjects for keys of
    the form `key`, holding values of `message`, with the bucket's settings in
    ``x-hookbus-kv``."""
    return _channel(
        _kv(config.bucket, key), description, [message], params,
        kv=_bucket_extension(config, key),
    )  # fmt: skip


def _params(*names: str, rename: dict[str, str] | None = None) -> dict[str, Any]:
    rename = rename or {}
    return {n: {"$ref": f"#/components/parameters/{rename.get(n, n)}"} for n in names}


def _msg_ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/messages/{name}"}


def _bucket_extension(config: Any, key: str) -> dict[str, Any]:
    storage = config.storage
    return {
        "bucket": config.bucket,
        "stream": f"KV_{config.bucket}",
        "key": key,
        "description": config.description,
        "history": config.history,
        "ttl_s": config.ttl or None,
        "storage": getattr(storage, "value", storage) or "file",
        "replicas": "1; 3 on a cluster (--bucket-replicas)",
        "direct_get": bool(config.direct),
    }


_TRACE_HEADERS: Final = {
    "type": "object",
    "description": "NATS headers. Optional W3C trace context: the request's span continues "
    "in the receiver's trace (OpenTelemetry messaging conventions).",
    "properties": {
        "traceparent": {"type": "string", "description": "W3C `traceparent`."},
        "tracestate": {"type": "string", "description": "W3C `tracestate`."},
    },
}

_KV_HEADERS: Final = {
    "type": "object",
    "description": "NATS headers JetStream KV sets: a delete or purge is a message with an "
    "empty body and `KV-Operation` set; a put has none.",
    "properties": {
        "KV-Operation": {
            "type": "string",
            "enum": ["DEL", "PURGE"],
            "description": "Set on a delete or purge marker (empty body).",
        },
    },
}


def _message(
    name: str, summary: str, *, payload: str | None = None, headers: Any = None
) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "name": name,
        "title": name,
        "summary": summary,
        "contentType": "application/json",
        "payload": {"$ref": f"#/components/schemas/{payload or name}"},
    }
    if headers is not None:
        msg["headers"] = headers
    return msg


def _messages() -> dict[str, Any]:
    return {
        "EventEnvelope": _message(
            "EventEnvelope",
            "One handler call: the event and its data as the handler sees it.",
            headers=_TRACE_HEADERS,
        ),
        "HookReply": _message(
            "HookReply", "A worker's answer to one EventEnvelope: a result or an error."
        ),
        "EmitRequest": _message(
            "EmitRequest", "An agent's emit, to the dispatcher service.", headers=_TRACE_HEADERS
        ),
        "EmitReply": _message("EmitReply", "The folded result of an emit, or an error."),
        "CollectRequest": _message(
            "CollectRequest",
            "An agent's emit_and_collect, to the dispatcher service.",
            headers=_TRACE_HEADERS,
        ),
        "CollectReply": _message(
            "CollectReply", "The data every handler returned, in priority order, or an error."
        ),
        "HookEvent": _message(
            "HookEvent", "A suspension's transition (pending / resolved / cancelled)."
        ),
        "DecisionRecord": {
            **_message("DecisionRecord", "One decided emit, as the audit trail stores it."),
            "headers": {
                "type": "object",
                "description": "NATS headers of the record's publish.",
                "properties": {
                    "Nats-Msg-Id": {
                        "type": "string",
                        "description": "The record's `id`: a retried publish is stored once.",
                    },
                },
            },
        },
        "HandlerDeclaration": _message(
            "HandlerDeclaration",
            "A handler's declaration: its order, filter, timeout and policy.",
            headers=_KV_HEADERS,
        ),
        "RequiredHandler": _message(
            "RequiredHandler",
            "An operator's rule: this event requires this handler.",
            headers=_KV_HEADERS,
        ),
        "SuspensionRecord": _message(
            "SuspensionRecord",
            "A suspension (a run waiting on a label), changed only by compare-and-set.",
            headers=_KV_HEADERS,
        ),
        "ApprovalRecord": _message(
            "ApprovalRecord",
            "An approval record (label `approval:...`, in the approvals bucket): its "
            "metadata is an ApprovalMetadata, its resolution an ApprovalAnswer.",
            headers=_KV_HEADERS,
        ),
        "ApprovalAnswer": _message(
            "ApprovalAnswer",
            "An approver's answer proof: written once, by that approver only (beside an "
            "approval record, or a tool approval's suspension record).",
            headers=_KV_HEADERS,
        ),
        "ApprovalGrant": _message(
            "ApprovalGrant",
            'An "Allow always" grant for one agent, session, event, handler and tool.',
            headers=_KV_HEADERS,
        ),
        "ServiceRequest": {
            "name": "ServiceRequest",
            "title": "ServiceRequest",
            "summary": "A NATS services API request: an empty body; every instance answers.",
            "contentType": "text/plain",
            "payload": {"$ref": "#/components/schemas/ServiceRequest"},
        },
        "WorkerServiceInfo": _message(
            "WorkerServiceInfo",
            f"A worker process's answer on `$SRV.<verb>.{WORKER_SERVICE_NAME}`: its instance "
            "id and, in `metadata.handlers`, the encoded keys of the handlers it serves.",
        ),
        "DispatcherServiceInfo": _message(
            "DispatcherServiceInfo",
            f"A dispatcher service replica's answer on `$SRV.<verb>.{DISPATCHER_SERVICE_NAME}`:"
            " its endpoints (`emit`, `emit_and_collect`), bounds and request counts.",
        ),
        "Lease": {
            "name": "Lease",
            "title": "Lease",
            "summary": "A process's waiter lease: the waiter id as plain text, rewritten by a "
            "heartbeat; the bucket's max age expires it.",
            "contentType": "text/plain",
            "payload": {"$ref": "#/components/schemas/Lease"},
            "headers": _KV_HEADERS,
        },
    }


def _channel(
    address: str | None,
    description: str,
    messages: list[str],
    params: dict[str, Any] | None = None,
    **extensions: Any,
) -> dict[str, Any]:
    channel: dict[str, Any] = {
        "address": address,
        "description": description,
        "messages": {m[0].lower() + m[1:]: _msg_ref(m) for m in messages},
    }
    if params:
        channel["parameters"] = params
    channel.update({f"x-hookbus-{k.replace('_', '-')}": v for k, v in extensions.items()})
    return channel


def _channels() -> dict[str, Any]:
    handlers = handlers_bucket_config()
    suspensions = suspensions_bucket_config()
    approvals = approvals_bucket_config()
    leases = leases_bucket_config()
    stream = decisions_stream_config()
    handler_key_pattern = _address(handler_key, "event", "handler")
    required_key_pattern = _address(required_key, "event", "handler")
    suspension_key_pattern = _address(
        lambda label, agent: suspension_key(label, agent), "label", "agent"
    )
    answer_key_pattern = _address(
        lambda label, agent, approver: approval_answer_key(label, agent, approver),
        "label",
        "agent",
        "approver",
    )
    grant_key_pattern = _address(grant_key, "grantAgent", "session", "event", "handler", "tool")
    return {
        "handler": _channel(
            _address(handler_subject, "event", "handler"),
            "One handler's requests. Every replica of the handler subscribes in the queue "
            "group named like the handler (its encoded name), so one replica gets each call.",
            ["EventEnvelope"],
            _params("event", "handler"),
        ),
        "handlerInstance": _channel(
            _address(handler_instance_subject, "event", "handler", "instance"),
            "The same handler on one worker process only (no queue group): dispatchers send "
            "a hedge or a retry here, to a replica that answered recently.",
            ["EventEnvelope"],
            _params("event", "handler", "instance"),
        ),
        "chain": _channel(
            _address(chain_subject, "event", "set"),
            "Chain requests: a sequence of adjacent handlers of one worker process (its handler "
            "set) in one request, `EventEnvelope.chain` naming the steps. Every replica of "
            "the set subscribes in the queue group named by the set's id; the reply is one "
            "HookReply whose `chain` holds each step's reply (see docs/wire.md).",
            ["EventEnvelope"],
            _params("event", "set"),
        ),
        "chainInstance": _channel(
            _address(
                lambda event, set_, instance: chain_instance_subject(
                    chain_subject(event, set_), instance
                ),
                "event",
                "set",
                "instance",
            ),
            "The same chain subject on one worker process only (no queue group): hedges of "
            "a chain whose every step is retry_safe.",
            ["EventEnvelope"],
            _params("event", "set", "instance"),
        ),
        "collect": _channel(
            _address(collect_subject, "event"),
            "emit_and_collect's scatter: one publish that every handler of the event hears "
            "(each handler's queue group: one replica per handler). Replies go to the "
            "dispatcher's inbox.",
            ["EventEnvelope"],
            _params("event"),
        ),
        "handlerReply": _channel(
            None,
            "The reply subject of a handler request (the NATS reply-to: a dispatcher's "
            "inbox). Exactly one HookReply per request; a request is never left unanswered.",
            ["HookReply"],
        ),
        "emit": _channel(
            _address(lambda event, agent: emit_service_subject(event, agent), "event", "agent"),
            "The dispatcher service's emit: one request, one EmitReply. The agent is the "
            "subject's: only that agent's NATS user may publish here, and a body naming "
            "another agent is refused. Replicas share it in queue group "
            f"`{DISPATCHER_QUEUE_GROUP}`.",
            ["EmitRequest"],
            _params("agent", "event"),
        ),
        "emitReply": _channel(
            None, "The reply subject of an emit request (the NATS reply-to).", ["EmitReply"]
        ),
        "emitAndCollect": _channel(
            _address(lambda event, agent: collect_service_subject(event, agent), "event", "agent"),
            "The dispatcher service's emit_and_collect: one request, one CollectReply.",
            ["CollectRequest"],
            _params("agent", "event"),
        ),
        "collectReply": _channel(
            None,
            "The reply subject of an emit_and_collect request (the NATS reply-to).",
            ["CollectReply"],
        ),
        "suspensionEvents": _channel(
            _address(
                lambda label, status, agent: suspension_event_subject(label, status, agent),
                "label",
                "status",
                "agent",
            ),
            "A suspension's transitions, published by whoever made them (core NATS, not "
            f"stored). `{SUSPENSION_SUBJECT_PREFIX}.<agent>.>` hears one agent's, "
            f"`{SUSPENSION_EVENTS_WILDCARD}` every agent's. The payload keeps the Vercel AI "
            "SDK's name, HookEvent.",
            ["HookEvent"],
            _params("agent", "label", "status"),
        ),
        "decisions": _channel(
            _address(lambda agent: decisions_subject(agent), "agent"),
            f"The decision audit trail: one record per decided emit, stored by the JetStream "
            f"stream `{stream.name}` (read through the JetStream API by admins and auditors).",
            ["DecisionRecord"],
            _params("agent"),
            stream={
                "name": stream.name,
                "subjects": stream.subjects,
                "retention": "limits",
                "discard": "old",
                "max_age_s": stream.max_age,
                "max_bytes": stream.max_bytes,
                "storage": "file",
                "duplicate_window_s": stream.duplicate_window,
                "deny_delete": stream.deny_delete,
            },
        ),
        "handlersBucket": _kv_channel(
            handlers,
            handler_key_pattern,
            f"The handler registry: one HandlerDeclaration per (event, handler) in KV bucket "
            f"`{handlers.bucket}`, key `{handler_key_pattern}`. Workers create or update it by "
            "compare-and-set (a differing live declaration is a conflict); every dispatcher "
            "follows the bucket (its republished changes, `registryChanges`) and derives the "
            "routes from the key.",
            "HandlerDeclaration",
            _params("event", "handler"),
        ),
        "requiredBucket": _kv_channel(
            handlers,
            required_key_pattern,
            f"Required handlers, in the same bucket under key `{required_key_pattern}`: while "
            "the handler is not declared, its calls fail with no responders and the rule's "
            "failure policy decides.",
            "RequiredHandler",
            _params("event", "handler"),
        ),
        "registryChanges": _channel(
            f"{REGISTRY_CHANGES_WILDCARD[:-1]}{handler_key_pattern}",
            f"Every declaration stored in bucket `{handlers.bucket}`, republished by the "
            "server (the bucket stream's `republish`; no client may publish here), with the "
            "stream headers `Nats-Sequence` (contiguous: a gap is a missed change), "
            "`Nats-Subject` and, for a delete, `KV-Operation`. Dispatchers follow the "
            "registry here, one core subscription each, and read a snapshot by direct get.",
            ["HandlerDeclaration"],
            _params("event", "handler"),
        ),
        "registryRequiredChanges": _channel(
            f"{REGISTRY_CHANGES_WILDCARD[:-1]}{required_key_pattern}",
            "Every required-handler record stored in the same bucket, republished the same way.",
            ["RequiredHandler"],
            _params("event", "handler"),
        ),
        "suspensionsBucket": _kv_channel(
            suspensions,
            suspension_key_pattern,
            f"Suspension records in KV bucket `{suspensions.bucket}`, key "
            f"`{suspension_key_pattern}`; each write a compare-and-set on the revision. "
            "Records expire the bucket's TTL after their last write.",
            "SuspensionRecord",
            _params("agent", "label"),
        ),
        "answerProofs": _kv_channel(
            suspensions,
            answer_key_pattern,
            f"Tool approval answer proofs, in the suspensions bucket under key "
            f"`{answer_key_pattern}` (three segments; a record has two). Written once "
            "(create) by the approver, whose NATS user alone may write its key; the waiting "
            "agent resolves the tool approval from the first one, and a resolution without a "
            "matching proof is refused.",
            "ApprovalAnswer",
            _params("agent", "label", "approver"),
        ),
        "approvalsBucket": _kv_channel(
            approvals,
            suspension_key_pattern,
            f"Approval records in KV bucket `{approvals.bucket}`, key "
            f"`{suspension_key_pattern}`, written only by the dispatcher that asks (each write "
            "a compare-and-set on the revision); they expire the bucket's TTL (7 days) after "
            "their last write.",
            "ApprovalRecord",
            _params("agent", "label"),
        ),
        "approvalAnswerProofs": _kv_channel(
            approvals,
            answer_key_pattern,
            f"Approval answer proofs, in the approvals bucket under key "
            f"`{answer_key_pattern}` (three segments). Written once (create) by the approver, "
            "whose NATS user alone may write its key; the deciding dispatcher resolves the "
            "approval from the first proof in stream order, and a resolution without a "
            "matching proof denies.",
            "ApprovalAnswer",
            _params("agent", "label", "approver"),
        ),
        "grantsBucket": _kv_channel(
            approvals,
            grant_key_pattern,
            f'"Allow always" grants in KV bucket `{approvals.bucket}`, key '
            f"`{grant_key_pattern}`, written by the dispatcher that applied the answer, with "
            "its lineage (approval label, approver, expiry); a value that does not match its "
            "key, or whose approver's proof does not hold, is ignored.",
            "ApprovalGrant",
            _params("grantAgent", "session", "event", "handler", "tool"),
        ),
        "workerService": _channel(
            f"$SRV.{{verb}}.{WORKER_SERVICE_NAME}",
            f"Every worker process runs a NATS services API service named "
            f"`{WORKER_SERVICE_NAME}` whose metadata `handlers` lists the handlers it serves: "
            "their registry keys `<event>.<handler>`, each name encoded as in subjects, "
            "separated by one space (`tool=3Apre.guard tool=3Apost.audit`). Only encoded keys "
            "count: a key that does not parse (`tool:pre.guard`) is ignored, and the handler "
            "shows no live replica. A scatter on `PING` finds every live worker "
            "(`hookbus handlers`); emits never wait on it.",
            ["ServiceRequest"],
            _params("verb"),
        ),
        "workerServiceReply": _channel(
            None,
            f"The reply subject of a `{WORKER_SERVICE_NAME}` services API request (an inbox): "
            "one answer per live worker process.",
            ["WorkerServiceInfo"],
        ),
        "dispatcherService": _channel(
            f"$SRV.{{verb}}.{DISPATCHER_SERVICE_NAME}",
            f"Every dispatcher service replica runs a NATS services API service named "
            f"`{DISPATCHER_SERVICE_NAME}` with two endpoints, `emit` and `emit_and_collect`, "
            f"in queue group `{DISPATCHER_QUEUE_GROUP}`; its metadata holds its bounds "
            "(`max_concurrency`, `agent_max_in_flight`, `agent_rate_per_s`, `agent_burst`, "
            "`audit`).",
            ["ServiceRequest"],
            _params("verb"),
        ),
        "dispatcherServiceReply": _channel(
            None,
            f"The reply subject of a `{DISPATCHER_SERVICE_NAME}` services API request (an "
            "inbox): one answer per replica.",
            ["DispatcherServiceInfo"],
        ),
        "leasesBucket": _kv_channel(
            leases,
            _waiter_address(),
            f"Waiter leases in KV bucket `{leases.bucket}` (file storage): a process with "
            "waiters rewrites its key well within the bucket's max age; a record whose "
            "owner's lease expired may be taken over.",
            "Lease",
            _params("waiter"),
        ),
    }


def _op(
    action: str,
    channel: str,
    messages: list[str],
    summary: str,
    description: str,
    *,
    reply: tuple[str, str] | None = None,
    queue: str | None = None,
    **extensions: Any,
) -> dict[str, Any]:
    def ref(ch: str, msg: str) -> dict[str, str]:
        return {"$ref": f"#/channels/{ch}/messages/{msg[0].lower() + msg[1:]}"}

    op: dict[str, Any] = {
        "action": action,
        "channel": {"$ref": f"#/channels/{channel}"},
        "summary": summary,
        "description": description,
        "messages": [ref(channel, m) for m in messages],
    }
    if reply is not None:
        op["reply"] = {
            "channel": {"$ref": f"#/channels/{reply[0]}"},
            "messages": [ref(reply[0], reply[1])],
        }
    if queue is not None:
        op["bindings"] = {"nats": {"queue": queue, "bindingVersion": NATS_BINDING_VERSION}}
    op.update({f"x-hookbus-{k.replace('_', '-')}": v for k, v in extensions.items()})
    return op


def _operations() -> dict[str, Any]:
    handler_group = "{handler}"
    return {
        "serveHandler": _op(
            "receive",
            "handler",
            ["EventEnvelope"],
            "A worker serves one handler.",
            "Subscribe in the handler's queue group (its encoded name) and answer every "
            "request with one HookReply, within the envelope's `budget_s` (seconds, counted "
            "from receipt on the worker's own clock).",
            reply=("handlerReply", "HookReply"),
            queue_group=handler_group,
            role="worker",
        ),
        "serveHandlerInstance": _op(
            "receive",
            "handlerInstance",
            ["EventEnvelope"],
            "A worker serves one handler on its own instance subject.",
            "Plain subscription (no queue group) on the instance subject: hedges and retries "
            "addressed to this process.",
            reply=("handlerReply", "HookReply"),
            role="worker",
        ),
        "serveChain": _op(
            "receive",
            "chain",
            ["EventEnvelope"],
            "A worker process runs a chain of its handlers.",
            "Subscribe in the set's queue group (its id); run the steps in order with the "
            "folding rules (a deny, a failure under policy deny, an unreadable result or a "
            "parallel step's modify ends the chain; modify with data chains), each within its "
            "`timeout_s` and the envelope's `budget_s`; answer one HookReply with `chain`.",
            reply=("handlerReply", "HookReply"),
            queue_group="{set}",
            role="worker",
        ),
        "serveChainInstance": _op(
            "receive",
            "chainInstance",
            ["EventEnvelope"],
            "A worker process runs a chain sent to it alone.",
            "Plain subscription (no queue group) on the chain's instance subject: hedges.",
            reply=("handlerReply", "HookReply"),
            role="worker",
        ),
        "serveCollect": _op(
            "receive",
            "collect",
            ["EventEnvelope"],
            "A worker answers emit_and_collect.",
            "Subscribe in the handler's queue group, as for the handler subject; answer "
            "with one HookReply naming the handler.",
            reply=("handlerReply", "HookReply"),
            queue_group=handler_group,
            role="worker",
        ),
        "serveEmit": _op(
            "receive",
            "emit",
            ["EmitRequest"],
            "The dispatcher service folds one emit.",
            "Calls the event's handlers in priority order and folds their results "
            "(see docs/wire.md); answers one EmitReply.",
            reply=("emitReply", "EmitReply"),
            queue=DISPATCHER_QUEUE_GROUP,
            role="dispatcher",
        ),
        "serveEmitAndCollect": _op(
            "receive",
            "emitAndCollect",
            ["CollectRequest"],
            "The dispatcher service runs one emit_and_collect.",
            "Publishes once on the event's collect subject and answers one CollectReply.",
            reply=("collectReply", "CollectReply"),
            queue=DISPATCHER_QUEUE_GROUP,
            role="dispatcher",
        ),
        "publishSuspensionEvent": _op(
            "send",
            "suspensionEvents",
            ["HookEvent"],
            "A suspension changed state.",
            "Published after each successful write of a record (pending, resolved, cancelled).",
            role="dispatcher, resolver",
        ),
        "appendDecision": _op(
            "send",
            "decisions",
            ["DecisionRecord"],
            "One decided emit is recorded.",
            "A JetStream publish with `Nats-Msg-Id` = the record's id (stored once).",
            role="dispatcher",
        ),
        "declareHandler": _op(
            "send",
            "handlersBucket",
            ["HandlerDeclaration"],
            "A worker declares a handler.",
            "KV create, or update with the last revision (compare-and-set); the value must "
            "match its key (event, name) and carry the derived subject, collect subject and "
            "queue group.",
            role="worker",
        ),
        "requireHandler": _op(
            "send",
            "requiredBucket",
            ["RequiredHandler"],
            "An operator requires a handler.",
            "KV put of a RequiredHandler (`hookbus handlers require EVENT NAME`).",
            role="admin",
        ),
        "writeSuspension": _op(
            "send",
            "suspensionsBucket",
            ["SuspensionRecord"],
            "A waiter, resolver or canceller writes a suspension record.",
            "KV create (absent -> pending or pre-registered) or update with the last "
            "revision; every write has a fresh `write_id`.",
            role="dispatcher, resolver",
        ),
        "writeApproval": _op(
            "send",
            "approvalsBucket",
            ["ApprovalRecord"],
            "The deciding dispatcher asks, resolves (from the first answer proof) or closes "
            "an approval.",
            "KV create (absent -> pending) or update with the last revision; every write has "
            "a fresh `write_id`.",
            role="dispatcher",
        ),
        "proveApprovalAnswer": _op(
            "send",
            "approvalAnswerProofs",
            ["ApprovalAnswer"],
            "An approver answers an approval.",
            "KV create of the proof under the approver's own key; the deciding dispatcher "
            "then resolves the record with it.",
            role="approver",
        ),
        "proveAnswer": _op(
            "send",
            "answerProofs",
            ["ApprovalAnswer"],
            "An approver answers a tool approval.",
            "KV create of the proof under the approver's own key; the waiting agent then "
            "resolves the record with it.",
            role="approver",
        ),
        "storeGrant": _op(
            "send",
            "grantsBucket",
            ["ApprovalGrant"],
            '"Allow always" is remembered.',
            'KV put by the dispatcher that applied an "Allow always" answer.',
            role="dispatcher",
        ),
        "announceWorker": _op(
            "receive",
            "workerService",
            ["ServiceRequest"],
            "A worker process answers the NATS services API (liveness).",
            f"Run a services API service named `{WORKER_SERVICE_NAME}` (a NATS client's "
            "services API, or answer the `$SRV` subjects by hand: `PING`, `INFO` and `STATS`, "
            "bare, with the name, and with the name and instance id), with the served "
            "handlers' encoded keys, space-separated, in metadata `handlers`.",
            reply=("workerServiceReply", "WorkerServiceInfo"),
            role="worker",
        ),
        "announceDispatcher": _op(
            "receive",
            "dispatcherService",
            ["ServiceRequest"],
            "A dispatcher service replica answers the NATS services API.",
            "Its endpoints, metadata and per-endpoint request counts.",
            reply=("dispatcherServiceReply", "DispatcherServiceInfo"),
            role="dispatcher",
        ),
        "refreshLease": _op(
            "send",
            "leasesBucket",
            ["Lease"],
            "A process with waiters keeps its lease.",
            "KV put of the waiter id, repeated well within the bucket's max age.",
            role="dispatcher",
        ),
    }


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of hookbus's wire contract (see the module docstring),
    as plain JSON data: ``{"asyncapi": "3.0.0", "info", "servers", "defaultContentType",
    "channels", "operations", "components": {"schemas", "messages", "parameters"}}``.
    Its schemas use only keywords that JSON Schema draft-07 (AsyncAPI's schema format) and
    2020-12 share."""
    schemas = schema_definitions(ref_template="#/components/schemas/{name}")
    schemas["Lease"] = {
        "type": "string",
        "pattern": "^[0-9a-f]{1,64}$",
        "description": "The waiter id of the process that holds the lease (plain text).",
    }
    schemas.update(_service_schemas())
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": "hookbus",
            "version": "1.0.0",
            "description": (
                "A distributed hook dispatcher for AI agents on NATS (wire version "
                f"`{SUBJECT_PREFIX}`). Agents emit events to the dispatcher service; it calls "
                "the event's handlers (workers, one queue group per handler) in priority order "
                "and folds their results. Handlers are declared in a JetStream KV bucket; "
                "suspensions, approvals and grants are KV records. The JSON Schema of every "
                "payload: `hookbus schema`; the folding rules: docs/wire.md."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "A development server (`hookbus server`): JetStream on, no "
                "authentication. Secured deployments: see docs/security.md.",
            },
        },
        "channels": _channels(),
        "operations": _operations(),
        "components": {
            "schemas": schemas,
            "messages": _messages(),
            "parameters": PARAMETERS,
        },
    }


def _service_info(name: str, metadata: dict[str, Any], what: str) -> dict[str, Any]:
    """A NATS services API answer (ADR-32 ``io.nats.micro.v1.*_response``) of service `name`."""
    text = {"type": "string"}
    return {
        "type": "object",
        "description": f"The answer of one {what} to a `$SRV` request (NATS services API, "
        "ADR-32): `type` is `io.nats.micro.v1.ping_response`, `info_response` or "
        "`stats_response`; `INFO` adds `description` and `endpoints`, `STATS` adds "
        "`started` and per-endpoint counts.",
        "required": ["type", "name", "id", "version"],
        "properties": {
            "type": {**text, "description": "The answer's kind (`io.nats.micro.v1.*`)."},
            "name": {"type": "string", "enum": [name], "description": "The service's name."},
            "id": {**text, "description": "This instance's id (one per process)."},
            "version": {**text, "description": "The service's version (semantic version)."},
            "metadata": {
                "type": "object",
                "description": "Free-form strings.",
                "properties": metadata,
                "additionalProperties": {"type": "string"},
            },
            "description": {**text, "description": "What the service does (INFO)."},
            "endpoints": {
                "type": "array",
                "description": "Its endpoints (INFO, STATS): name, subject, queue group and "
                "metadata; STATS adds `num_requests`, `num_errors`, `processing_time` (ns).",
                "items": {"type": "object"},
            },
            "started": {**text, "description": "When it started, RFC 3339 (STATS)."},
        },
    }


_KEY = r"[A-Za-z0-9_=-]+\.[A-Za-z0-9_=-]+"


def _service_schemas() -> dict[str, Any]:
    """The schemas of the two services' `$SRV` messages (not hookbus types: NATS's own)."""
    handlers = {
        "type": "string",
        "description": "The handlers this worker process serves: their registry keys "
        "`<event>.<handler>`, both names encoded as in subjects, separated by one space, e.g. "
        "`tool=3Apre.guard tool=3Apre.sql_guard`. A key that does not parse is ignored.",
        "pattern": f"^({_KEY}( {_KEY})*)?$",
    }
    bound = {"type": "string", "description": "A bound of this replica (`none`: off)."}
    return {
        "ServiceRequest": {
            "type": "string",
            "maxLength": 0,
            "description": "A services API request: an empty body.",
        },
        "WorkerServiceInfo": _service_info(
            WORKER_SERVICE_NAME, {"handlers": handlers}, "worker process"
        ),
        "DispatcherServiceInfo": _service_info(
            DISPATCHER_SERVICE_NAME,
            {
                "max_concurrency": bound,
                "agent_max_in_flight": bound,
                "agent_rate_per_s": bound,
                "agent_burst": bound,
                "audit": {"type": "string", "description": "`on` or `off`.", "enum": ["on", "off"]},
            },
            "dispatcher service replica",
        ),
    }
