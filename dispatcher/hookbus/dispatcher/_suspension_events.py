"""Suspension payloads and suspension events: converting resolutions to and from a payload
type, checking them against a JSON Schema (validators cached), publishing a record's event
(`HookEvent`, the Vercel AI SDK's name) and the event stream.

A resolution is checked on the resolver's path, before its write. With jsonschema-rs
installed (``hookbus[fast]``) it answers "valid" in about a microsecond (python-jsonschema
takes 30 us and more); a value it refuses is judged again by python-jsonschema, whose
verdict and message (the best match, with its JSON path) are the ones given. Without it,
python-jsonschema judges every value.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, TypeVar

import jsonschema
import msgspec
import nats.errors
from nats.aio.client import Client as NATS

from hookbus.schemas import (
    HookbusError,
    HookEvent,
    HookPart,
    ResolutionRejectedError,
    SuspensionRecord,
    decode,
    encode,
    suspension_event_subject,
)

__all__ = [
    "HookEventStream",
    "Validators",
    "check",
    "convert",
    "from_json_value",
    "payload_schema",
    "publish",
    "settled",
    "to_json_value",
]

jsonschema_rs: Any
try:
    import jsonschema_rs
except ImportError:  # the fast extra is not installed: python-jsonschema alone
    jsonschema_rs = None

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")


def payload_schema(payload: type[Any] | None) -> dict[str, Any] | None:
    """JSON Schema of a payload type: a msgspec Struct (or any msgspec type), or a
    pydantic model when pydantic is installed; None for any JSON value."""
    if payload is None:
        return None
    if hasattr(payload, "model_json_schema"):
        return payload.model_json_schema()  # type: ignore[no-any-return]
    return msgspec.json.schema(payload)


def to_json_value(value: Any) -> Any:
    """A resolution as plain JSON data (Structs, pydantic models, dataclasses, dicts)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return msgspec.to_builtins(value)


def from_json_value(value: Any, payload: type[T] | None) -> T:
    """Convert a stored resolution into the payload type (identity without one)."""
    if payload is None:
        return value  # type: ignore[no-any-return]
    if hasattr(payload, "model_validate"):
        return payload.model_validate(value)  # type: ignore[no-any-return,attr-defined]
    return msgspec.convert(value, payload)


class HookEventStream:
    """Suspension events (`HookEvent`) as an async iterator (`async for event in stream`);
    close with `aclose` or use ``async with``. Subscribed before it is returned: nothing
    after the call is missed."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    def __aiter__(self) -> HookEventStream:
        return self

    async def __anext__(self) -> HookEvent:
        while True:
            try:
                msg = await self._sub.next_msg(timeout=None)
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
                raise StopAsyncIteration from None
            try:
                return decode(msg.data, HookEvent)
            except HookbusError as exc:
                log.warning("ignoring bad suspension event on %s: %s", msg.subject, exc)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def __aenter__(self) -> HookEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Validator:
    """One JSON Schema (draft 2020-12): `fast` (jsonschema-rs; None when it is not
    installed or cannot compile the schema) and `full` (python-jsonschema, the reference)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.full = jsonschema.Draft202012Validator(schema)
        self.fast: Any = None
        if jsonschema_rs is None:
            return
        try:
            self.fast = jsonschema_rs.Draft202012Validator(schema)
        except Exception as exc:  # e.g. a remote $ref: the reference validator alone
            log.debug("jsonschema-rs cannot compile a payload schema (%r)", exc)


class Validators:
    """A `Validator` per distinct schema, built once, at most 256."""

    def __init__(self) -> None:
        self._cache: dict[bytes, Validator] = {}

    def get(self, schema: dict[str, Any]) -> Validator:
        cache_key = encode(schema)
        validator = self._cache.get(cache_key)
        if validator is None:
            if len(self._cache) > 256:
                self._cache.clear()
            validator = self._cache[cache_key] = Validator(schema)
        return validator


async def publish(nc: NATS, record: SuspensionRecord) -> None:
    """Publish the suspension event of `record`'s current state (a closed connection is ignored)."""
    event = HookEvent(
        hook=HookPart(
            hook_id=record.hook_id,
            label=record.label,
            status=record.status,
            agent_id=record.agent_id,
            metadata=record.metadata,
            resolution=record.resolution,
            reason=record.reason,
        ),
        at=time.time(),
    )
    with contextlib.suppress(nats.errors.ConnectionClosedError):
        await nc.publish(
            suspension_event_subject(record.label, record.status, record.agent_id), encode(event)
        )


def convert(label: str, value: Any, payload: type[T] | None) -> T:
    """The resolution as `payload`, or `ResolutionRejectedError` with the reason."""
    try:
        return from_json_value(value, payload)
    except (msgspec.ValidationError, ValueError, TypeError) as exc:
        name = getattr(payload, "__name__", "the payload type")
        raise ResolutionRejectedError(
            f"the resolution of {label!r} does not fit {name}: {exc}"
        ) from exc


def settled(record: SuspensionRecord) -> str:
    if record.status == "resolved":
        return "resolved (consumed)" if record.consumed else "resolved"
    return f"cancelled ({record.reason})" if record.reason else "cancelled"


def check(record: SuspensionRecord, data: Any, validator: Validator) -> None:
    """Refuse `data` that does not fit `record`'s payload schema.

    Raises:
        ResolutionRejectedError: with the best match's message and JSON path.
    """
    if validator.fast is not None and validator.fast.is_valid(data):
        return
    error = jsonschema.exceptions.best_match(validator.full.iter_errors(data))
    if error is not None:
        path = "$" + "".join(
            f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path
        )
        raise ResolutionRejectedError(
            f"resolution for {record.label!r} does not fit {record.payload_type or 'its schema'}:"
            f" {error.message} at {path}"
        )
