"""One value for time: `Deadline`, a point on the loop clock by which something ends.

An emit's deadline, a handler call's budget, the end of a wait past that budget, a
caller's bound on a store's retries: each is made once as a `Deadline` and handed down,
and every path splits it (`within`, `earlier`, `plus`), checks it (`expired`, `passed`)
and reports what is left (`left`, `cut`) through it, instead of re-deriving "what is
left" from floats in each layer (httpx's ``Timeout``, anyio's cancel scopes).

The clock is `hookbus._core.clock`'s: the running loop's (`clock.now()`), which a test may
make virtual. A caller that measures on another monotonic clock (a worker dates a request
by ``time.monotonic()``) passes its own readings as `now`: a deadline is only compared
with readings of the clock it was made on.

A task's caller deadline (`caller_deadline`) is one too: within its block every store
retry of the task (`kv_retry`, a reconciled write) ends by it (`time_left`, `caller_bound`).

Floats stay floats: each method is the one expression the paths wrote out before
(``now + seconds``, ``max(0.0, when - now)``, ``min(a, b)``), so a decision made through
it is bit for bit the one made without it. No deadline at all is `NEVER` (``when`` is
``math.inf``, which `min` and comparisons already treat as "no limit"). Wire fields
(``budget_s``) stay seconds: a deadline is for arithmetic within one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

from . import clock

__all__ = ["NEVER", "Deadline", "caller_bound", "caller_deadline", "time_left"]


class Deadline:
    """When some time ends, on the loop clock; immutable (hashable, equal by `when`).

    Build one with `Deadline.after` (seconds from now) or `Deadline.at` (a clock
    reading); `NEVER` is no deadline. Every ``now`` argument is a reading of the same
    clock, seconds (None: `clock.now()`, read only when needed).

    Args:
        when: seconds on the clock at which the time ends; ``math.inf``: never.
    """

    __slots__ = ("_when",)

    def __init__(self, when: float = math.inf) -> None:
        self._when = when  # read through `when` (no setter): cheaper to make than frozen

    @property
    def when(self) -> float:
        """Seconds on the clock at which the time ends; ``math.inf``: never."""
        return self._when

    @classmethod
    def after(cls, seconds: float | None, now: float | None = None) -> Deadline:
        """The deadline `seconds` from `now` (``now + seconds``); None seconds: `NEVER`."""
        if seconds is None:
            return NEVER
        return cls((clock.now() if now is None else now) + seconds)

    @classmethod
    def at(cls, when: float | None) -> Deadline:
        """The deadline at clock reading `when` (seconds); None: `NEVER`."""
        return NEVER if when is None else cls(when)

    @property
    def unbounded(self) -> bool:
        """Whether this is no deadline at all (`NEVER`)."""
        return self._when == math.inf

    def left(self, now: float | None = None) -> float:
        """Seconds left at `now`, never below 0 (``max(0.0, when - now)``); ``math.inf``
        for `NEVER`."""
        when = self._when
        if when == math.inf:
            return when
        return max(0.0, when - (clock.now() if now is None else now))

    def cut(self, seconds: float, now: float | None = None) -> float:
        """`seconds` (a timeout, a budget) cut to what is left at `now`: the smaller of
        the two, never below 0 unless `seconds` is."""
        return min(seconds, self.left(now))

    def expired(self, now: float | None = None) -> bool:
        """Whether less than `clock.NO_TIME_S` is left at `now` (no time to call a handler
        in: `clock.no_time_left` of what is left); never for `NEVER`."""
        when = self._when
        if when == math.inf:
            return False
        return when - (clock.now() if now is None else now) < clock.NO_TIME_S

    def passed(self, now: float | None = None, *, early_s: float = 0.0) -> bool:
        """Whether `now` is at or past the deadline, or past `early_s` seconds before it
        (``now >= when - early_s``: a margin kept before a give-up); never for `NEVER`."""
        when = self._when
        if when == math.inf:
            return False
        return (clock.now() if now is None else now) >= when - early_s

    def earlier(self, other: Deadline) -> Deadline:
        """The earlier of this deadline and `other` (``min``)."""
        return other if other._when < self._when else self

    def within(self, seconds: float | None, now: float | None = None) -> Deadline:
        """The earlier of this deadline and `seconds` from `now` (None seconds: this one)."""
        return self if seconds is None else self.earlier(Deadline.after(seconds, now))

    def plus(self, seconds: float) -> Deadline:
        """The deadline `seconds` later (a grace past a budget; ``when + seconds``)."""
        return Deadline(self._when + seconds)

    def cap(self, when: float) -> float:
        """The clock reading `when`, or this deadline's if earlier (``min``)."""
        mine = self._when
        return mine if mine < when else when

    def timeout(self) -> asyncio.Timeout:
        """An `asyncio.timeout_at` context ending at this deadline (none for `NEVER`):
        `TimeoutError` out of its block once the loop's clock reaches it."""
        when = self._when
        return asyncio.timeout_at(None if when == math.inf else when)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Deadline):
            return NotImplemented
        return self._when == other._when

    def __hash__(self) -> int:
        return hash(self._when)

    def __repr__(self) -> str:
        if self._when == math.inf:
            return "Deadline(never)"
        left = self._when - clock.now()
        if left < clock.NO_TIME_S:
            return f"Deadline(expired {max(0.0, -left):.3g} s ago)"
        return f"Deadline({left:.3g} s left)"


NEVER = Deadline()
"""No deadline: nothing ends, `left` is ``math.inf``."""


# -- the caller's deadline of a task -------------------------------------------------
_CALLER_DEADLINE: contextvars.ContextVar[tuple[Deadline, asyncio.Task[Any] | None] | None] = (
    contextvars.ContextVar("hookbus_caller_deadline", default=None)
)


@contextlib.contextmanager
def caller_deadline(timeout_s: float | None, *, extend: bool = False) -> Iterator[None]:
    """Within the block, every `kv_retry` (and every store write that asks `time_left`)
    of this task ends by `timeout_s` seconds from now: the caller's own timeout bounds
    each retry loop, instead of the store's deadline. Tasks started in the block are not
    bound by it (a background watch or lease heartbeat outlives the call).

    Args:
        timeout_s: seconds from now (None: no bound added).
        extend: replace an earlier deadline of an enclosing block instead of keeping the
            earlier of the two (e.g. a few reads allowed once the caller's deadline passed).
    """
    if timeout_s is None:
        yield
        return
    now = asyncio.get_running_loop().time()
    outer = _CALLER_DEADLINE.get()
    task = asyncio.current_task()
    if not extend and outer is not None and outer[1] is task:
        until = outer[0].within(max(0.0, timeout_s), now)
    else:
        until = Deadline.after(max(0.0, timeout_s), now)
    token = _CALLER_DEADLINE.set((until, task))
    try:
        yield
    finally:
        _CALLER_DEADLINE.reset(token)


def _task_bound() -> Deadline | None:
    bound = _CALLER_DEADLINE.get()
    return None if bound is None or bound[1] is not asyncio.current_task() else bound[0]


def caller_bound() -> Deadline:
    """The `caller_deadline` of this task (`NEVER` outside such a block)."""
    bound = _task_bound()
    return NEVER if bound is None else bound


def time_left(deadline_s: float) -> float:
    """`deadline_s` (seconds) cut to what the `caller_deadline` of this task leaves
    (seconds, at least 0); `deadline_s` itself outside such a block."""
    bound = _task_bound()
    if bound is None:
        return deadline_s
    return max(0.0, bound.cut(deadline_s, asyncio.get_running_loop().time()))
