"""What the approvals console shows, as JSON: pending approvals, grants, handlers, and the
most recent records of the decision audit trail."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from hookbus._core.consumers import open_consumer
from hookbus._core.kv import release_consumer
from hookbus.dispatcher import HandlerStatus, RegistryView
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    DECISIONS_STREAM,
    DECISIONS_WILDCARD,
    ApprovalGrant,
    DecisionRecord,
    HookbusError,
    NotPermittedError,
    SuspensionRecord,
    decode,
    grant_key,
    to_builtins,
)

__all__ = ["approval_item", "decision_item", "grant_item", "handlers_view", "recent_decisions"]


def approval_item(record: SuspensionRecord) -> dict[str, Any]:
    """One approval as the page shows it.

    Keys: ``label``, ``agent_id``, ``status`` (pending / resolved / cancelled), ``prompt``,
    ``options``, ``default``, ``timeout_s``, ``handler``, ``event``, ``tool_name``,
    ``session_id``, ``data`` (the call's data as the handlers saw it, None when it was too
    large: then ``data_preview`` is the start of its JSON and ``data_bytes`` its size),
    ``created_at`` and ``expires_at`` (Unix seconds; ``expires_at`` None: no timeout),
    ``answered_by`` and ``choice`` once resolved, ``reason`` once cancelled.
    """
    m = record.metadata
    timeout = m.get("timeout_s")
    expires = record.created_at + float(timeout) if isinstance(timeout, int | float) else None
    resolution = record.resolution if isinstance(record.resolution, dict) else {}
    return {
        "label": record.label,
        "agent_id": record.agent_id,
        "status": record.status,
        "prompt": str(m.get("prompt") or ""),
        "options": [str(o) for o in m.get("options") or APPROVAL_DEFAULT_OPTIONS],
        "default": m.get("default"),
        "timeout_s": timeout,
        "handler": m.get("handler"),
        "event": m.get("event"),
        "tool_name": m.get("tool_name"),
        "session_id": m.get("session_id"),
        "data": m.get("data"),
        "data_preview": m.get("data_preview"),
        "data_bytes": m.get("data_bytes"),
        "created_at": record.created_at,
        "expires_at": expires,
        "answered_by": resolution.get("answered_by"),
        "choice": resolution.get("choice"),
        "reason": record.reason,
    }


def grant_item(grant: ApprovalGrant) -> dict[str, Any]:
    """One "Allow always" grant: its ``key`` (what revoking takes) and its fields."""
    key = grant_key(grant.agent_id, grant.session_id, grant.event, grant.handler, grant.tool)
    return {"key": key, **to_builtins(grant)}


def _handler_item(h: HandlerStatus) -> dict[str, Any]:
    src = h.declaration or h.required
    return {
        "event": h.event,
        "name": h.name,
        "declared": h.declaration is not None,
        "required": h.required is not None,
        "priority": src.priority if src else 0,
        "tool_filter": src.tool_filter if src else None,
        "failure_policy": src.failure_policy if src else None,
        "timeout_s": src.timeout_s if src else None,
        "replicas": [r.service_id for r in h.replicas],
        "last_seen": h.last_seen,
    }


def handlers_view(view: RegistryView) -> dict[str, Any]:
    """The handler registry with live replicas: ``handlers`` in call order (event, then
    priority), ``rejected`` records (key: reason) and ``live_only`` handlers (served by a
    live worker, not declared)."""
    return {
        "handlers": [_handler_item(h) for h in view.handlers],
        "rejected": view.rejected,
        "live_only": [{"event": e, "name": n} for e, n in view.live_only],
    }


def decision_item(record: DecisionRecord) -> dict[str, Any]:
    """One audit trail record as plain JSON (every `DecisionRecord` field)."""
    out: dict[str, Any] = to_builtins(record)
    return out


async def recent_decisions(nc: NATS, *, limit: int, timeout_s: float = 5.0) -> dict[str, Any]:
    """The last `limit` records of the decision audit trail, oldest first.

    Returns:
        ``{"available": True, "records": [...]}``, or ``{"available": False, "code": ...,
        "reason": ..., "records": []}``: code ``audit_off`` when the ``hookbus_decisions``
        stream does not exist (the audit trail is off), ``not_readable`` when this NATS
        user may not read it (only admin and auditor users may; NATS refuses it at once).
    """
    js = nc.jetstream(timeout=timeout_s)
    try:
        info = await js.stream_info(DECISIONS_STREAM)
    except nats.js.errors.NotFoundError:
        reason = (
            f"the audit trail is off: no {DECISIONS_STREAM} stream (`hookbus dispatcher --audit`)"
        )
        return {"available": False, "code": "audit_off", "reason": reason, "records": []}
    except NotPermittedError as exc:
        reason = f"{exc} (admin and auditor users may read the audit trail)"
        return {"available": False, "code": "not_readable", "reason": reason, "records": []}
    except (TimeoutError, nats.errors.Error) as exc:
        reason = (f"cannot read the {DECISIONS_STREAM} stream ({type(exc).__name__}): this"
                  " NATS user may not read it (admin and auditor users may)")  # fmt: skip
        return {"available": False, "code": "not_readable", "reason": reason, "records": []}
    last = info.state.last_seq
    if info.state.messages == 0 or last == 0:
        return {"available": True, "records": []}
    inbox: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_msg(msg: Msg) -> None:
        inbox.put_nowait(msg)

    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(info.state.first_seq, last - limit + 1, 1),
    )
    sub = await open_consumer(
        js, DECISIONS_STREAM, DECISIONS_WILDCARD, cb=on_msg, config=config, ordered=True
    )
    records: list[dict[str, Any]] = []
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while True:
                    msg = await inbox.get()
                    with contextlib.suppress(HookbusError):
                        records.append(decision_item(decode(msg.data, DecisionRecord)))
                    if msg.metadata.sequence.stream >= last or msg.metadata.num_pending == 0:
                        break
    finally:
        await release_consumer(sub)
    return {"available": True, "records": records[-limit:]}
