"""One definition of a handler's options, their bounds, tool-filter matching and the
fold's stop rule: what a worker declares, what the registry accepts, what an in-process
`HookDispatcher.register` takes and what dispatchers and workers judge calls by.

Every path that takes a handler's options validates them here: `HookWorker.add_handler`
(the declaration a worker writes), `HookDispatcher.register` (in-process handlers),
`check_declaration` and `check_required` (every record read from the registry), and the
routes built from them. So a worker can never serve a declaration that every dispatcher
refuses, and a timeout is clamped the same way wherever it comes from.

Bounds (the numbers are the wire contract's, `hookbus.schemas`; the tool filter's rule is
`ToolFilter`'s, also there):

==================  ==========================================================================
``priority``        remote: an int (not a bool) within ±`MAX_PRIORITY`; in-process:
                    amplifier-core's rule, any int (bools count) that fits in 32 bits
``timeout_s``       an int or float (not a bool), finite and > 0, seconds; clamped to
                    `MAX_HANDLER_TIMEOUT_S`. In-process, None means no limit
``failure_policy``  ``"ignore"`` or ``"deny"``
``tool_filter``     None (every call), or a list of at most `MAX_TOOL_PATTERNS` globs
                    (`fnmatch` syntax, whole-name, case-insensitive match over
                    ``data["tool_name"]``: see `ToolFilter`) of 1 to `MAX_NAME_LENGTH`
                    characters each; a bare string is refused
==================  ==========================================================================

The stop rule (`ends_fold`) is amplifier-core's ``HookRegistry.emit``: the fold stops at a
deny; hookbus adds that it stops at a failure under policy ``deny``, at a result that cannot
be read (always denied), and at a parallel handler's modify (refused, judged by its policy
as a ``bad_reply``, so it denies).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal, get_args

from hookbus.schemas import (
    MAX_HANDLER_TIMEOUT_S,
    MAX_PRIORITY,
    MAX_TOOL_PATTERNS,
    Action,
    FailurePolicy,
    ToolFilter,
)
from hookbus.schemas._tool_filter import HandlerOptionError, compile_tool_filter

__all__ = [
    "MAX_HANDLER_TIMEOUT_S",
    "MAX_PRIORITY",
    "MAX_TOOL_PATTERNS",
    "HandlerOptionError",
    "HandlerOptions",
    "StepOutcome",
    "ToolFilter",
    "check_failure_policy",
    "check_local_priority",
    "check_priority",
    "check_timeout",
    "compile_tool_filter",
    "ends_fold",
    "stricter_policy",
]

_POLICIES: Final = frozenset(get_args(FailurePolicy))


def check_priority(priority: object) -> int:
    """A remote handler's priority: an int (not a bool) within ±`MAX_PRIORITY`.

    Raises:
        HandlerOptionError: anything else.
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise HandlerOptionError(f"priority must be an int, not {type(priority).__name__}")
    if abs(priority) > MAX_PRIORITY:
        raise HandlerOptionError(f"priority {priority!r} outside ±{MAX_PRIORITY}")
    return priority


def check_local_priority(priority: object) -> int:
    """An in-process handler's priority, amplifier-core's rule: an int (a bool counts as
    one) that fits in 32 bits.

    Raises:
        TypeError: not an int.
        OverflowError: outside ``[-2**31, 2**31)``.
    """
    if not isinstance(priority, int):
        raise TypeError(f"priority must be an int, not {type(priority).__name__}")
    if not -(2**31) <= priority < 2**31:
        raise OverflowError(f"priority {priority} does not fit in a 32-bit int")
    return priority


def check_timeout(timeout_s: object) -> float:
    """A handler's per-call timeout in seconds: finite and > 0, clamped to
    `MAX_HANDLER_TIMEOUT_S`.

    Raises:
        HandlerOptionError: not a number (a bool is not one), NaN, infinite, or <= 0.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise HandlerOptionError(
            f"timeout_s must be a number of seconds, not {type(timeout_s).__name__}"
        )
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise HandlerOptionError(f"timeout_s must be finite and positive, got {timeout_s!r}")
    return min(float(timeout_s), MAX_HANDLER_TIMEOUT_S)


def check_failure_policy(policy: object) -> FailurePolicy:
    """``"ignore"`` or ``"deny"``.

    Raises:
        HandlerOptionError: anything else.
    """
    if not isinstance(policy, str) or policy not in _POLICIES:
        raise HandlerOptionError(f"failure_policy must be 'ignore' or 'deny', not {policy!r}")
    return policy  # type: ignore[return-value]  # checked against the Literal's values


def stricter_policy(a: FailurePolicy, b: FailurePolicy) -> FailurePolicy:
    """The stricter of two failure policies: ``deny`` if either is."""
    return "deny" if "deny" in (a, b) else "ignore"


@dataclass(frozen=True, slots=True)
class HandlerOptions:
    """A handler's options, within their bounds (see the module docstring). Made with
    `remote` (a worker's handler, a registry record) or `local` (an in-process handler)."""

    priority: int
    timeout_s: float | None
    """Seconds per call, clamped to `MAX_HANDLER_TIMEOUT_S`; None (in-process only): no
    limit."""
    failure_policy: FailurePolicy
    tool_filter: ToolFilter
    parallel: bool = False
    retry_safe: bool = False
    """Running it twice for one call is harmless (implied by `pure`)."""
    pure: bool = False

    @classmethod
    def remote(
        cls,
        *,
        priority: object = 0,
        timeout_s: object = 5.0,
        failure_policy: object = "ignore",
        tool_filter: ToolFilter | Iterable[str] | None = None,
        parallel: bool = False,
        retry_safe: bool = False,
        pure: bool = False,
    ) -> HandlerOptions:
        """The options of a remote handler (declared, or read from the registry).

        Raises:
            HandlerOptionError: an option out of its bounds.
        """
        return cls(
            priority=check_priority(priority),
            timeout_s=check_timeout(timeout_s),
            failure_policy=check_failure_policy(failure_policy),
            tool_filter=ToolFilter.of(tool_filter),
            parallel=bool(parallel),
            retry_safe=bool(retry_safe or pure),
            pure=bool(pure),
        )

    @classmethod
    def local(
        cls,
        *,
        priority: object = 0,
        timeout_s: object = None,
        failure_policy: object = "ignore",
        tool_filter: ToolFilter | Iterable[str] | None = None,
        parallel: bool = False,
        pure: bool = False,
    ) -> HandlerOptions:
        """The options of an in-process handler: amplifier-core's priority rule, and
        `timeout_s` None for no limit (a given one is checked and clamped as a remote one).

        Raises:
            TypeError, OverflowError: the priority (see `check_local_priority`).
            HandlerOptionError: another option out of its bounds.
        """
        return cls(
            priority=check_local_priority(priority),
            timeout_s=None if timeout_s is None else check_timeout(timeout_s),
            failure_policy=check_failure_policy(failure_policy),
            tool_filter=ToolFilter.of(tool_filter),
            parallel=bool(parallel),
            retry_safe=bool(pure),
            pure=bool(pure),
        )


StepOutcome = Action | Literal["failed", "unreadable"]
"""How one handler call ended, as the stop rule sees it: the action of its result,
``failed`` (timeout, no responders, an error) or ``unreadable`` (a result that cannot be
read)."""


def ends_fold(outcome: StepOutcome, *, parallel: bool, failure_policy: FailurePolicy) -> bool:
    """Whether the fold stops at a handler call that ended with `outcome` (so no later
    handler runs): a deny, a parallel handler's modify, an unreadable result, a failure
    under policy deny. Source: amplifier-core ``HookRegistry.emit`` (deny short-circuit)
    and hookbus's failure policies (see `Fold.fail`)."""
    if outcome == "unreadable" or outcome == "deny":
        return True
    if outcome == "failed":
        return failure_policy == "deny"
    return parallel and outcome == "modify"
