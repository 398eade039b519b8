"""Errors of hookbus: one root, a few leaves per area.

Errors that cross the wire travel as data (`hookbus.schemas.WireError`), never as pickles
or tracebacks; these classes are what the Python API raises.

The suspension errors say *suspension* (a run paused on a label, the Vercel AI SDK's
``hook``; see docs/names.md).
"""

from __future__ import annotations

__all__ = [
    "AlreadySettledError",
    "BadRequestError",
    "BucketConfigError",
    "DuplicateSuspensionError",
    "HandlerConflictError",
    "HookbusError",
    "HookbusTimeoutError",
    "JetStreamDomainError",
    "NotConnectedError",
    "NotPermittedError",
    "PayloadTooLargeError",
    "ResolutionRejectedError",
    "SuspensionAbortedError",
    "SuspensionCancelledError",
    "SuspensionError",
    "SuspensionNotFoundError",
    "SuspensionTimeoutError",
    "UnknownEventError",
    "WireFormatError",
]


class HookbusError(Exception):
    """Root of every error hookbus raises."""


class HookbusTimeoutError(HookbusError, TimeoutError):
    """An operation ran past its deadline (also a stdlib `TimeoutError`)."""


class NotConnectedError(HookbusError):
    """The operation needs a NATS connection and none was given or it is closed."""


class NotPermittedError(HookbusError):
    """The NATS server refused an operation to this connection's identity (a permissions
    violation): a request's or a publish's subject, or a subscription. Raised at once, as
    the server says it, instead of the timeout a refused request would otherwise end in.
    The message is one line: ``NATS refused <publish|subscription> to <subject> to
    <identity> (<role>): <the server's words>``; `operation`, `subject`, `identity` and
    `role` hold its parts (`role` is ``unknown`` unless the connection was labelled)."""

    def __init__(
        self,
        message: str,
        *,
        operation: str = "",
        subject: str = "",
        identity: str = "",
        role: str = "unknown",
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.subject = subject
        self.identity = identity
        self.role = role


class BucketConfigError(HookbusError):
    """A KV bucket exists with another configuration (replicas, TTL, history) than the
    one asked for, and strict bucket checking is on; the message names each difference."""


class JetStreamDomainError(BucketConfigError):
    """The JetStream that answers is not the one holding the fleet's buckets: it reports
    another JetStream domain than the one given (or one while none was given, e.g. a leaf
    node's own JetStream), or no JetStream answers at all (a leaf node without one).
    Raised instead of creating empty buckets there; the message names the domain found and
    says to give ``js_domain`` (``--js-domain``) naming the domain of the registry."""


class HandlerConflictError(HookbusError):
    """A worker declares a handler whose name is already declared, live, with other
    settings (priority, filter, policy, timeout, parallel, retry_safe); the message names
    each difference. Declare it with ``replace=True`` to take the name over."""


class WireFormatError(HookbusError):
    """A message could not be decoded into its wire type; the message names the JSON path."""


class BadRequestError(HookbusError):
    """The caller's input is invalid (bad JSON, wrong types, bad event name)."""


class UnknownEventError(BadRequestError):
    """The event is neither a standard event nor one with a declared handler (strict mode)."""


class PayloadTooLargeError(BadRequestError):
    """The encoded message exceeds the server's `max_payload` (bytes)."""


class SuspensionError(HookbusError):
    """Root of the suspension errors (``hook`` / ``resolve_hook`` / ``cancel_hook``)."""


class DuplicateSuspensionError(SuspensionError):
    """A live suspension with this label already exists (another waiter is attached, its
    process's lease alive)."""


class SuspensionNotFoundError(SuspensionError):
    """No suspension record exists for the label."""


class AlreadySettledError(SuspensionError):
    """The suspension is already resolved or cancelled; exactly one outcome wins."""


class ResolutionRejectedError(SuspensionError, BadRequestError):
    """The value does not fit the suspension's payload schema; the record is unchanged."""


class SuspensionCancelledError(SuspensionError):
    """The awaited suspension was cancelled (`cancel_hook`); `reason` says why, `label`
    names it."""

    def __init__(self, label: str, reason: str | None) -> None:
        super().__init__(f"hook {label!r} was cancelled" + (f": {reason}" if reason else ""))
        self.label = label
        self.reason = reason


class SuspensionAbortedError(SuspensionError):
    """`abort_pending_hook` stopped this wait; the record stays pending for a later run."""


class SuspensionTimeoutError(SuspensionError, HookbusTimeoutError):
    """No resolution arrived within the suspension's timeout (seconds, ``timeout_s``); also
    a `HookbusTimeoutError` and a stdlib `TimeoutError`."""
