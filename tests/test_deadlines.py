"""`hookbus._core.deadlines.Deadline`, the one value for time: made once, split, checked
and reported through its methods, each the float expression the paths wrote out before
(so a decision through it is bit for bit the same). No server: the fast tier."""

from __future__ import annotations

import asyncio
import math
import re

import pytest

from hookbus._core import clock
from hookbus._core.deadlines import NEVER, Deadline, caller_bound, caller_deadline, time_left
from hookbus.testing import run_with_virtual_clock


def test_never_is_unbounded_in_every_check() -> None:
    assert NEVER.unbounded and Deadline.after(None) is NEVER and Deadline.at(None) is NEVER
    assert NEVER.left(1e9) == math.inf
    assert NEVER.cut(2.5, 1e9) == 2.5
    assert not NEVER.expired(1e9) and not NEVER.passed(1e9, early_s=5.0)
    assert NEVER.cap(7.0) == 7.0
    assert repr(NEVER) == "Deadline(never)"


def test_a_deadline_is_a_point_after_a_clock_reading() -> None:
    deadline = Deadline.after(1.5, 10.0)
    assert deadline == Deadline.at(11.5) and not deadline.unbounded
    assert deadline.left(10.25) == 1.25
    assert deadline.left(12.0) == 0.0  # never below 0
    assert deadline.cut(3.0, 10.5) == 1.0 and deadline.cut(0.5, 10.5) == 0.5
    with pytest.raises(AttributeError):
        deadline.when = 1.0  # type: ignore[misc]  # immutable


def test_less_than_no_time_s_left_is_expired() -> None:
    deadline = Deadline.at(5.0)
    assert not deadline.expired(5.0 - 2 * clock.NO_TIME_S)
    assert deadline.expired(5.0 - clock.NO_TIME_S / 2)
    assert deadline.expired(5.0) and deadline.expired(6.0)
    # as `clock.no_time_left` of what is left, the check each handler call made
    for now in (4.0, 5.0 - clock.NO_TIME_S, 5.0 - 0.9e-6, 5.0, 5.5):
        assert deadline.expired(now) == clock.no_time_left(5.0 - now)


def test_passed_is_at_or_past_it_or_a_margin_before() -> None:
    deadline = Deadline.at(2.0)
    assert not deadline.passed(1.999) and deadline.passed(2.0) and deadline.passed(3.0)
    assert deadline.passed(1.96, early_s=0.05) and not deadline.passed(1.94, early_s=0.05)
    # the as-if-sequential rule: an end within NO_TIME_S of the deadline is at it
    end = 2.0 - clock.NO_TIME_S / 2
    assert deadline.passed(end, early_s=clock.NO_TIME_S)
    assert (not deadline.passed(end, early_s=clock.NO_TIME_S)) == (end < 2.0 - clock.NO_TIME_S)


def test_earlier_within_and_plus_split_and_extend() -> None:
    emit = Deadline.at(10.0)
    call = Deadline.at(4.0)
    assert emit.earlier(call) is call and call.earlier(emit) is call
    assert emit.earlier(NEVER) is emit and NEVER.earlier(emit) is emit
    assert emit.within(2.0, 3.0) == Deadline.at(5.0)
    assert emit.within(20.0, 3.0) is emit and emit.within(None, 3.0) is emit
    # a grace past a call's budget, never past the emit's deadline
    assert call.plus(1.0).earlier(emit) == Deadline.at(5.0)
    assert call.plus(9.0).earlier(emit) is emit
    assert emit.cap(12.0) == 10.0 and emit.cap(3.0) == 3.0


def test_the_arithmetic_is_the_float_expressions_it_replaced() -> None:
    started, budget, now, extra = 1234.5678901, 0.05 * 1.5, 1234.6012345, 1.0 + 0.0375
    deadline = Deadline.after(budget, started)
    assert deadline.when == started + budget
    assert deadline.left(now) == max(0.0, (started + budget) - now)
    assert deadline.plus(extra).when == (started + budget) + extra
    for other in (started + 3.0, started - 3.0, math.inf):
        mine = Deadline.at(other).earlier(Deadline.at(started + budget)).when
        assert mine == min(other, started + budget)


def test_the_reported_time_left() -> None:
    """The repr reads the clock again, so the seconds it reports are those left when it is
    read: a busy machine may have taken some of them (a margin of a second, never 0)."""

    async def main() -> str:
        return repr(Deadline.after(2.0))

    left = re.fullmatch(r"Deadline\(([0-9.]+) s left\)", run_with_virtual_clock(main()))
    assert left is not None and 1.0 < float(left[1]) <= 2.0
    ago = re.fullmatch(r"Deadline\(expired ([0-9.]+) s ago\)", repr(Deadline.after(-1.0)))
    assert ago is not None and 1.0 <= float(ago[1]) < 2.0
    assert repr(NEVER) == "Deadline(never)"


def test_timeout_ends_a_block_at_the_deadline_on_the_loop_clock() -> None:
    async def main() -> tuple[bool, float, bool]:
        loop = asyncio.get_running_loop()
        deadline = Deadline.after(30.0)
        ended = False
        try:
            async with deadline.timeout():
                await asyncio.sleep(3600)
        except TimeoutError:
            ended = True
        async with NEVER.timeout():  # no deadline: the block runs to its end
            await asyncio.sleep(0.01)
        return ended, loop.time() - deadline.when, deadline.expired()

    ended, late, expired = run_with_virtual_clock(main())
    assert ended and expired
    assert 0.0 <= late < 1.0  # the loop's timer, on the (virtual) loop clock


def test_a_callers_deadline_bounds_the_store_and_a_nested_one_keeps_the_earlier() -> None:
    async def main() -> tuple[bool, float, float, float, bool, bool]:
        outside = caller_bound().unbounded and time_left(7.0) == 7.0
        with caller_deadline(2.0):
            first = time_left(30.0)
            with caller_deadline(5.0):  # the earlier of the two stays
                nested = time_left(30.0)
            with caller_deadline(5.0, extend=True):  # replaces it
                extended = time_left(30.0)
            await asyncio.sleep(3.0)
            passed = caller_bound().passed() and time_left(30.0) == 0.0
        return outside, first, nested, extended, passed, caller_bound().unbounded

    outside, first, nested, extended, passed, after = run_with_virtual_clock(main())
    assert outside and after and passed
    assert 1.9 < first <= 2.0 and 1.9 < nested <= 2.0 and 4.9 < extended <= 5.0
