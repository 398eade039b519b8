"""Four nats-py (2.16) client shortcomings, repaired on each connection hookbus is given.

**A hostile message must not silence a connection for good.** nats-py decodes a message's
subject, reply subject and status-line description with strict UTF-8 inside its read loop;
a `UnicodeDecodeError` there ends the loop, logged once, and the connection stays
"connected" while reading nothing more: every later request of that process times out (a
fail-closed handler then denies everything). Any client can send such bytes, as a reply to
a dispatcher's request or as a request to a worker.

**A flush must follow what was sent before it.** nats-py queues ``SUB``/``PUB`` for its
flusher task but writes a flush's ``PING`` straight to the socket, so the ``PING`` can
reach the server first, and the ``PONG`` that ends `flush()` then says nothing about the
subscriptions made just before: a request from another connection in that moment is
answered "no responders", and a message published to the new subscription is lost
(``docs/decisions-under-faults.md``).

**A refusal must be said at once.** A server securing each identity (``hookbus auth
init``) answers a publish or a subscription the identity may not make with an
asynchronous ``-ERR 'Permissions Violation for Publish to "<subject>"'``; nats-py hands it
to the error callback only, so a refused request (JetStream and KV calls are requests) is
never answered and ends in a timeout, and a refused subscription just never receives.

**Closing must work during an outage, on every Python** (`_closable_offline`).

`harden_connection` repairs all four on one client: it wraps the message entry point so
such bytes are replaced (by "?"; nats-py already replaces bad bytes in header values)
instead, makes a ``PING`` (of `flush`, `rtt` and the keep-alive) write the queued commands
out before itself, drops what is queued when closing a lost connection, and watches the
permission violations: a pending request whose subject (or reply subject) was refused
raises `NotPermittedError` at once, and so does the next `flush` after a refused
subscription (subscribe, then flush, learns it); the user's error callback is still called.
The wrapped entry point also hands the messages of direct subscriptions
(`hookbus._core.direct_delivery`) over in the read loop. No I/O here: it only wraps methods
of the object it is given.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable
from typing import Any

from hookbus.schemas import NotPermittedError

from .direct_delivery import deliver_now, direct_table

__all__ = [
    "bucket_refusal",
    "connection_identity",
    "harden_connection",
    "order_flushes",
    "refusal_raised",
    "reply_now",
    "report_refusals",
    "send_now",
]

log = logging.getLogger("hookbus")

_MARK = "_hookbus_hardened"


def _safe(raw: Any) -> Any:
    if not raw:
        return raw
    return bytes(raw).decode("utf-8", "replace").encode("ascii", "replace")


def harden_connection(nc: Any, *, identity: str | None = None) -> None:
    """Make `nc` (a nats-py client) survive invalid UTF-8 in subjects and status lines,
    make its flushes ordered after the commands sent before them, and make a refused
    request or subscription raise `NotPermittedError` at once (idempotent; a client without
    the expected private entry points is left as it is).

    Args:
        identity: who the connection acts as, for the refusal's message (e.g. ``"worker
            sec"``); given again, it replaces the one set before (default: ``unknown``).
    """
    order_flushes(nc)
    _safe_decoding(nc)
    _closable_offline(nc)
    report_refusals(nc, identity=identity)


def _closable_offline(nc: Any) -> None:
    """Make `nc.close()` work while the connection is lost (reconnecting).

    nats-py's close writes the commands still queued to the transport it had, closed by
    then: Python 3.11 drops them, Python 3.13 raises ``TypeError: 'NoneType' object is not
    callable`` from the closed transport's ``writelines`` (its write callback is cleared
    on close), so closing during an outage fails there. Not connected, they can reach no
    server: they are dropped first, as 3.11 does, on every Python.
    """
    original = getattr(nc, "close", None)
    if original is None or getattr(original, _MARK, False) or not hasattr(nc, "_pending"):
        return

    async def close() -> None:
        if nc._pending and not nc.is_connected:
            nc._pending = []
            nc._pending_data_size = 0
        await original()

    setattr(close, _MARK, True)
    nc.close = close


def order_flushes(nc: Any) -> None:
    """Make `nc` (a nats-py client) write the commands queued for its flusher task before
    each ``PING``, so a flush returns only once the server has everything sent before it
    (idempotent; a client without the expected private entry points is left as it is).

    The flusher takes and clears the whole queue in one step, so writing the rest here keeps
    the byte order the commands were queued in; nats-py does the same when its flusher is
    gone. Not connected (reconnecting): left to nats-py, which writes the queue out once
    reconnected.
    """
    original = getattr(nc, "_send_ping", None)
    if original is None or getattr(original, _MARK, False) or not hasattr(nc, "_pending"):
        return

    async def send_ping(future: Any = None) -> None:
        transport = nc._transport
        if nc._pending and transport is not None and nc.is_connected:
            transport.writelines(nc._pending[:])
            nc._pending = []
            nc._pending_data_size = 0
        await original(future)

    setattr(send_ping, _MARK, True)
    nc._send_ping = send_ping


def send_now(nc: Any) -> None:
    """Write what `nc` (a nats-py client) has queued for its flusher task to the socket now,
    in order, instead of when the flusher task next runs.

    A reply published by a handler that returned waits in the queue while the event loop
    runs the next ready task; if that task computes without awaiting (another handler of
    the same process), the reply leaves only when it is done, and the caller may time out
    a handler that answered at once. Not connected: left to nats-py (it writes the queue
    out once reconnected). Never raises.
    """
    transport = getattr(nc, "_transport", None)
    if getattr(nc, "_pending", None) and transport is not None and nc.is_connected:
        try:
            transport.writelines(nc._pending[:])
        except Exception:  # a transport closing under us: the flusher's or close's business
            return
        nc._pending = []
        nc._pending_data_size = 0


def reply_now(nc: Any, subject: str, payload: bytes) -> bool:
    """Write a message of `payload` (bytes, no headers) on `subject` to `nc`'s socket now,
    as ``await nc.publish(subject, payload)`` then `send_now` would, without nats-py's
    queue: no flusher task woken, no future made, no list copied per reply.

    Returns True once written; False, having done nothing, when it cannot be written so:
    not connected (or no transport), commands queued before it (they go first: the caller
    publishes and calls `send_now`, which keeps the order), closing or draining, a subject
    nats-py refuses (the caller's ``publish`` raises its error), a payload over the
    server's ``max_payload``, or a client without the expected private entry points.
    """
    transport = getattr(nc, "_transport", None)
    if (
        transport is None
        or getattr(nc, "_pending", True)
        or not nc.is_connected
        or nc.is_draining_pubs
        or len(payload) > nc.max_payload
        or _bad_subject(subject)
    ):
        return False
    try:
        transport.write(b"PUB %b %d\r\n%b\r\n" % (subject.encode(), len(payload), payload))
    except Exception:  # a transport closing under us: let nats-py's publish say what it is
        return False
    stats = nc.stats
    stats["out_msgs"] += 1
    stats["out_bytes"] += len(payload)
    return True


def _bad_subject(subject: str) -> bool:
    """Whether nats-py's publish would refuse `subject` (empty, whitespace, CR or LF)."""
    return not subject or _SUBJECT_INVALID.search(subject) is not None


_SUBJECT_INVALID = re.compile(r"[ \t\r\n]")
"""What nats-py's publish refuses in a subject (its ``_SUBJECT_INVALID_RE``)."""


def _safe_decoding(nc: Any) -> None:
    original = getattr(nc, "_process_msg", None)
    if original is None or getattr(original, _MARK, False):
        return

    seen = 0
    direct = direct_table(nc)

    def process_msg(sid: int, subject: Any, reply: Any, data: Any, headers: Any) -> Any:
        # ASCII lines cannot fail to decode: nats-py's own coroutine (or a direct
        # subscription's delivery) handed back as it is, no coroutine of ours around it
        # (the common case, every message a client receives goes through here)
        if (
            subject.isascii()
            and (not reply or reply.isascii())
            and (not headers or headers.isascii())
        ):
            return entry(sid, subject, reply, data, headers)
        return guarded(sid, subject, reply, data, headers)

    def entry(sid: int, subject: Any, reply: Any, data: Any, headers: Any) -> Any:
        deliver = direct.get(sid) if direct else None
        if deliver is not None:
            return deliver_now(nc, deliver, sid, subject, reply, data, headers)
        return original(sid, subject, reply, data, headers)

    async def guarded(sid: int, subject: Any, reply: Any, data: Any, headers: Any) -> Any:
        nonlocal seen
        try:
            return await entry(sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            seen += 1
            if seen <= 5 or seen % 1000 == 0:  # a flood must not flood the log
                log.warning("%d message(s) with invalid UTF-8 in a subject or status line", seen)
        try:
            return await entry(sid, _safe(subject), _safe(reply), data, _safe(headers))
        except UnicodeDecodeError:  # pragma: no cover - nothing left to decode strictly
            log.warning("a message that nats-py cannot parse was dropped")
            return None

    setattr(process_msg, _MARK, True)
    nc._process_msg = process_msg


# -- refusals ---------------------------------------------------------------------------
# nats-py hands the server's error line lowercased (subject included); the subjects are
# matched case-insensitively and named as this client wrote them.
_VIOLATION = re.compile(
    r"^\s*'?(permissions violation) for (publish to|publish with reply of|subscription to)"
    r' "?([^"\s]*)"?(?: using queue "?([^"\s]*)"?)?',
    re.IGNORECASE,
)
_LABEL = "_hookbus_role"
_RAISED = "_hookbus_refusal_raised"
_KEPT = 16
"""Refused subscriptions kept for the next flush to raise (the first one is raised)."""


def refusal_raised(nc: Any) -> bool:
    """Whether the permissions violation `nc`'s error callback is being called with was
    raised as `NotPermittedError` to whoever waited on it (a callback may then say
    nothing more: the refusal is already told)."""
    return bool(getattr(nc, _RAISED, False))


def connection_identity(nc: Any) -> str:
    """Who `nc` connects as, for messages: the nkey public key (nats-py's, else the one in
    an ``_INBOX_<public key>`` inbox prefix), else the user name, else ``this connection``
    (never a secret)."""
    public = getattr(nc, "_public_nkey", None)
    if isinstance(public, str) and public:
        return public
    prefix = bytes(getattr(nc, "_inbox_prefix", b"") or b"").decode("ascii", "replace")
    if prefix.startswith("_INBOX_U") and len(prefix) > len("_INBOX_U"):
        return prefix[len("_INBOX_") :].split(".", 1)[0]
    options = getattr(nc, "options", None) or {}
    user = options.get("user") if isinstance(options, dict) else None
    if user:
        return f"user {user}"
    return "this connection"


def _refusal(nc: Any, operation: str, subject: str, why: str) -> NotPermittedError:
    identity = connection_identity(nc)
    role = getattr(nc, _LABEL, None) or "unknown"
    return NotPermittedError(
        f"NATS refused {operation} to {subject} to {identity} ({role}): {why}",
        operation=operation,
        subject=subject,
        identity=identity,
        role=role,
    )


def bucket_refusal(bucket: str, refusal: NotPermittedError) -> NotPermittedError:
    """The one-line error for opening a bucket that `refusal` stopped: absent and not the
    identity's to create (a refused stream create: the admin provisions it), else
    `refusal` itself (e.g. the bucket is not the identity's to read)."""
    who = refusal.identity + (f" ({refusal.role})" if refusal.role != "unknown" else "")
    if ".STREAM.CREATE." in refusal.subject.upper():
        text = (
            f"bucket {bucket} does not exist and {who} may not create it: provision it as"
            " the admin (`hookbus auth provision`)"
        )
    else:
        return refusal
    return NotPermittedError(
        text,
        operation=refusal.operation,
        subject=refusal.subject,
        identity=refusal.identity,
        role=refusal.role,
    )


def report_refusals(nc: Any, *, identity: str | None = None) -> None:
    """Make `nc` (a nats-py client) raise `NotPermittedError` at once where the server
    refused: in a pending `request` whose subject or reply subject the identity may not
    publish to, in every pending request when the client's reply subscription is refused,
    and in the first `flush` that ends after a refused subscription (idempotent; `identity`
    labels the connection for the message, see `harden_connection`)."""
    if identity:
        setattr(nc, _LABEL, identity)
    original_err = getattr(nc, "_process_err", None)
    original_publish = getattr(nc, "publish", None)
    original_flush = getattr(nc, "flush", None)
    if original_err is None or original_publish is None or original_flush is None:
        return
    if getattr(original_err, _MARK, False) or not hasattr(nc, "_resp_map"):
        return

    requests: dict[str, dict[str, str]] = {}  # lowercased subject -> {token: subject}
    replies: dict[str, str] = {}  # lowercased reply subject -> token
    refused_subs: list[NotPermittedError] = []

    def forget(subject_key: str, reply_key: str, token: str) -> None:
        tokens = requests.get(subject_key)
        if tokens is not None:
            tokens.pop(token, None)
            if not tokens:
                del requests[subject_key]
        replies.pop(reply_key, None)

    def publish(
        subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> Awaitable[None]:
        # nats-py's own coroutine, no frame of ours around it: the bookkeeping is done
        # before the publish is awaited either way
        prefix = nc._resp_sub_prefix
        if reply and prefix and reply.startswith(prefix.decode()):
            token = reply[len(prefix) :]
            future = nc._resp_map.get(token)
            if future is not None and not future.done():
                subject_key, reply_key = subject.lower(), reply.lower()
                requests.setdefault(subject_key, {})[token] = subject
                replies[reply_key] = token
                future.add_done_callback(lambda _f: forget(subject_key, reply_key, token))
        return original_publish(subject, payload, reply=reply, headers=headers)  # type: ignore[no-any-return]

    def fail(token: str, error: NotPermittedError) -> bool:
        future = nc._resp_map.get(token)
        if future is not None and not future.done():
            future.set_exception(error)
            return True
        return False

    def refuse(err_msg: str) -> bool:
        """Fail what the refusal `err_msg` refused; whether anything waited on it."""
        match = _VIOLATION.match(err_msg)
        if match is None:
            return False
        why, kind, subject_key = match.group(1), match.group(2).lower(), match.group(3).lower()
        if kind == "publish to":
            failed = [
                fail(token, _refusal(nc, "publish", subject, why))
                for token, subject in list(requests.get(subject_key, {}).items())
            ]
            return any(failed)
        if kind == "publish with reply of":
            token = replies.get(subject_key)
            if token is None:
                return False
            subject = next((s for t in requests.values() for k, s in t.items() if k == token), "")
            return fail(token, _refusal(nc, "publish with reply", subject or subject_key, why))
        subs = [
            sub
            for sub in list(getattr(nc, "_subs", {}).values())
            if str(getattr(sub, "_subject", "")).lower() == subject_key
        ]
        subject = str(subs[0]._subject) if subs else subject_key
        error = _refusal(nc, "subscription", subject, why)
        prefix = nc._resp_sub_prefix
        if prefix and subject_key == (prefix.decode() + "*").lower():
            for token in list(nc._resp_map):  # no reply can come: every request fails
                fail(token, error)
        if len(refused_subs) < _KEPT:  # told by the next flush; a flood is not kept
            refused_subs.append(error)
        return bool(subs)

    async def process_err(err_msg: str) -> Any:
        try:
            raised = refuse(err_msg)
        except Exception:  # pragma: no cover - never keep the error callback from running
            log.exception("could not match a NATS permissions violation")
            raised = False
        setattr(nc, _RAISED, raised)
        try:
            return await original_err(err_msg)
        finally:
            setattr(nc, _RAISED, False)

    async def flush(*args: Any, **kwargs: Any) -> None:
        await original_flush(*args, **kwargs)
        if refused_subs:
            first = refused_subs[0]
            refused_subs.clear()
            raise first

    for wrapper in (process_err, publish, flush):
        setattr(wrapper, _MARK, True)
    nc._process_err = process_err
    nc.publish = publish
    nc.flush = flush
