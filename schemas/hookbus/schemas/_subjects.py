"""Every NATS subject, queue group, bucket and KV key hookbus uses, built in one place.

Names (events, handler names, labels) may hold any text; subject tokens and KV keys may
not (no ``.``, ``*``, ``>``, whitespace; KV keys only ``[-/_=.a-zA-Z0-9]``). `encode_token`
is the one reversible encoding for both: ``[A-Za-z0-9_-]`` stays as is and every other
byte of the UTF-8 text becomes ``=XX`` (upper-case hex), so ``tool:pre`` is ``tool=3Apre``.

Subjects (version in the subject, ``v1``):

===============================================  ======================================
``hookbus.v1.handler.<event>.<handler>``         one handler's requests (queue group per
                                                 handler)
``hookbus.v1.handler.<event>.<handler>.<i>``     the same handler on one worker instance
``hookbus.v1.chain.<event>.<set>``               chain requests: a sequence of one worker
                                                 process's handlers (queue group ``<set>``)
``hookbus.v1.chain.<event>.<set>.<i>``           the same on one worker instance
``hookbus.v1.collect.<event>``                   emit_and_collect scatter (every handler
                                                 hears it)
``hookbus.v1.emit.<agent>.<event>``              dispatcher service: emit, as ``<agent>``
``hookbus.v1.emit_and_collect.<agent>.<event>``  dispatcher service: emit_and_collect
``hookbus.v1.suspension.<agent>.<label>.<st>``   suspension events of one agent (status
                                                 pending / resolved / cancelled)
``hookbus.v1.decisions.<agent>``                 decision audit records (`DECISIONS_STREAM`)
``hookbus.v1.registry.<key>``                    every change stored in `HANDLERS_BUCKET`,
                                                 republished by the server (never by a
                                                 client: `REGISTRY_CHANGES_WILDCARD`)
===============================================  ======================================

A *handler* answers a lifecycle event (amplifier-core's hook handlers); a *suspension* is a
run paused on a label until resolved (the Vercel AI SDK's ``hook`` / ``resolve_hook``). The
subjects say which: ``handler`` for the first, ``suspension`` for the second (see
docs/names.md).

``<agent>`` is the agent's identity (`agent_token`: its encoded agent id, or `NO_AGENT`).
It sits in every subject and key that belongs to one agent so that a NATS permission can
say "this user may act as this agent only" (see docs/security.md): the dispatcher service
takes the agent id from the subject, suspension keys are ``<agent>.<label>``, an approval
answer proof is ``<agent>.<label>.<approver>``, and grants are ``<agent>.<session>...``.
"""

from __future__ import annotations

import functools
import re
from typing import Final

from ._errors import BadRequestError

__all__ = [
    "APPROVALS_BUCKET",
    "CHAIN_WILDCARD",
    "COLLECT_SERVICE_WILDCARD",
    "DECISIONS_STREAM",
    "DECISIONS_WILDCARD",
    "DISPATCHER_QUEUE_GROUP",
    "DISPATCHER_SERVICE_NAME",
    "EMIT_SERVICE_WILDCARD",
    "GRANT_NONE",
    "HANDLERS_BUCKET",
    "HANDLER_SUBJECT_PREFIX",
    "LEASES_BUCKET",
    "NO_AGENT",
    "REGISTRY_CHANGES_WILDCARD",
    "REQUIRED_KEY_PREFIX",
    "SUBJECT_PREFIX",
    "SUSPENSIONS_BUCKET",
    "SUSPENSION_EVENTS_WILDCARD",
    "SUSPENSION_SUBJECT_PREFIX",
    "WORKER_SERVICE_NAME",
    "agent_from_service_subject",
    "agent_token",
    "approval_answer_key",
    "chain_instance_subject",
    "chain_queue_group",
    "chain_subject",
    "collect_service_subject",
    "collect_subject",
    "decisions_subject",
    "decode_token",
    "emit_service_subject",
    "encode_token",
    "event_from_service_subject",
    "format_served_handlers",
    "grant_key",
    "handler_instance_subject",
    "handler_key",
    "handler_queue_group",
    "handler_subject",
    "is_answer_key",
    "is_js_domain_name",
    "label_from_key",
    "lease_key",
    "parse_grant_key",
    "parse_handler_key",
    "parse_registry_key",
    "parse_served_handlers",
    "parse_suspension_key",
    "registry_key_kind",
    "required_key",
    "run_claim_key",
    "suspension_event_subject",
    "suspension_events_subject",
    "suspension_key",
    "validate_name",
]

SUBJECT_PREFIX: Final = "hookbus.v1"
HANDLERS_BUCKET: Final = "hookbus_handlers"
"""JetStream KV bucket holding one `HandlerDeclaration` per (event, handler)."""
DISPATCHER_QUEUE_GROUP: Final = "hookbus-dispatcher"
"""Queue group of the dispatcher service replicas."""
EMIT_SERVICE_WILDCARD: Final = f"{SUBJECT_PREFIX}.emit.*.*"
COLLECT_SERVICE_WILDCARD: Final = f"{SUBJECT_PREFIX}.emit_and_collect.*.*"
SUSPENSIONS_BUCKET: Final = "hookbus_suspensions"
"""JetStream KV bucket holding one `SuspensionRecord` per label."""
APPROVALS_BUCKET: Final = "hookbus_approvals"
"""JetStream KV bucket of "Allow always" grants (per agent, session, event, handler and tool)."""
LEASES_BUCKET: Final = "hookbus_leases"
"""KV bucket of waiter leases (`lease_key`: one key per process with waiters) and run claims
(`run_claim_key`: one key per run in progress), each kept alive by its process's heartbeat
and expired by the bucket's max age (the lease)."""
HANDLER_SUBJECT_PREFIX: Final = f"{SUBJECT_PREFIX}.handler"
"""First tokens of every handler request subject (`handler_subject`)."""
SUSPENSION_SUBJECT_PREFIX: Final = f"{SUBJECT_PREFIX}.suspension"
SUSPENSION_EVENTS_WILDCARD: Final = f"{SUSPENSION_SUBJECT_PREFIX}.>"
"""Every suspension event (pending / resolved / cancelled of every agent's labels)."""
MAX_NAME_LENGTH: Final = 200
"""Longest event or handler name accepted, in characters."""
WORKER_SERVICE_NAME: Final = "hookbus-worker"
"""Name of the NATS services API (``nats.micro``) service every worker process runs:
``$SRV.PING.hookbus-worker`` / ``$SRV.INFO.hookbus-worker`` reach every live worker."""
DISPATCHER_SERVICE_NAME: Final = "hookbus-dispatcher"
"""Name of the NATS services API (``nats.micro``) service every dispatcher service process
runs: ``$SRV.INFO.hookbus-dispatcher`` lists its endpoints, ``$SRV.STATS.hookbus-dispatcher``
their request counts."""
REGISTRY_CHANGES_WILDCARD: Final = f"{SUBJECT_PREFIX}.registry.>"
"""Where the server republishes every message stored in `HANDLERS_BUCKET` (the bucket
stream's ``republish``, ``$KV.<bucket>.>`` to this), with its stream sequence
(``Nats-Sequence``): dispatchers follow the registry with one core subscription here
instead of a JetStream consumer each. Only the server publishes here: no role but the
admin may (docs/security.md)."""
REQUIRED_KEY_PREFIX: Final = "_required"
"""First segment of a required-handler key in `HANDLERS_BUCKET` (see `required_key`)."""

_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]+")
_NOT_PLAIN = re.compile(r"[^A-Za-z0-9_-]+")
_TOKEN = re.compile(r"(?:[A-Za-z0-9_-]|=[0-9A-F]{2})+")
_ESCAPED = re.compile(r"(?:=[0-9A-F]{2})+")
_TOKENS_KEPT = 4096
"""Names and tokens `encode_token` and `decode_token` keep the answer of (each, least
recently used dropped first): every request to the dispatcher service names an event and
an agent as tokens. A kept answer is one dictionary lookup (about 40 ns against about 1 µs
for a name with an escape, ``python -m timeit``); one not kept costs about 0.1 µs more
than without the cache (a service replica serving more agents than this at once still
keeps its events'). At most this many entries of at most a subject's length each. A
failure is never kept."""


def is_js_domain_name(text: str) -> bool:
    """Whether `text` can name a JetStream domain (one subject token: not empty, no ``.``,
    ``*``, ``>`` or whitespace)."""
    return bool(text) and not any(c in text for c in ". *>\t\r\n")


@functools.lru_cache(maxsize=_TOKENS_KEPT)
def encode_token(name: str) -> str:
    """Encode any non-empty text as one subject token / KV key segment (reversible).

    Raises:
        BadRequestError: `name` is empty.
    """
    if not name:
        raise BadRequestError("a name may not be empty")
    if _PLAIN_NAME.fullmatch(name):  # most names: one regex, not one per character
        return name
    return _NOT_PLAIN.sub(_escape, name)


def _escape(run: re.Match[str]) -> str:
    return "=" + run.group().encode().hex("=").upper()


def _unescape(run: re.Match[str]) -> str:
    # a run of escapes is whole UTF-8 characters: a plain character is ASCII, and no byte
    # of a multi-byte UTF-8 character is (raises UnicodeDecodeError for bytes that are not)
    return bytes.fromhex(run.group().replace("=", "")).decode()


@functools.lru_cache(maxsize=_TOKENS_KEPT)
def decode_token(token: str) -> str:
    """Invert `encode_token`.

    Raises:
        BadRequestError: `token` is not the output of `encode_token`.
    """
    if not _TOKEN.fullmatch(token):
        raise BadRequestError(f"not a hookbus token: {token!r}")
    try:  # one regex over the escaped runs, not a loop over characters
        name = _ESCAPED.sub(_unescape, token) if "=" in token else token
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"not a hookbus token: {token!r}") from exc
    if encode_token(name) != token:  # one encoding per name: reject non-canonical forms
        raise BadRequestError(f"not a canonical hookbus token: {token!r}")
    return name


def validate_name(kind: str, name: object) -> str:
    """Check an event or handler name: a non-empty string of at most `MAX_NAME_LENGTH`.

    Raises:
        BadRequestError: with `kind` ("event", "handler") in the message.
    """
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise BadRequestError(
            f"{kind} name must be a non-empty string of at most {MAX_NAME_LENGTH} characters,"
            f" got {name!r}"
        )
    return name


def handler_subject(event: str, handler: str) -> str:
    """Request subject of one handler: ``hookbus.v1.handler.<event>.<handler>``.

    Raises:
        BadRequestError: as `handler_key` (names too long for a subject).
    """
    return f"{HANDLER_SUBJECT_PREFIX}.{handler_key(event, handler)}"


MAX_INSTANCE_LENGTH: Final = 64
"""Longest worker instance id accepted in a subject, in characters."""


def handler_instance_subject(event: str, handler: str, instance: str) -> str:
    """Subject of one handler on one worker instance (no queue group):
    ``hookbus.v1.handler.<event>.<handler>.<instance>``. Dispatchers send hedges there, to a
    replica that answered recently, instead of letting the queue group pick one.

    Raises:
        BadRequestError: as `handler_key`, or `instance` is empty or longer than
            `MAX_INSTANCE_LENGTH` characters.
    """
    if not instance or len(instance) > MAX_INSTANCE_LENGTH:
        raise BadRequestError(f"not a worker instance id: {instance!r:.80}")
    return f"{handler_subject(event, handler)}.{encode_token(instance)}"


def handler_queue_group(handler: str) -> str:
    """Queue group shared by the replicas of one handler (one group per handler)."""
    return encode_token(handler)


CHAIN_WILDCARD: Final = f"{SUBJECT_PREFIX}.chain.*.*"
"""Every chain subject (what a dispatcher may publish to)."""


def chain_subject(event: str, set_id: str) -> str:
    """Chain requests for `event` to the worker processes serving handler set `set_id`
    (`handler_set_id`): ``hookbus.v1.chain.<event>.<set_id>``.

    Raises:
        BadRequestError: `event` is empty.
    """
    return f"{SUBJECT_PREFIX}.chain.{encode_token(event)}.{set_id}"


def chain_instance_subject(chain: str, instance: str) -> str:
    """The chain subject `chain` on one worker instance only (no queue group):
    ``<chain>.<instance>``, where a dispatcher sends a hedge of an all-``retry_safe`` chain.

    Raises:
        BadRequestError: `instance` is empty or longer than `MAX_INSTANCE_LENGTH`.
    """
    if not instance or len(instance) > MAX_INSTANCE_LENGTH:
        raise BadRequestError(f"not a worker instance id: {instance!r:.80}")
    return f"{chain}.{encode_token(instance)}"


def chain_queue_group(set_id: str) -> str:
    """Queue group of the replicas serving handler set `set_id` (the id itself)."""
    return set_id


def collect_subject(event: str) -> str:
    """Scatter subject of `emit_and_collect`: every handler of `event` subscribes to it."""
    return f"{SUBJECT_PREFIX}.collect.{encode_token(event)}"


NO_AGENT: Final = "="
"""The agent token of a call without an agent id (no id encodes to it)."""


def agent_token(agent_id: str | None) -> str:
    """The subject token / key segment of an agent: `encode_token` of its id, or
    `NO_AGENT` for None or an empty id.

    Raises:
        BadRequestError: the id is not a string or longer than `MAX_NAME_LENGTH`.
    """
    if agent_id is None or agent_id == "":
        return NO_AGENT
    return encode_token(validate_name("agent", agent_id))


def agent_from_token(token: str) -> str | None:
    """Invert `agent_token` (`NO_AGENT` is None). Raises `BadRequestError` for a foreign token."""
    return None if token == NO_AGENT else decode_token(token)


def emit_service_subject(event: str, agent_id: str | None = None) -> str:
    """Dispatcher service subject for `emit` as agent `agent_id`:
    ``hookbus.v1.emit.<agent>.<event>``. Only that agent's NATS user may publish on it.
    """
    return f"{SUBJECT_PREFIX}.emit.{agent_token(agent_id)}.{encode_token(event)}"


def collect_service_subject(event: str, agent_id: str | None = None) -> str:
    """Dispatcher service subject for `emit_and_collect`:
    ``hookbus.v1.emit_and_collect.<agent>.<event>``."""
    return f"{SUBJECT_PREFIX}.emit_and_collect.{agent_token(agent_id)}.{encode_token(event)}"


def event_from_service_subject(subject: str) -> str:
    """The event name in a dispatcher service subject (the last token, decoded).

    Raises:
        BadRequestError: the last token is not a valid encoded name.
    """
    return decode_token(subject.rpartition(".")[2])


def agent_from_service_subject(subject: str) -> str | None:
    """The agent id in a dispatcher service subject (the token before the event; None
    for `NO_AGENT`).

    Raises:
        BadRequestError: the subject has no agent token, or it is not a valid encoded name.
    """
    parts = subject.split(".")
    if len(parts) < 2:
        raise BadRequestError(f"not a dispatcher service subject: {subject[:120]!r}")
    return agent_from_token(parts[-2])


MAX_KEY_LENGTH: Final = 1024
"""Longest encoded suspension key, in characters (a NATS control line must hold it)."""


def suspension_key(label: str, agent_id: str | None = None) -> str:
    """Key of a label's `SuspensionRecord` in `SUSPENSIONS_BUCKET`: ``<agent>.<label>``
    (any text works as a label; `agent_id` None is `NO_AGENT`).

    Raises:
        BadRequestError: the label is empty or its encoding exceeds `MAX_KEY_LENGTH`.
    """
    token = encode_token(label)
    if len(token) > MAX_KEY_LENGTH:
        raise BadRequestError(
            f"label too long: {len(token)} characters encoded, at most {MAX_KEY_LENGTH}"
        )
    return f"{agent_token(agent_id)}.{token}"


def parse_suspension_key(key: str) -> tuple[str | None, str]:
    """Invert `suspension_key`: ``(agent_id, label)``.

    Raises:
        BadRequestError: `key` is not a record key (an answer proof key has three
            segments and is refused too).
    """
    agent, sep, label = key.partition(".")
    if not sep or "." in label:
        raise BadRequestError(f"not a suspension key: {key[:120]!r}")
    return agent_from_token(agent), decode_token(label)


def label_from_key(key: str) -> str:
    """The label of a `suspension_key`. Raises `BadRequestError` for a foreign key."""
    return parse_suspension_key(key)[1]


def approval_answer_key(label: str, agent_id: str | None, approver: str) -> str:
    """Key of an approver's answer proof: ``<agent>.<label>.<approver>``, beside the record
    it answers (an approval's in `APPROVALS_BUCKET`, a tool approval's in
    `SUSPENSIONS_BUCKET`). Only that approver's NATS user may write it, so it proves who
    answered `label` of agent `agent_id`.

    Raises:
        BadRequestError: a name is empty or too long.
    """
    return f"{suspension_key(label, agent_id)}.{encode_token(validate_name('approver', approver))}"


def is_answer_key(key: str) -> bool:
    """Whether a key of `SUSPENSIONS_BUCKET` or `APPROVALS_BUCKET` is an answer proof (three
    segments), not a record (two) or a grant (five)."""
    return key.count(".") == 2


def lease_key(waiter_id: str) -> str:
    """Key of one process's waiter lease in `LEASES_BUCKET` (the id is a hex token).

    Raises:
        BadRequestError: the id is not a non-empty hex token of at most 64 characters.
    """
    if not waiter_id or len(waiter_id) > 64 or any(c not in "0123456789abcdef" for c in waiter_id):
        raise BadRequestError(f"not a waiter id: {waiter_id!r}")
    return f"w.{waiter_id}"


def run_claim_key(agent_id: str | None, run_id: str) -> str:
    """Key of a run claim in `LEASES_BUCKET`: ``r.<agent>.<run>`` (`agent_token` of
    `agent_id`, `encode_token` of `run_id`). Its value is the waiter id of the process
    running that run; it lives while that process's heartbeat rewrites it.

    Raises:
        BadRequestError: `run_id` is not a non-empty string or its encoding exceeds
            `MAX_KEY_LENGTH` characters; `agent_id` is not a usable agent id.
    """
    if not isinstance(run_id, str) or not run_id:
        raise BadRequestError(f"a run id must be a non-empty string, got {run_id!r}")
    token = encode_token(run_id)
    if len(token) > MAX_KEY_LENGTH:
        raise BadRequestError(
            f"run id too long: {len(token)} characters encoded, at most {MAX_KEY_LENGTH}"
        )
    return f"r.{agent_token(agent_id)}.{token}"


def suspension_event_subject(label: str, status: str, agent_id: str | None = None) -> str:
    """Subject of a suspension event (a `HookEvent`, the Vercel AI SDK's name):
    ``hookbus.v1.suspension.<agent>.<label>.<status>``, `status` one of pending / resolved /
    cancelled (``*`` gives a wildcard over them).

    Raises:
        BadRequestError: the label is empty, or the agent id is not a string or too long.
    """
    return f"{SUSPENSION_SUBJECT_PREFIX}.{agent_token(agent_id)}.{encode_token(label)}.{status}"


def suspension_events_subject(agent_id: str | None = None, *, every_agent: bool = False) -> str:
    """Wildcard of the suspension events of one agent
    (``hookbus.v1.suspension.<agent>.>``), or of every agent
    (`SUSPENSION_EVENTS_WILDCARD`) with `every_agent`.

    Raises:
        BadRequestError: the agent id is not a string or too long.
    """
    if every_agent:
        return SUSPENSION_EVENTS_WILDCARD
    return f"{SUSPENSION_SUBJECT_PREFIX}.{agent_token(agent_id)}.>"


GRANT_NONE: Final = "="
"""The key segment of an absent agent id or tool name in a grant key (never a token)."""


def grant_key(
    agent_id: str | None, session_id: str, event: str, handler: str, tool: str | None
) -> str:
    """Key of an "Allow always" grant in `APPROVALS_BUCKET`:
    ``<agent>.<session>.<event>.<handler>.<tool>``, each part `encode_token`-ed; an absent
    agent id or tool is `GRANT_NONE` (which no name encodes to). A grant needs a session.

    Raises:
        BadRequestError: `session_id`, `event` or `handler` is empty, or the key would exceed
            `MAX_KEY_LENGTH` characters.
    """
    if not session_id:
        raise BadRequestError("a grant needs a session id")
    parts = (
        encode_token(agent_id) if agent_id else GRANT_NONE,
        encode_token(session_id),
        encode_token(event),
        encode_token(handler),
        encode_token(tool) if tool else GRANT_NONE,
    )
    key = ".".join(parts)
    if len(key) > MAX_KEY_LENGTH:
        raise BadRequestError(
            f"grant key too long: {len(key)} characters, at most {MAX_KEY_LENGTH}"
        )
    return key


def parse_grant_key(key: str) -> tuple[str | None, str, str, str, str | None]:
    """Invert `grant_key`: ``(agent_id, session_id, event, handler, tool)``.

    Raises:
        BadRequestError: `key` is not a grant key.
    """
    parts = key.split(".")
    if len(parts) != 5 or GRANT_NONE in (parts[1], parts[2], parts[3]):
        raise BadRequestError(f"not a grant key: {key!r}")
    agent, session, event, handler, tool = parts
    return (
        None if agent == GRANT_NONE else decode_token(agent),
        decode_token(session),
        decode_token(event),
        decode_token(handler),
        None if tool == GRANT_NONE else decode_token(tool),
    )


def handler_key(event: str, handler: str) -> str:
    """Key of a `HandlerDeclaration` in `HANDLERS_BUCKET`: ``<event>.<handler>``.

    Raises:
        BadRequestError: a name is empty, or the key would exceed `MAX_KEY_LENGTH`
            characters (the handler's subject, one token longer, must fit a NATS control line).
    """
    key = f"{encode_token(event)}.{encode_token(handler)}"
    if len(key) > MAX_KEY_LENGTH:
        raise BadRequestError(
            f"event and handler names too long: {len(key)} characters encoded,"
            f" at most {MAX_KEY_LENGTH}"
        )
    return key


def required_key(event: str, handler: str) -> str:
    """Key of a `RequiredHandler` in `HANDLERS_BUCKET`:
    ``_required.<event>.<handler>`` (three segments; a declaration key has two).

    Raises:
        BadRequestError: as `handler_key`.
    """
    return f"{REQUIRED_KEY_PREFIX}.{handler_key(event, handler)}"


def registry_key_kind(key: str) -> str:
    """What a key of `HANDLERS_BUCKET` would hold, by its shape alone: ``"required"``
    (``required.<event>.<handler>``) or ``"handler"``. The key itself is not checked:
    `parse_registry_key` checks it."""
    return (
        "required"
        if key.startswith(REQUIRED_KEY_PREFIX + ".") and key.count(".") == 2
        else "handler"
    )


def parse_registry_key(key: str) -> tuple[str, str, str]:
    """Any key of `HANDLERS_BUCKET`: ``("handler" | "required", event, handler)``.

    Raises:
        BadRequestError: `key` is neither a handler key nor a required-handler key, or is
            longer than a key `handler_key` makes.
    """
    if len(key) > MAX_KEY_LENGTH + len(REQUIRED_KEY_PREFIX) + 1:
        raise BadRequestError(f"registry key too long: {len(key)} characters")
    kind = registry_key_kind(key)
    if kind == "required":
        key = key[len(REQUIRED_KEY_PREFIX) + 1 :]
    if key.count(".") != 1:
        raise BadRequestError(f"not a registry key: {key!r}")
    event, handler = parse_handler_key(key)
    return kind, event, handler


def parse_handler_key(key: str) -> tuple[str, str]:
    """Invert `handler_key`: ``(event, handler)``.

    Raises:
        BadRequestError: `key` is not a handler key.
    """
    event, sep, handler = key.partition(".")
    if not sep:
        raise BadRequestError(f"not a handler key: {key!r}")
    return decode_token(event), decode_token(handler)


DECISIONS_STREAM: Final = "hookbus_decisions"
"""JetStream stream of the decision audit trail: one `DecisionRecord` per decided emit."""
DECISIONS_WILDCARD: Final = f"{SUBJECT_PREFIX}.decisions.*"
"""The subjects of `DECISIONS_STREAM`: every agent's decision records."""


def decisions_subject(agent_id: str | None) -> str:
    """Subject of an agent's decision records: ``hookbus.v1.decisions.<agent>`` (`agent_token`:
    `NO_AGENT` for a call without an agent id). Only that agent and the dispatcher may
    publish on it; admins and auditors read it through `DECISIONS_STREAM`.

    Raises:
        BadRequestError: as `agent_token` (an id that is not a string or is too long).
    """
    return f"{SUBJECT_PREFIX}.decisions.{agent_token(agent_id)}"


def format_served_handlers(pairs: list[tuple[str, str]]) -> str:
    """The worker service's ``handlers`` metadata value: the handler keys it serves,
    space-separated (keys never hold a space)."""
    return " ".join(handler_key(event, name) for event, name in pairs)


def parse_served_handlers(text: object) -> list[tuple[str, str]]:
    """Invert `format_served_handlers`; keys that do not parse are skipped."""
    out: list[tuple[str, str]] = []
    if not isinstance(text, str):
        return out
    for key in text.split()[:10_000]:
        try:
            kind, event, name = parse_registry_key(key)
        except BadRequestError:
            continue
        if kind == "handler":
            out.append((event, name))
    return out
