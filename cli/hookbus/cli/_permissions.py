"""Who may publish and subscribe to what: hookbus's roles as NATS permissions (data only).

Every identity is a NATS nkey user of one tenant (a NATS account; accounts share nothing).
Each role below is a function returning a `RolePermissions`: the subjects the user may
publish to, the subjects it may subscribe to (``"subject queue"`` entries allow that
subscription only in that queue group), and whether it may answer requests it receives
(``allow_responses``: a reply to the requester's inbox, whatever that inbox is). Anything
not listed is refused by the server. Every entry carries the reason it is there, and
`permission_table` returns the rows of the table in docs/security.md.

``<a>`` is the agent token (``encode_token(agent name)``), ``<e>``/``<h>`` a worker's
event and handler tokens, ``<p>`` the approver token, ``<PUBKEY>`` the user's nkey public
key, ``<slot>`` one of its consumer names (`slot_names`). Every user may subscribe only to
its own inbox prefix ``_INBOX_<PUBKEY>``, so nobody hears another's replies (clients
connect with ``inbox_prefix=inbox_prefix(public_key)``).

Roles (one user per identity):

==================  ============================================================
``admin``           everything hookbus; the only role that creates, changes or deletes
                    streams and buckets (``hookbus auth provision``)
``agent``           a client of the dispatcher service: its own emits; hears and reads
                    its own suspensions; writes nothing the service does not bound
``agent`` embedded  also decides for itself (an embedded ``HookDispatcher``): reads the
                    handler registry, calls handlers, writes its own suspension records,
                    records its own decisions, reads its own grants; it may not ask for
                    approvals
``worker``          serves exactly its (event, handler) pairs: their queue groups, chain
                    requests of its handler set on those events, their declarations; pings
                    the workers' liveness (is a differing declaration's handler served)
``dispatcher``      the service, the decider: answers every agent's emits, calls every
                    handler, writes suspension and approval records and grants
``approver``        reads approvals and suspensions, writes only its own answer proofs;
                    pings the services' liveness (read-only ``$SRV`` PING / INFO / STATS)
``auditor``         reads the decision audit stream, nothing else
==================  ============================================================

JetStream is reached through its API subjects (nats-server 2.11+, nats-py 2.16): a KV put
of key K in bucket B publishes to ``$KV.B.K``; a get from the stream's leader (how hookbus
reads a record it decides on) is a request to ``$JS.API.STREAM.MSG.GET.KV_B`` naming the key
in its body, so it is given only to roles that may read every key of B; a direct get
(buckets have ``allow_direct``; any replica answers, one that lags answers an older
revision) is a request to ``$JS.API.DIRECT.GET.KV_B.$KV.B.K``, scopable by key prefix: an
agent reads its own keys that way (``hookbus._core.leader_reads``); a watch or listing
creates a consumer. NATS cannot count consumers per user, but a named consumer's create
request carries its name and filter in its subject (``$JS.API.CONSUMER.CREATE.KV_B.<name>.
<filter>``): every role but the dispatcher may create only consumers named by its own
slots (``hookbus._core.consumer_slots.CONSUMER_SLOTS`` of them), with a filter within
what it may read, and inspect or delete only those. No role but the admin may create a
stream: a create request's body
chooses the stream's subjects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Final, Literal

from hookbus._core.consumer_slots import slot_names
from hookbus.schemas import (
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
    REGISTRY_CHANGES_WILDCARD,
    SUBJECT_PREFIX,
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSIONS_BUCKET,
    WORKER_SERVICE_NAME,
    BadRequestError,
    encode_token,
    handler_set_id,
    is_js_domain_name,
)

__all__ = [
    "DISPATCHER_RESPONSE_EXPIRES_S",
    "ROLES",
    "Permission",
    "PermissionRow",
    "ResponsePermission",
    "Role",
    "RolePermissions",
    "admin",
    "agent",
    "approver",
    "auditor",
    "dispatcher",
    "in_js_domains",
    "inbox_prefix",
    "parse_worker_handler",
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

_JS: Final = "$JS.API"
_SRV_VERBS: Final = ("PING", "INFO", "STATS")


@dataclass(frozen=True)
class Permission:
    """One permission entry: a subject (``"subject queue"`` for a queue-only subscription)
    and why the role needs it."""

    subject: str
    why: str


@dataclass(frozen=True)
class ResponsePermission:
    """``allow_responses``: answer at most `max_msgs` messages to each reply subject
    received, within `expires_s` seconds of receiving it. `rule` says how `max_msgs` is
    counted (the table shows it for the roles whose count depends on the identity)."""

    max_msgs: int = 1
    expires_s: float = 120.0
    rule: str = ""


@dataclass(frozen=True)
class RolePermissions:
    """What one user of a role may do. Only what is listed is allowed."""

    role: Role
    name: str
    publish_permissions: tuple[Permission, ...]
    subscribe_permissions: tuple[Permission, ...]
    allow_responses: ResponsePermission | None = None

    @property
    def publish(self) -> list[str]:
        """The publish allow list."""
        return _unique(g.subject for g in self.publish_permissions)

    @property
    def subscribe(self) -> list[str]:
        """The subscribe allow list (``"subject queue"`` entries: that queue group only)."""
        return _unique(g.subject for g in self.subscribe_permissions)


@dataclass(frozen=True)
class PermissionRow:
    """A row of the role table: role, ``publish`` / ``subscribe`` / ``responses``, the
    subject (with ``<a>``, ``<e>``, ``<h>``, ``<p>``, ``<PUBKEY>``, ``<slot>`` placeholders)
    and why."""

    role: str
    direction: str
    subject: str
    why: str


def inbox_prefix(public_key: str) -> str:
    """The inbox prefix of the user with nkey `public_key` (``_INBOX_<PUBKEY>``): give it
    to ``nats.connect(..., inbox_prefix=...)``; the user may subscribe under it only."""
    return f"_INBOX_{public_key}"


def parse_worker_handler(spec: str) -> tuple[str, str]:
    """``"EVENT/HANDLER"`` (e.g. ``"tool:pre/security_policy"``) as ``(event, handler)``:
    what a worker identity serves. The event is everything before the first ``/``.

    Raises:
        BadRequestError: no ``/``, or an empty event or handler.
    """
    event, sep, handler = spec.partition("/")
    if not sep or not event.strip() or not handler.strip():
        raise BadRequestError(
            f"a worker serves EVENT/HANDLER pairs (e.g. tool:pre/security_policy), not {spec!r}"
        )
    return event, handler


# -- building blocks ------------------------------------------------------------------


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _inbox(public_key: str | None) -> Permission:
    prefix = inbox_prefix(public_key) if public_key else "_INBOX_<PUBKEY>"
    return Permission(f"{prefix}.>", "its own inbox: replies, JetStream acks, watch deliveries")


def _js_info() -> Permission:
    return Permission(f"{_JS}.INFO", "JetStream account info (clients check JetStream is on)")


def _kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def _kv_open(bucket: str) -> Permission:
    return Permission(f"{_JS}.STREAM.INFO.{_kv_stream(bucket)}", f"open {bucket}")


def _kv_put(bucket: str, keys: str, why: str) -> Permission:
    return Permission(f"$KV.{bucket}.{keys}", why)


def _slots(public_key: str | None) -> tuple[str, ...]:
    return slot_names(public_key) if public_key else ("<slot>",)


def _get(bucket: str, keys: str, why: str) -> Permission:
    """Direct gets of keys `keys` (``>``: any key) of `bucket`."""
    stream = _kv_stream(bucket)
    return Permission(f"{_JS}.DIRECT.GET.{stream}.$KV.{bucket}.{keys}", f"get {why}")


def _leader_get(bucket: str, why: str) -> Permission:
    """Gets of any key of `bucket` from its stream's leader (a message get names its key in
    the request's body, so it cannot be allowed by key)."""
    return Permission(f"{_JS}.STREAM.MSG.GET.{_kv_stream(bucket)}", f"get {why} from the leader")


def _slot_consumers(
    stream: str, filters: str, why: str, public_key: str | None
) -> list[Permission]:
    """Consumers on `stream` named by the user's own slots only, with a filter within
    `filters` (a subject with wildcards, or ``""``: any filter and the form without one)."""
    out: list[Permission] = []
    for slot in _slots(public_key):
        create = f"{_JS}.CONSUMER.CREATE.{stream}.{slot}"
        if filters:
            out.append(Permission(f"{create}.{filters}", f"watch {why} (its own consumer slots)"))
        else:
            out += [
                Permission(create, f"read {why} (its own consumer slots)"),
                Permission(f"{create}.>", f"read {why} (its own consumer slots, any filter)"),
            ]
        out += [
            Permission(f"{_JS}.CONSUMER.INFO.{stream}.{slot}", "check its own consumers"),
            Permission(f"{_JS}.CONSUMER.DELETE.{stream}.{slot}", "release its own consumers"),
        ]
    return out


def _kv_read_own(bucket: str, prefix: str, why: str, public_key: str | None) -> list[Permission]:
    """Read keys ``<prefix>.>`` of `bucket`: gets, and watches in its own slots."""
    keys = f"$KV.{bucket}.{prefix}.>"
    return [
        _get(bucket, f"{prefix}.>", why),
        *_slot_consumers(_kv_stream(bucket), keys, why, public_key),
    ]


def _kv_read_all_slots(bucket: str, public_key: str | None) -> list[Permission]:
    """Read every key of `bucket`: gets, and consumers in its own slots."""
    stream = _kv_stream(bucket)
    return [
        Permission(f"{_JS}.DIRECT.GET.{stream}", f"get by sequence in {bucket}"),
        _get(bucket, ">", f"any key of {bucket}"),
        _leader_get(bucket, f"any key of {bucket}"),
        *_slot_consumers(stream, "", bucket, public_key),
    ]


def _kv_read_all(bucket: str) -> list[Permission]:
    """Read every key of `bucket` with any consumer (the dispatcher service only: it is
    trusted with the shared consumer capacity, and its replicas share one identity)."""
    stream = _kv_stream(bucket)
    return [
        Permission(f"{_JS}.DIRECT.GET.{stream}", f"get by sequence in {bucket}"),
        _get(bucket, ">", f"any key of {bucket}"),
        _leader_get(bucket, f"any key of {bucket}"),
        Permission(f"{_JS}.CONSUMER.CREATE.{stream}", f"watch / list {bucket} (unnamed consumer)"),
        Permission(f"{_JS}.CONSUMER.CREATE.{stream}.>", f"watch / list {bucket} (named consumer)"),
        Permission(f"{_JS}.CONSUMER.INFO.{stream}.*", "check its consumers"),
        Permission(f"{_JS}.CONSUMER.DELETE.{stream}.*", "release its consumers when a watch ends"),
        Permission("$JS.FC.>", "flow-control replies of its ordered watches"),
    ]


def _follow_registry() -> Permission:
    return Permission(
        REGISTRY_CHANGES_WILDCARD, "the handler registry's changes (the server republishes them)"
    )


def _srv_requests() -> list[Permission]:
    why = "liveness pings of the workers (nats.micro)"
    services = "the dispatcher services' endpoints and request counts (nats.micro)"
    return [
        *(Permission(f"$SRV.{verb}", why) for verb in _SRV_VERBS),
        Permission(f"$SRV.*.{WORKER_SERVICE_NAME}", why),
        Permission(f"$SRV.*.{WORKER_SERVICE_NAME}.*", why),
        Permission(f"$SRV.*.{DISPATCHER_SERVICE_NAME}", services),
        Permission(f"$SRV.*.{DISPATCHER_SERVICE_NAME}.*", services),
    ]


def _srv_answers(name: str, why: str) -> list[Permission]:
    """Answer the services API's verbs as service `name`: every service, every `name`
    service, this instance (the replies go out through ``allow_responses``)."""
    return [
        *(Permission(f"$SRV.{verb}", why) for verb in _SRV_VERBS),
        Permission(f"$SRV.*.{name}", why),
        Permission(f"$SRV.*.{name}.*", why),
    ]


def _call_handlers() -> list[Permission]:
    handler = HANDLER_SUBJECT_PREFIX
    return [
        Permission(f"{handler}.*.*", "call a handler (queue group of its replicas)"),
        Permission(CHAIN_WILDCARD, "call a chain of one worker process's handlers (chain request)"),
        Permission(f"{CHAIN_WILDCARD}.*", "a chain request to one worker instance (hedges)"),
        Permission(f"{handler}.*.*.*", "call a handler on one worker instance (hedges)"),
        Permission(
            f"{SUBJECT_PREFIX}.collect.*", "emit_and_collect: one request every handler hears"
        ),
    ]


# -- the roles ------------------------------------------------------------------------


def admin(name: str = "admin", *, public_key: str | None = None) -> RolePermissions:
    """Everything hookbus: every subject, bucket and stream; the only role that creates,
    updates, deletes or purges streams (``hookbus auth provision`` runs as it)."""
    return RolePermissions(
        role="admin",
        name=name,
        publish_permissions=(
            Permission(f"{SUBJECT_PREFIX}.>", "every hookbus subject"),
            Permission("$SRV.>", "the services API (liveness)"),
            Permission("$KV.>", "write any key of any bucket, required handlers included"),
            Permission(f"{_JS}.>", "the whole JetStream API: create, update, delete, purge"),
            Permission("$JS.ACK.>", "acknowledge messages of its consumers"),
            Permission("$JS.FC.>", "flow-control replies of its ordered watches"),
        ),
        subscribe_permissions=(
            _inbox(public_key),
            Permission(SUSPENSION_EVENTS_WILDCARD, "every agent's suspension events"),
        ),
    )


def _agent(a: str, public_key: str | None, *, embedded: bool) -> RolePermissions:
    p = SUBJECT_PREFIX
    own = "its own"
    publish: list[Permission] = [
        Permission(f"{p}.emit.{a}.*", "emit through the dispatcher service, as itself only"),
        Permission(f"{p}.emit_and_collect.{a}.*", "emit_and_collect through the service"),
        _js_info(),
        _kv_open(SUSPENSIONS_BUCKET),
        *_kv_read_own(SUSPENSIONS_BUCKET, a, f"{own} suspensions and their proofs", public_key),
        *_srv_requests(),
    ]
    if embedded:
        publish += [
            Permission(f"{p}.suspension.{a}.>", f"{own} suspension events (pending / resolved)"),
            _kv_put(SUSPENSIONS_BUCKET, f"{a}.*", f"{own} suspension records (`<a>.<label>`)"),
            _kv_put(LEASES_BUCKET, "w.*", "its waiter lease (`w.<id>`)"),
            _kv_put(LEASES_BUCKET, f"r.{a}.*", f"{own} run claims (`r.<a>.<run>`)"),
            _kv_open(LEASES_BUCKET),
            _get(LEASES_BUCKET, "w.*", "waiter leases (is a label's waiter alive)"),
            _get(LEASES_BUCKET, f"r.{a}.*", f"{own} run claims (who runs a run id)"),
            *_call_handlers(),
            Permission(f"{p}.decisions.{a}", f"{own} decisions to the audit stream (embedded)"),
            _kv_open(HANDLERS_BUCKET),
            _kv_open(APPROVALS_BUCKET),
            *_kv_read_all_slots(HANDLERS_BUCKET, public_key),
            _get(APPROVALS_BUCKET, f"{a}.>", f'{own} "Allow always" grants and their proofs'),
        ]
    return RolePermissions(
        role="agent",
        name=a,
        publish_permissions=tuple(publish),
        subscribe_permissions=(
            _inbox(public_key),
            Permission(f"{p}.suspension.{a}.>", f"{own} suspension events"),
            *([_follow_registry()] if embedded else []),
        ),
    )


def agent(name: str, *, embedded: bool = False, public_key: str | None = None) -> RolePermissions:
    """An agent (one per agent id), a client of the dispatcher service: its own emits, and
    it hears and reads its own suspensions (the approvals the service asks for it); every
    write it makes goes through the service, which bounds it. `embedded`: it also runs its
    own ``HookDispatcher`` (reads the registry, calls handlers, writes its own suspension
    records, events and leases, records its own decisions, reads its own grants); it still
    may not create approvals (only the service does).

    Raises:
        BadRequestError: `name` is empty.
    """
    perms = _agent(encode_token(name), public_key, embedded=embedded)
    return _renamed(perms, name)


def _worker(
    name: str, pairs: Sequence[tuple[str, str]], set_id: str, public_key: str | None
) -> RolePermissions:
    handler = HANDLER_SUBJECT_PREFIX
    serve: list[Permission] = []
    declare: list[Permission] = []
    for e in _unique(e for e, _ in pairs):
        chain = f"{SUBJECT_PREFIX}.chain.{e}.{set_id}"
        serve += [
            Permission(
                f"{chain} {set_id}", "chain requests for exactly its handler set, its events"
            ),
            Permission(
                f"{chain}.*", "chain requests for its handler set to this instance (hedges)"
            ),
        ]
    for e, h in pairs:
        serve += [
            Permission(
                f"{handler}.{e}.{h} {h}", "its handler's requests, in the handler's queue group"
            ),
            Permission(f"{handler}.{e}.{h}.*", "its handler's requests to this instance (hedges)"),
            Permission(
                f"{SUBJECT_PREFIX}.collect.{e} {h}", "emit_and_collect, handler's queue group"
            ),
        ]
        declare += [
            _kv_put(HANDLERS_BUCKET, f"{e}.{h}", "declare its own handler (`<e>.<h>`)"),
            _get(HANDLERS_BUCKET, f"{e}.{h}", "its own declaration (compare-and-set)"),
        ]
    srv = _srv_answers(WORKER_SERVICE_NAME, "answer liveness pings (nats.micro)")
    per_event = max([sum(1 for x, _ in pairs if x == e) for e, _ in pairs] or [1])
    return RolePermissions(
        role="worker",
        name=name,
        publish_permissions=(
            *declare,
            _leader_get(HANDLERS_BUCKET, "its own declaration (any declaration: no secret)"),
            _js_info(),
            _kv_open(HANDLERS_BUCKET),
            Permission(
                f"$SRV.PING.{WORKER_SERVICE_NAME}",
                "liveness ping of the workers: a declaration with other settings is taken"
                " over only when no replica of its handler is live",
            ),
        ),
        subscribe_permissions=(_inbox(public_key), *serve, *srv),
        allow_responses=ResponsePermission(
            max_msgs=2 * per_event - 1,
            rule="2 x its most handlers on one event - 1",
        ),
    )


def worker(name: str, handlers: Sequence[str], *, public_key: str | None = None) -> RolePermissions:
    """A worker identity serving `handlers`, each ``"EVENT/HANDLER"``: it subscribes only
    to those handlers' subjects on those events (in their queue groups), to chain requests
    of its handler set on those events, and declares only those pairs.

    Replies (``allow_responses``): a single call is answered once; a chain of k steps
    (k >= 2 handlers of one event in this process) with at most k progress replies and one
    answer; one ``emit_and_collect`` is heard once per handler of its event (one queue
    group each) with one reply subject, and nats-server 2.15 lets n answers to one reply
    subject through only with max >= 2n - 1 (measured by tests/test_auth.py). So max is
    ``2k - 1`` with k its most handlers on one event (k + 1 <= 2k - 1 for k >= 2).

    Raises:
        BadRequestError: no handler, a handler not ``EVENT/HANDLER``, or an empty name.
    """
    encode_token(name)
    if not handlers:
        raise BadRequestError(f"worker {name!r} serves no handler: give EVENT/HANDLER pairs")
    pairs = [parse_worker_handler(h) for h in handlers]
    tokens = list(dict.fromkeys((encode_token(e), encode_token(h)) for e, h in pairs))
    return _worker(name, tokens, handler_set_id(h for _, h in pairs), public_key)


def dispatcher(name: str = "dispatcher", *, public_key: str | None = None) -> RolePermissions:
    """The dispatcher service, the decider: answers every agent's emits (queue group
    `DISPATCHER_QUEUE_GROUP`), calls every handler, writes suspension records and events
    for any agent, creates approval records and writes grants, records decisions, and
    answers the services API (``$SRV.PING`` / ``INFO`` / ``STATS``) as
    `DISPATCHER_SERVICE_NAME`. It creates no stream (the admin provisions them)."""
    q = DISPATCHER_QUEUE_GROUP
    buckets = (HANDLERS_BUCKET, SUSPENSIONS_BUCKET, APPROVALS_BUCKET, LEASES_BUCKET)
    return RolePermissions(
        role="dispatcher",
        name=name,
        publish_permissions=(
            *_call_handlers(),
            Permission(SUSPENSION_EVENTS_WILDCARD, "suspension events of any agent"),
            Permission(DECISIONS_WILDCARD, "decisions of any agent to the audit stream"),
            *_srv_requests(),
            _kv_put(SUSPENSIONS_BUCKET, "*.*", "suspension records of any agent (not proofs)"),
            _kv_put(APPROVALS_BUCKET, "*.*", "approval records of any agent (not proofs)"),
            _kv_put(APPROVALS_BUCKET, "*.*.*.*.*", '"Allow always" grants, from verified proofs'),
            _kv_put(LEASES_BUCKET, "w.*", "its waiter lease (`w.<id>`)"),
            _js_info(),
            *(_kv_open(b) for b in buckets),
            Permission(f"{_JS}.STREAM.INFO.{DECISIONS_STREAM}", "open the audit stream"),
            *(g for b in buckets for g in _kv_read_all(b)),
        ),
        subscribe_permissions=(
            _inbox(public_key),
            Permission(
                f"{EMIT_SERVICE_WILDCARD} {q}", "every agent's emits, in the dispatcher group"
            ),
            Permission(
                f"{COLLECT_SERVICE_WILDCARD} {q}", "every agent's emit_and_collect, same group"
            ),
            Permission(SUSPENSION_EVENTS_WILDCARD, "suspension events (approval waits)"),
            _follow_registry(),
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
        publish_permissions=(
            _kv_put(APPROVALS_BUCKET, f"*.*.{pt}", "its own answer proofs (`<a>.<label>.<p>`)"),
            _kv_put(SUSPENSIONS_BUCKET, f"*.*.{pt}", "its own answer proofs of suspensions"),
            _js_info(),
            _kv_open(APPROVALS_BUCKET),
            _kv_open(SUSPENSIONS_BUCKET),
            *_kv_read_all_slots(APPROVALS_BUCKET, public_key),
            *_kv_read_all_slots(SUSPENSIONS_BUCKET, public_key),
            _kv_open(HANDLERS_BUCKET),
            *_kv_read_all_slots(HANDLERS_BUCKET, public_key),
            _kv_put(LEASES_BUCKET, "w.*", "its waiter lease (`w.<id>`)"),
            _kv_open(LEASES_BUCKET),
            _get(LEASES_BUCKET, "w.*", "waiter leases"),
            *_srv_requests(),
        ),
        subscribe_permissions=(
            _inbox(public_key),
            Permission(
                SUSPENSION_EVENTS_WILDCARD, "every agent's suspension events (pending approvals)"
            ),
            _follow_registry(),
        ),
    )


def approver(name: str, *, public_key: str | None = None) -> RolePermissions:
    """A human or approval UI: reads every approval, suspension and grant, and writes only
    its own answer proofs (the decider resolves the approval from the first proof and
    writes any grant); it may ping the services API (``$SRV`` PING / INFO / STATS, read
    only), so that an approval UI shows the handlers' live replicas.

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
        publish_permissions=(
            _js_info(),
            Permission(f"{_JS}.STREAM.INFO.{s}", "open the audit stream"),
            *_slot_consumers(s, "", "the audit stream", public_key),
            *(
                Permission(f"{_JS}.CONSUMER.MSG.NEXT.{s}.{slot}", "pull from its own consumers")
                for slot in _slots(public_key)
            ),
            Permission(f"{_JS}.STREAM.MSG.GET.{s}", "get one decision"),
            Permission(f"{_JS}.DIRECT.GET.{s}", "get one decision (direct)"),
            Permission(f"{_JS}.DIRECT.GET.{s}.>", "get the last decision of an agent (direct)"),
            Permission(f"$JS.ACK.{s}.>", "acknowledge what it read"),
        ),
        subscribe_permissions=(_inbox(public_key),),
    )


def in_js_domains(perms: RolePermissions, domains: Sequence[str]) -> RolePermissions:
    """`perms` also through JetStream domains `domains`: each JetStream API entry
    ``$JS.API.<rest>`` also as ``$JS.<domain>.API.<rest>``, and each KV write ``$KV.<rest>``
    also as ``$JS.<domain>.API.$KV.<rest>`` (how a client at a leaf node reaches the hub's
    JetStream, and writes a bucket there: docs/sites.md). Subscriptions are unchanged.

    Raises:
        BadRequestError: a domain that is empty or has ``.``, ``*``, ``>`` or whitespace.
    """
    extra: list[Permission] = []
    for domain in domains:
        if not is_js_domain_name(domain):
            raise BadRequestError(f"{domain!r} is not a JetStream domain name")
        api = f"$JS.{domain}.API"
        for p in perms.publish_permissions:
            if p.subject.startswith(f"{_JS}."):
                extra.append(Permission(api + p.subject[len(_JS) :], f"{p.why} (domain {domain})"))
            elif p.subject.startswith("$KV."):
                extra.append(Permission(f"{api}.{p.subject}", f"{p.why} (domain {domain})"))
    return replace(perms, publish_permissions=(*perms.publish_permissions, *extra))


def permissions_for(
    role: Role,
    name: str,
    *,
    handlers: Sequence[str] | None = None,
    embedded: bool = False,
    public_key: str | None = None,
    js_domains: Sequence[str] = (),
) -> RolePermissions:
    """The permissions of identity `name` of `role` (`handlers`: a worker's
    ``EVENT/HANDLER`` pairs; `embedded`: an agent running its own dispatcher; `js_domains`:
    JetStream domains it reaches the buckets through, see `in_js_domains`).

    Raises:
        ValueError: unknown role, `handlers` given for another role than worker, or
            `embedded` for another role than agent.
        BadRequestError: a name is empty, a handler is not ``EVENT/HANDLER``, or a worker
            has none.
    """
    if handlers and role != "worker":
        raise ValueError(f"only a worker serves handlers, not a {role}")
    if embedded and role != "agent":
        raise ValueError(f"only an agent runs an embedded dispatcher, not a {role}")
    return in_js_domains(_for_role(role, name, handlers, embedded, public_key), js_domains)


def _for_role(
    role: Role,
    name: str,
    handlers: Sequence[str] | None,
    embedded: bool,
    public_key: str | None,
) -> RolePermissions:
    if role == "admin":
        return admin(name, public_key=public_key)
    if role == "agent":
        return agent(name, embedded=embedded, public_key=public_key)
    if role == "worker":
        return worker(name, handlers or (), public_key=public_key)
    if role == "dispatcher":
        return dispatcher(name, public_key=public_key)
    if role == "approver":
        return approver(name, public_key=public_key)
    if role == "auditor":
        return auditor(name, public_key=public_key)
    raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")


def permission_table() -> list[PermissionRow]:
    """Every role's entries with placeholders (``<a>``, ``<e>``, ``<h>``, ``<p>``,
    ``<PUBKEY>``, ``<slot>``), in role order, publish then subscribe then responses: the
    rows of docs/security.md. The embedded agent's rows are those beyond the agent's, as
    role ``agent (embedded)``."""
    plain = _agent("<a>", None, embedded=False)
    embedded = _agent("<a>", None, embedded=True)
    extra = tuple(g for g in embedded.publish_permissions if g not in plain.publish_permissions)
    roles: list[tuple[str, RolePermissions]] = [
        ("admin", admin()),
        ("agent", plain),
        (
            "agent (embedded)",
            replace(embedded, publish_permissions=extra, subscribe_permissions=()),
        ),
        ("worker", _worker("<name>", [("<e>", "<h>")], "<set>", None)),
        ("dispatcher", dispatcher()),
        ("approver", _approver("<p>", None)),
        ("auditor", auditor()),
    ]
    rows: list[PermissionRow] = []
    for label, perms in roles:
        for direction, entries in (
            ("publish", perms.publish_permissions),
            ("subscribe", perms.subscribe_permissions),
        ):
            seen: set[str] = set()
            for g in entries:
                if g.subject not in seen:
                    seen.add(g.subject)
                    rows.append(PermissionRow(label, direction, g.subject, g.why))
        r = perms.allow_responses
        if r is not None:
            limit = r.rule or str(r.max_msgs)
            rows.append(
                PermissionRow(
                    label,
                    "responses",
                    f"max {limit} per request, within {r.expires_s:g} s",
                    "answer a request on the requester's reply subject",
                )
            )
    return rows


def _renamed(perms: RolePermissions, name: str) -> RolePermissions:
    return replace(perms, name=name)
