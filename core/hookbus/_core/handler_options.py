"""One definition of a handler's options (`OPTIONS`), their defaults, their bounds and
tool-filter matching: what a worker declares, what the registry accepts, what an in-process
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

Defaults are the wire contract's: a `HandlerDeclaration`'s field defaults (`DEFAULTS`,
`DEFAULT_TIMEOUT_S`); an in-process handler's timeout defaults to None (no limit, as in
amplifier-core). The public signatures that spell the options out for IDEs
(``HookWorker.handler`` / ``add_handler``, ``HookDispatcher.register``) take their defaults
from here and are checked against `OPTIONS` / `LOCAL_OPTIONS` by the tests.

The fold's rules (stop rule, chaining, grouping) are in `hookbus._core.fold_rules`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, get_args

import msgspec

from hookbus.schemas import (
    MAX_HANDLER_TIMEOUT_S,
    MAX_PRIORITY,
    MAX_TOOL_PATTERNS,
    FailurePolicy,
    HandlerDeclaration,
    ToolFilter,
)
from hookbus.schemas.tool_filter import HandlerOptionError

__all__ = [
    "DEFAULTS",
    "DEFAULT_FAILURE_POLICY",
    "DEFAULT_PRIORITY",
    "DEFAULT_TIMEOUT_S",
    "LOCAL_OPTIONS",
    "MAX_HANDLER_TIMEOUT_S",
    "MAX_PRIORITY",
    "MAX_TOOL_PATTERNS",
    "OPTIONS",
    "HandlerOptionError",
    "HandlerOptions",
    "ToolFilter",
    "check_failure_policy",
    "check_local_priority",
    "check_priority",
    "check_timeout",
    "is_async_handler",
    "stricter_policy",
]

_POLICIES: Final = frozenset(get_args(FailurePolicy))


def is_async_handler(handler: Any) -> bool:
    """Whether calling `handler` gives a coroutine: a coroutine function, or an object whose
    ``__call__`` is one. Any other handler is sync: a worker runs it in a thread, and so
    does an in-process dispatcher when its call has a time limit."""
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        type(handler).__call__
    )


def _declared_default(field: str) -> Any:
    """A `HandlerDeclaration` field's default: the wire contract's default of that option."""
    for f in msgspec.structs.fields(HandlerDeclaration):
        if f.name == field:
            return f.default
    raise LookupError(field)  # pragma: no cover - the wire contract names every option


DEFAULT_PRIORITY: Final[int] = _declared_default("priority")
DEFAULT_TIMEOUT_S: Final[float] = _declared_default("timeout_s")
"""Seconds per call of a remote handler that declares none (and of a remote call whose
route gives none)."""
DEFAULT_FAILURE_POLICY: Final[FailurePolicy] = _declared_default("failure_policy")


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

    priority: int = DEFAULT_PRIORITY
    tool_filter: ToolFilter = ToolFilter.EVERY
    failure_policy: FailurePolicy = DEFAULT_FAILURE_POLICY
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    """Seconds per call, clamped to `MAX_HANDLER_TIMEOUT_S`; None (in-process only): no
    limit."""
    parallel: bool = False
    retry_safe: bool = False
    """Running it twice for one call is harmless (implied by `pure`)."""
    pure: bool = False

    @classmethod
    def remote(
        cls,
        *,
        priority: object = DEFAULT_PRIORITY,
        timeout_s: object = DEFAULT_TIMEOUT_S,
        failure_policy: object = DEFAULT_FAILURE_POLICY,
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
        priority: object = DEFAULT_PRIORITY,
        timeout_s: object = None,
        failure_policy: object = DEFAULT_FAILURE_POLICY,
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

    def declared(self) -> dict[str, Any]:
        """The options as a `HandlerDeclaration`'s fields (a remote handler's: its timeout
        is never None)."""
        fields = {name: getattr(self, name) for name in OPTIONS}
        fields["tool_filter"] = self.tool_filter.as_list()
        return fields


OPTIONS: Final = tuple(f.name for f in dataclasses.fields(HandlerOptions))
"""The option set of a remote handler, in one place: every signature, declaration and route
that spells the options out lists exactly these (a test holds them to it)."""
LOCAL_OPTIONS: Final = tuple(o for o in OPTIONS if o != "retry_safe")
"""The option set of an in-process handler (`HandlerOptions.local`): `retry_safe` is
implied by `pure` (an in-process call is never hedged)."""
DEFAULTS: Final = HandlerOptions()
"""A remote handler's options when it gives none."""
