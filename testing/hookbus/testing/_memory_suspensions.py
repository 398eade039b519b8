"""Suspensions of an in-process test environment (`MemorySuspensions`): ``hook``,
``resolve_hook`` and ``cancel_hook`` with the outcomes and errors of the durable store
(`hookbus.dispatcher.Suspensions`), kept in memory, waited for on the event loop's clock.

- a resolution given before any ``hook`` is pre-registered: the next ``hook`` of the label
  takes it and returns at once (exactly once);
- otherwise ``hook`` waits, pending, until resolved (its value), cancelled
  (`SuspensionCancelledError`) or its ``timeout_s`` (`SuspensionTimeoutError`); a second
  ``hook`` of a pending label is `DuplicateSuspensionError`;
- a resolution that does not fit the hook's payload type is refused
  (`ResolutionRejectedError`) and the hook keeps waiting; one of a label already resolved
  or cancelled is `AlreadySettledError`; a cancelled label stays cancelled (a later
  ``hook`` of it raises), a resolved one may be hooked again once its value was taken.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from hookbus.schemas import (
    AlreadySettledError,
    DuplicateSuspensionError,
    ResolutionRejectedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionTimeoutError,
)

__all__ = ["MemorySuspensions"]

T = TypeVar("T")


@dataclass
class _Record:
    status: str
    """``pending`` (a hook waits), ``resolved`` (pre-registered, not taken yet),
    ``consumed`` (a hook took its value) or ``cancelled`` (`value`: the reason)."""
    payload: Any = None
    value: Any = None
    waiter: asyncio.Future[Any] | None = None


class MemorySuspensions:
    """The suspension records of one test environment, by label (see the module docstring)."""

    def __init__(self) -> None:
        self._records: dict[str, _Record] = {}

    async def hook(self, label: str, payload: type[T] | None, timeout_s: float | None) -> T:
        """Suspend until `label` is resolved, at most `timeout_s` seconds (None: no
        limit); its value as `payload` (None: JSON data)."""
        record = self._records.get(label)
        if record is not None and record.status == "resolved":  # pre-registered
            value: T = _as(payload, record.value)  # not fitting: it stays, as on NATS
            record.status = "consumed"
            return value
        if record is not None and record.status == "pending":
            raise DuplicateSuspensionError(f"hook {label!r} is already pending")
        if record is not None and record.status == "cancelled":
            raise SuspensionCancelledError(label, record.value)
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        record = _Record("pending", payload, waiter=waiter)
        self._records[label] = record
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter  # type: ignore[no-any-return]
        except TimeoutError:
            raise SuspensionTimeoutError(
                f"hook {label!r}: no resolution within {timeout_s}s"
            ) from None
        finally:
            if record.status == "pending":  # timed out or stopped: no record left
                self._records.pop(label, None)

    def pending(self, label: str) -> bool:
        """Whether a ``hook(label)`` waits."""
        record = self._records.get(label)
        return record is not None and record.status == "pending"

    def resolve_hook(self, label: str, value: Any) -> None:
        """Resolve the pending hook `label` with `value`, or pre-register the resolution.

        Raises:
            ResolutionRejectedError: `value` does not fit the waiting hook's payload type.
            AlreadySettledError: `label` is resolved (taken or not) or cancelled.
        """
        record = self._records.get(label)
        if record is None:
            self._records[label] = _Record("resolved", value=_json(value))
            return
        if record.status != "pending" or record.waiter is None or record.waiter.done():
            raise AlreadySettledError(f"hook {label!r} is already {record.status}")
        record.waiter.set_result(_as(record.payload, _json(value)))
        record.status = "consumed"

    def cancel_hook(self, label: str, reason: str | None = None) -> None:
        """Cancel the pending hook `label`: its waiter raises `SuspensionCancelledError`.

        Raises:
            SuspensionNotFoundError: no record of `label`.
            AlreadySettledError: it is resolved or cancelled already.
        """
        record = self._records.get(label)
        if record is None:
            raise SuspensionNotFoundError(f"no hook {label!r}")
        if record.status != "pending" or record.waiter is None or record.waiter.done():
            raise AlreadySettledError(f"hook {label!r} is already {record.status}")
        record.status, record.value = "cancelled", reason
        record.waiter.set_exception(SuspensionCancelledError(label, reason))


def _json(value: Any) -> Any:
    """`value` as the JSON a resolution is stored as (a Struct, a pydantic model, data)."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return msgspec.to_builtins(value)


def _as(payload: type[T] | None, value: Any) -> T:
    """`value` read as `payload` (a msgspec Struct, a pydantic model or any type msgspec
    converts to; None: the JSON data as it is)."""
    if payload is None:
        return value  # type: ignore[no-any-return]
    try:
        if hasattr(payload, "model_validate"):
            return payload.model_validate(value)  # type: ignore[no-any-return,attr-defined]
        return msgspec.convert(value, payload)
    except Exception as exc:
        raise ResolutionRejectedError(
            f"the resolution does not fit {payload.__name__}: {exc}"
        ) from exc
