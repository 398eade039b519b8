"""The clock deadlines and budgets are measured on: the running event loop's.

asyncio's loop clock is `time.monotonic()` (uvloop's, the same monotonic clock in
milliseconds), and the loop's own timers (`asyncio.timeout`, `call_at`, sleeps) run on it;
measuring an emit's deadline, a handler's budget and "one by one, when would this call
have ended" on the same clock keeps them in step with the timers that enforce them, and
lets a test run on a loop whose clock is virtual (``looptime``): the decision then cannot
depend on how busy the machine is. Never a wall clock (`time.time()`): two hosts' wall
clocks are never compared.
"""

from __future__ import annotations

import asyncio
import time

__all__ = ["NO_TIME_S", "no_time_left", "now"]

NO_TIME_S = 1e-6
"""Less time left than this (a microsecond) is none: a handler with less is not called, and
a handler's end this close to the emit's deadline is at it. Far below what any timer of the
loop tells apart, and above the float rounding of deadlines and durations measured apart
(``0.05 * 1.5 == 0.07500000000000001``)."""


def no_time_left(left_s: float | None) -> bool:
    """True if `left_s` seconds (None: no limit) is no time to call a handler in."""
    return left_s is not None and left_s < NO_TIME_S


def now() -> float:
    """Seconds on the running event loop's clock (`time.monotonic()` outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()
