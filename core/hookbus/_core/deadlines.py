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

Floats stay floats: each method is the one expression the paths wrote out before
(``now + seconds``, ``max(0.0, when - now)``, ``min(a, b)``), so a decision made through
it is bit for bit the one made without it. No deadline at all is `NEVER` (``when`` is
``math.inf``, which `min` and comparisons already treat as "no limit"). Wire fields
(``budget_s``) stay seconds: a deadline is for arithmetic within one process.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from . import clock

__all__ = ["NEVER", "Deadline"]


@dataclass(frozen=True, slots=True)
class Deadline:
    """When some time ends, on the loop clock; immutable.

    Build one with `Deadline.after` (seconds from now) or `Deadline.at` (a clock
    reading); `NEVER` is no deadline. Every ``now`` argument is a reading of the same
    clock, seconds (None: `clock.now()`, read only when needed).
    """

    when: float = math.inf
    """Seconds on the clock at which the time ends; ``math.inf``: never."""

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
        return self.when == math.inf

    def left(self, now: float | None = None) -> float:
        """Seconds left at `now`, never below 0 (``max(0.0, when - now)``); ``math.inf``
        for `NEVER`."""
        when = self.when
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
        when = self.when
        if when == math.inf:
            return False
        return when - (clock.now() if now is None else now) < clock.NO_TIME_S

    def passed(self, now: float | None = None, *, early_s: float = 0.0) -> bool:
        """Whether `now` is at or past the deadline, or past `early_s` seconds before it
        (``now >= when - early_s``: a margin kept before a give-up); never for `NEVER`."""
        when = self.when
        if when == math.inf:
            return False
        return (clock.now() if now is None else now) >= when - early_s

    def earlier(self, other: Deadline) -> Deadline:
        """The earlier of this deadline and `other` (``min``)."""
        return other if other.when < self.when else self

    def within(self, seconds: float | None, now: float | None = None) -> Deadline:
        """The earlier of this deadline and `seconds` from `now` (None seconds: this one)."""
        return self if seconds is None else self.earlier(Deadline.after(seconds, now))

    def plus(self, seconds: float) -> Deadline:
        """The deadline `seconds` later (a grace past a budget; ``when + seconds``)."""
        return Deadline(self.when + seconds)

    def cap(self, when: float) -> float:
        """The clock reading `when`, or this deadline's if earlier (``min``)."""
        return self.when if self.when < when else when

    def timeout(self) -> asyncio.Timeout:
        """An `asyncio.timeout_at` context ending at this deadline (none for `NEVER`):
        `TimeoutError` out of its block once the loop's clock reaches it."""
        return asyncio.timeout_at(None if self.when == math.inf else self.when)

    def __repr__(self) -> str:
        if self.when == math.inf:
            return "Deadline(never)"
        left = self.when - clock.now()
        if left < clock.NO_TIME_S:
            return f"Deadline(expired {max(0.0, -left):.3g} s ago)"
        return f"Deadline({left:.3g} s left)"


NEVER = Deadline()
"""No deadline: nothing ends, `left` is ``math.inf``."""
