"""Who may publish and subscribe to what: hookbus's roles as NATS permissions (data only).

Every identity is a NATS nkey user of one tenant (a NATS account; accounts share nothing).
Each role below is a function returning a `RolePermissions`: the subjects the user may
publish to, the subjects it may subscribe to (``"subject queue"`` entries allow that
subscription only in that queue group), and whether it may answer requests it receives
(``allow_responses``: a reply to the requester's inbox, whatever that inbox is). Anything
not listed is refused by the server. Every entry carries the reason it is there, and
`permission_table` returns the rows of the table in docs/security.md.

``<a>`` is the agent token (``encode_token(agent name)``), ``<h>`` a handler token,
``<p>`` the approver token, ``<PUBKEY>`` the user's nkey public key: every user may
subscribe only to its own inbox prefix ``_INBOX_<PUBKEY>``, so nobody hears another's
replies (clients connect with ``inbox_prefix=inbox_prefix(public_key)``).

Roles (one user per identity):

==============  ================================================================
``admin``       everything hookbus (all subjects, buckets, streams; delete/purge)
``agent``       its own emits, suspension events, suspensions and decisions; reads the
                handler registry; calls handlers directly (embedded dispatcher)
``worker``      serves its handlers (queue groups restricted to them; chain
                requests of exactly its handler set ``<set>``, `handler_set_id`
                of its names) and declares only them in the registry
``dispatcher``  the service: answers every agent's emits, calls every handler,
                writes suspension records, creates the buckets and the audit stream;
                answers the services API as ``hookbus-dispatcher``
``approver``    answers approvals: resolves suspensions, writes its own answer
                proofs and "Allow always" grants
``auditor``     reads the decision audit stream, nothing else
==============  ================================================================

JetStream is reached through its API subjects (nats-server 2.11+, nats-py 2.16): a KV put
of key K in bucket B publishes to ``$KV.B.K``; a get (buckets have ``allow_direct``) is a
request to ``$JS.API.DIRECT.GET.KV_B.$KV.B.K``, scopable by key prefix; a watch or listing
creates a consumer, scopable by filter only when named (``$JS.API.CONSUMER.CREATE.KV_B.
<name>.<filter>``), so roles limited to a key prefix get only that form.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from ._chains import handler_set_id
from ._subjects import (
    APPROVALS_BUCKET,
    CHAIN_WILDCARD,
    COLLECT_SERVICE_WILDCARD,
    DECISIONS_STREAM,
    DECISIONS_WILDCARD,
    DISPATCHER_QUEUE_GROUP,
    DISPATCHER_SERVICE_NAME,
    EMIT_SERVICE_WILDCARD,
    HANDLER_SUBJECT_PREFIX,
    HANDLERS_BUCKET,
    LEASES_BUCKET,
    SUBJECT_PREFIX,
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSIONS_BUCKET,
    WORKER_SERVICE_NAME,
    encode_token,
)

__all__ = [
    "DISPATCHER_RESPONSE_EXPIRES_S",
    "ROLES",
    "Grant",
    "PermissionRow",
    "ResponsePermission",
    "Role",
    "RolePermissions",
    "admin",
    "agent",
    "approver",
    "auditor",
    "dispatcher",
    "inbox_prefix",
    "permission_table",
    "permissions_for",
    "worker",
]

DISPATCHER_RESPONSE_EXPIRES_S: Final = 20 * 60
"""How long a dispatcher may take to answer an emit: above the service's largest emit
timeout (900 s, an approval wait included) with room for the drain. NATS's default for
``allow_responses`` is 2 minutes, which would refuse the answer to a long approval."""

Role = Literal["admin", "agent", "worker", "dispatcher", "approver", "auditor"]
ROLES: Final[tuple[Role, ...]] = ("admin", "agent", "worker", "dispatcher", "approver", "auditor")

_KV_BUCKETS: Final = (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET, LEASES_BUCKET)
_JS: Final = "$JS.API"
_SRV_VERBS: Final = ("PING", "INFO", "STATS")


@dataclass(frozen=True)
class Grant:
    """One permission entry: a subject (``"subject queue"`` for a queue-only subscription)
    and why the role needs it."""

    subject: str
    why: str


@dataclass(frozen=True)
class ResponsePermission:
    """``allow_responses``: answer at most `max_msgs` messages to each reply subject
    received, within `expires_s` seconds of receiving it."""

    max_msgs: int = 1
    expires_s: float = 120.0


@dataclass(frozen=True)
class RolePermissions:
    """What one user of a role may do. Only what is listed is allowed."""

    role: Role
    name: str
    publish_grants: tuple[Grant, ...]
    subscribe_grants: tuple[Grant, ...]
    allow_responses: ResponsePermission | None = None

    @property
    def publish(self) -> list[str]:
        """The publish allow list."""
        return _unique(g.subject for g in self.publish_grants)

    @property
    def subscribe(self) -> list[str]:
        """The subscribe allow list (``"subject queue"`` entries: that queue group only)."""
        return _unique(g.subject for g in self.subscribe_grants)


@dataclass(frozen=True)
class PermissionRow:
    """A row of the role table: role, ``publish`` / ``subscribe`` / ``responses``, the
    subject (with ``<a>``, ``<h>``, ``<p>``, ``<PUBKEY>`` placeholders) and why."""

    role: str
    direction: str
    subject: str
    why: str


def inbox_prefix(public_key: str) -> str:
    """The inbox prefix of the user with nkey `public_key` (``_INBOX_<PUBKEY>``): give it
    to ``nats.connect(..., inbox_prefix=...)``; the user may subscribe under it only."""
    return f"_INBOX_{public_key}"


# -- building blocks ------------------------------------------------------------------


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _inbox(public_key: str | None) -> Grant:
    prefix = inbox_prefix(public_key) if public_key else "_INBOX_<PUBKEY>"
    return Grant(f"{prefix}.>", "its own inbox: replies, JetStream acks, watch deliveries")


def _js_info() -> Grant:
    return Grant(f"{_JS}.INFO", "JetStream account info (clients check JetStream is on)")


def _flow_control() -> Grant:
    return Grant("$JS.FC.>", "flow-control replies of its KV watches")


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _kv_open(bucket: str) -> Grant:
    return Grant(f"{_JS}.STREAM.INFO.{_kv_stream(bucket)}", f"open {bucket}")


def _kv_create(bucket: str) -> Grant:
    return Grant(f"{_JS}.STREAM.CREATE.{_kv_stream(bucket)}", f"create {bucket} if missing")


def _kv_put(bucket: str, keys: str, why: str) -> Grant:
    return Grant(f"$KV.{bucket}.{keys}", why)


def _kv_read_all(bucket: str) -> list[Grant]:
    """Read every key of `bucket`: gets (both forms) and watches (both consumer forms)."""
    stream = _kv_stream(bucket)
    return [
        Grant(f"{_JS}.DIRECT.GET.{stream}", f"get by sequence in {bucket}"),
        Grant(f"{_JS}.DIRECT.GET.{stream}.>", f"get any key of {bucket}"),
        Grant(f"{_JS}.CONSUMER.CREATE.{stream}", f"watch / list {bucket} (unnamed consumer)"),
        Grant(f"{_JS}.CONSUMER.CREATE.{stream}.>", f"watch / list {bucket} (named consumer)"),
        *_consumer_upkeep(stream),
    ]


def _kv_read_prefix(bucket: str, prefix: str, why: str) -> list[Grant]:
    """Read only keys ``<prefix>.>`` of `bucket`: no unscoped get, only named consumers
    whose filter is within the prefix."""
    stream = _kv_stream(bucket)
    keys = f"$KV.{bucket}.{prefix}.>"
    return [
        Grant(f"{_JS}.DIRECT.GET.{stream}.{keys}", f"get {why}"),
        Grant(f"{_JS}.CONSUMER.CREATE.{stream}.*.{keys}", f"watch {why} (named consumer)"),
        *_consumer_upkeep(stream),
    ]


def _consumer_upkeep(stream: str) -> list[Grant]:
    return [
        Grant(f"{_JS}.CONSUMER.INFO.{stream}.*", "check its consumers"),
        Grant(f"{_JS}.CONSUMER.DELETE.{stream}.*", "release its consumers when a watch ends"),
    ]


def _srv_requests() -> list[Grant]:
    why = "liveness pings of the workers (nats.micro)"
    services = "the dispatcher services' endpoints and request counts (nats.micro)"
    return [
        *(Grant(f"$SRV.{verb}", why) for verb in _SRV_VERBS),
        Grant(f"$SRV.*.{WORKER_SERVICE_NAME}", why),
        Grant(f"$SRV.*.{WORKER_SERVICE_NAME}.*", why),
        Grant(f"$SRV.*.{DISPATCHER_SERVICE_NAME}", services),
        Grant(f"$SRV.*.{DISPATCHER_SERVICE_NAME}.*", services),
    ]


def _srv_answers(name: str, why: str) -> list[Grant]:
    """Answer the services API's verbs as service `name`: every service, every `name`
    service, this instance (the replies go out through ``allow_responses``)."""
    return [
        *(Grant(f"$SRV.{verb}", why) for verb in _SRV_VERBS),
        Grant(f"$SRV.*.{name}", why),
        Grant(f"$SRV.*.{name}.*", why),
    ]


def _call_handlers() -> list[Grant]:
    handler = HANDLER_SUBJECT_PREFIX
    return [
        Grant(f"{handler}.*.*", "call a handler (queue group of its replicas)"),
        Grant(CHAIN_WILDCARD, "call a chain of one worker process's handlers (chain request)"),
        Grant(f"{CHAIN_WILDCARD}.*", "a chain request to one worker instance (hedges)"),
        Grant(f"{handler}.*.*.*", "call a handler on one worker instance (hedges)"),
        Grant(f"{SUBJECT_PREFIX}.collect.*", "emit_and_collect: one request every handler hears"),
    ]


# -- the roles ------------------------------------------------------------------------


def admin(name: str = "admin", *, public_key: str | None = None) -> RolePermissions:
    """Everything hookbus: every subject, bucket and stream, deletes and purges included
    (the only role that may delete, purge or update streams)."""
    return RolePermissions(
        role="admin",
        name=name,
        publish_grants=(
            Grant(f"{SUBJECT_PREFIX}.>", "every hookbus subject"),
            Grant("$SRV.>", "the services API (liveness)"),
            Grant("$KV.>", "write any key of any bucket, required handlers included"),
            Grant(f"{_JS}.>", "the whole JetStream API: create, update, delete, purge"),
            Grant("$JS.ACK.>", "acknowledge messages of its consumers"),
            _flow_control(),
        ),
        subscribe_grants=(
            _inbox(public_key),
            Grant(SUSPENSION_EVENTS_WILDCARD, "every agent's suspension events"),
        ),
    )


def _agent(a: str, public_key: str | None) -> RolePermissions:
    p = SUBJECT_PREFIX
    own = "its own"
    return RolePermissions(
        role="agent",
        name=a,
        publish_grants=(
            Grant(f"{p}.emit.{a}.*", "emit through the dispatcher service, as itself only"),
            Grant(f"{p}.emit_and_collect.{a}.*", "emit_and_collect through the service"),
            *_call_handlers(),
            Grant(
                f"{p}.suspension.{a}.>", f"{own} suspension events (pending / resolved / cancelled)"
            ),
            Grant(f"{p}.decisions.{a}", f"{own} decisions to the audit stream"),
            *_srv_requests(),
            _kv_put(SUSPENSIONS_BUCKET, f"{a}.*", f"{own} suspension records (`<a>.<label>`)"),
            _kv_put(LEASES_BUCKET, ">", "its waiter lease"),
            _js_info(),
            *(_kv_open(b) for b in _KV_BUCKETS),
            *_kv_read_all(HANDLERS_BUCKET),
            *_kv_read_prefix(SUSPENSIONS_BUCKET, a, f"{own} suspensions and their answers"),
            *_kv_read_prefix(APPROVALS_BUCKET, a, f'{own} "Allow always" grants'),
            *_kv_read_all(LEASES_BUCKET),
            _flow_control(),
        ),
        subscribe_grants=(
            _inbox(public_key),
            Grant(f"{p}.suspension.{a}.>", f"{own} suspension events"),
        ),
    )


def agent(name: str, *, public_key: str | None = None) -> RolePermissions:
    """An agent (one per agent id): its own emits, suspension events, suspensions, grants (read)
    and decisions; reads the registry and calls handlers directly (embedded dispatcher).

    Raises:
        BadRequestError: `name` is empty.
    """
    perms = _agent(encode_token(name), public_key)
    return _renamed(perms, name)


def _worker(
    name: str, handler_tokens: Sequence[str], set_id: str, public_key: str | None
) -> RolePermissions:
    handler = HANDLER_SUBJECT_PREFIX
    chain = f"{SUBJECT_PREFIX}.chain.*.{set_id}"
    serve: list[Grant] = [
        Grant(f"{chain} {set_id}", "chain requests for exactly its handler set"),
        Grant(f"{chain}.*", "chain requests for its handler set to this instance (hedges)"),
    ]
    declare: list[Grant] = []
    for h in handler_tokens:
        serve += [
            Grant(f"{handler}.*.{h} {h}", "its handler's requests, in the handler's queue group"),
            Grant(f"{handler}.*.{h}.*", "its handler's requests to this instance (hedges)"),
            Grant(f"{SUBJECT_PREFIX}.collect.* {h}", "emit_and_collect, handler's queue group"),
        ]
        declare.append(
            _kv_put(HANDLERS_BUCKET, f"*.{h}", "declare its own handler (`<event>.<h>`)")
        )
    srv = _srv_answers(WORKER_SERVICE_NAME, "answer liveness pings (nats.micro)")
    return RolePermissions(
        role="worker",
        name=name,
        publish_grants=(
            *declare,
            _js_info(),
            _kv_open(HANDLERS_BUCKET),
            _kv_create(HANDLERS_BUCKET),
            *_kv_read_all(HANDLERS_BUCKET),
            _flow_control(),
        ),
        subscribe_grants=(_inbox(public_key), *serve, *srv),
        # one connection serving N handlers of an event hears one emit_and_collect N times
        # (one per queue group), with one reply subject: N answers to it. nats-server 2.15
        # lets N answers to one reply subject through only with max >= 2N - 1 (measured by
        # tests/test_auth.py): 2N.
        allow_responses=ResponsePermission(max_msgs=2 * max(1, len(handler_tokens))),
    )


def worker(
    name: str, handlers: Sequence[str] | None = None, *, public_key: str | None = None
) -> RolePermissions:
    """A worker identity serving `handlers` (default: one handler named like the worker):
    subscribes only to their subjects and queue groups, declares only them.

    Raises:
        BadRequestError: a name is empty.
    """
    encode_token(name)
    names = list(handlers) if handlers else [name]
    perms = _worker(
        name, _unique(encode_token(h) for h in names), handler_set_id(names), public_key
    )
    return perms


def dispatcher(name: str = "dispatcher", *, public_key: str | None = None) -> RolePermissions:
    """The dispatcher service: answers every agent's emits (queue group
    `DISPATCHER_QUEUE_GROUP`), calls every handler, writes suspension records and
    events for any agent, records decisions, creates the buckets and the audit stream, and
    answers the services API (``$SRV.PING`` / ``INFO`` / ``STATS``) as
    `DISPATCHER_SERVICE_NAME`."""
    q = DISPATCHER_QUEUE_GROUP
    return RolePermissions(
        role="dispatcher",
        name=name,
        publish_grants=(
            *_call_handlers(),
            Grant(SUSPENSION_EVENTS_WILDCARD, "suspension events of any agent"),
            Grant(DECISIONS_WILDCARD, "decisions of any agent to the audit stream"),
            *_srv_requests(),
            _kv_put(SUSPENSIONS_BUCKET, "*.*", "suspension records of any agent (not proofs)"),
            _kv_put(LEASES_BUCKET, ">", "its waiter lease"),
            _js_info(),
            *(_kv_open(b) for b in _KV_BUCKETS),
            *(_kv_create(b) for b in _KV_BUCKETS),
            Grant(f"{_JS}.STREAM.INFO.{DECISIONS_STREAM}", "open the audit stream"),
            Grant(f"{_JS}.STREAM.CREATE.{DECISIONS_STREAM}", "create the audit stream"),
            *(g for b in _KV_BUCKETS for g in _kv_read_all(b)),
            _flow_control(),
        ),
        subscribe_grants=(
            _inbox(public_key),
            Grant(f"{EMIT_SERVICE_WILDCARD} {q}", "every agent's emits, in the dispatcher group"),
            Grant(f"{COLLECT_SERVICE_WILDCARD} {q}", "every agent's emit_and_collect, same group"),
            Grant(SUSPENSION_EVENTS_WILDCARD, "suspension events (approval waits)"),
            *_srv_answers(
                DISPATCHER_SERVICE_NAME, "answer the services API: endpoints, stats (nats.micro)"
            ),
        ),
        allow_responses=ResponsePermission(max_msgs=1, expires_s=DISPATCHER_RESPONSE_EXPIRES_S),
    )


def _approver(pt: str, public_key: str | None) -> RolePermissions:
    return RolePermissions(
        role="approver",
        name=pt,
        publish_grants=(
            Grant(SUSPENSION_EVENTS_WILDCARD, "events of the suspensions it resolves"),
            _kv_put(SUSPENSIONS_BUCKET, "*.*", "resolve or cancel a suspension"),
            _kv_put(SUSPENSIONS_BUCKET, f"*.*.{pt}", "its own answer proofs (`<a>.<label>.<p>`)"),
            _kv_put(APPROVALS_BUCKET, ">", '"Allow always" grants and their revocation'),
            _kv_put(LEASES_BUCKET, ">", "its waiter lease"),
            _js_info(),
            *(_kv_open(b) for b in _KV_BUCKETS),
            *(g for b in _KV_BUCKETS for g in _kv_read_all(b)),
            _flow_control(),
        ),
        subscribe_grants=(
            _inbox(public_key),
            Grant(
                SUSPENSION_EVENTS_WILDCARD, "every agent's suspension events (pending approvals)"
            ),
        ),
    )


def approver(name: str, *, public_key: str | None = None) -> RolePermissions:
    """A human or approval UI: reads every suspension and grant, resolves suspensions,
    writes its own answer proofs and "Allow always" grants.

    Raises:
        BadRequestError: `name` is empty.
    """
    return _renamed(_approver(encode_token(name), public_key), name)


def auditor(name: str = "auditor", *, public_key: str | None = None) -> RolePermissions:
    """Reads the decision audit stream (`DECISIONS_STREAM`) through JetStream, nothing else."""
    s = DECISIONS_STREAM
    return RolePermissions(
        role="auditor",
        name=name,
        publish_grants=(
            _js_info(),
            Grant(f"{_JS}.STREAM.INFO.{s}", "open the audit stream"),
            Grant(f"{_JS}.CONSUMER.CREATE.{s}", "read it (unnamed consumer)"),
            Grant(f"{_JS}.CONSUMER.CREATE.{s}.>", "read it (named consumer, any filter)"),
            Grant(f"{_JS}.CONSUMER.DURABLE.CREATE.{s}.*", "read it (durable consumer)"),
            Grant(f"{_JS}.CONSUMER.MSG.NEXT.{s}.*", "pull from its consumers"),
            Grant(f"{_JS}.STREAM.MSG.GET.{s}", "get one decision"),
            Grant(f"{_JS}.DIRECT.GET.{s}", "get one decision (direct)"),
            Grant(f"{_JS}.DIRECT.GET.{s}.>", "get the last decision of an agent (direct)"),
            *_consumer_upkeep(s),
            Grant(f"$JS.ACK.{s}.>", "acknowledge what it read"),
            _flow_control(),
        ),
        subscribe_grants=(_inbox(public_key),),
    )


def permissions_for(
    role: Role, name: str, *, handlers: Sequence[str] | None = None, public_key: str | None = None
) -> RolePermissions:
    """The permissions of identity `name` of `role` (`handlers`: a worker's).

    Raises:
        ValueError: unknown role, or `handlers` given for another role than worker.
        BadRequestError: a name is empty.
    """
    if handlers and role != "worker":
        raise ValueError(f"only a worker serves handlers, not a {role}")
    if role == "admin":
        return admin(name, public_key=public_key)
    if role == "agent":
        return agent(name, public_key=public_key)
    if role == "worker":
        return worker(name, handlers, public_key=public_key)
    if role == "dispatcher":
        return dispatcher(name, public_key=public_key)
    if role == "approver":
        return approver(name, public_key=public_key)
    if role == "auditor":
        return auditor(name, public_key=public_key)
    raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")


def permission_table() -> list[PermissionRow]:
    """Every role's entries with placeholders (``<a>``, ``<h>``, ``<p>``, ``<PUBKEY>``), in
    role order, publish then subscribe then responses: the rows of docs/security.md."""
    roles = [
        admin(),
        _agent("<a>", None),
        _worker("<name>", ["<h>"], "<set>", None),
        dispatcher(),
        _approver("<p>", None),
        auditor(),
    ]
    rows: list[PermissionRow] = []
    for perms in roles:
        for direction, grants in (
            ("publish", perms.publish_grants),
            ("subscribe", perms.subscribe_grants),
        ):
            seen: set[str] = set()
            for g in grants:
                if g.subject not in seen:
                    seen.add(g.subject)
                    rows.append(PermissionRow(perms.role, direction, g.subject, g.why))
        r = perms.allow_responses
        if r is not None:
            limit = "2 x its handlers" if perms.role == "worker" else str(r.max_msgs)
            rows.append(
                PermissionRow(
                    perms.role,
                    "responses",
                    f"max {limit} per request, within {r.expires_s:g} s",
                    "answer a request on the requester's reply subject",
                )
            )
    return rows


def _renamed(perms: RolePermissions, name: str) -> RolePermissions:
    return replace(perms, name=name)
