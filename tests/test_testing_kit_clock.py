"""`hookbus.testing`'s virtual clock: time skips ahead while the loop only waits for a
timer, and runs as a real clock's does while something outside the loop may wake it (a
socket of its own, a thread it started, a `real_time` block). No server: the fast tier."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from hookbus.testing import VirtualClockLoop, run_with_virtual_clock, virtual_clock_loop


def loop() -> VirtualClockLoop:
    running = asyncio.get_running_loop()
    assert isinstance(running, VirtualClockLoop)
    return running


def test_an_hour_of_timers_passes_at_once_in_order() -> None:
    async def main() -> tuple[list[str], float]:
        woke: list[str] = []

        async def sleeper(name: str, seconds: float) -> None:
            await asyncio.sleep(seconds)
            woke.append(name)

        started = loop().time()
        async with asyncio.TaskGroup() as tasks:
            for name, seconds in [("hour", 3600.0), ("minute", 60.0), ("second", 1.0)]:
                tasks.create_task(sleeper(name, seconds))
        return woke, loop().time() - started

    real = time.monotonic()
    woke, on_clock = run_with_virtual_clock(main())
    assert woke == ["second", "minute", "hour"]
    assert on_clock >= 3600.0
    assert time.monotonic() - real < 1.0


def test_a_thread_the_loop_started_is_waited_for() -> None:
    """A function in `asyncio.to_thread` that takes 50 ms of real time finishes before a
    1 s timeout: the clock does not skip while it runs."""

    async def main() -> str:
        async with asyncio.timeout(1.0):
            return await asyncio.to_thread(lambda: time.sleep(0.05) or "done")

    assert run_with_virtual_clock(main()) == "done"


def test_real_time_and_an_open_socket_keep_the_clock_real() -> None:
    async def main() -> tuple[float, float]:
        real = time.monotonic()
        with loop().real_time():
            await asyncio.sleep(0.05)
        in_block = time.monotonic() - real
        left, right = socket.socketpair()
        try:
            loop().add_reader(left, lambda: None)  # a socket of the loop's own
            real = time.monotonic()
            await asyncio.sleep(0.05)
            with_socket = time.monotonic() - real
            loop().remove_reader(left)
        finally:
            left.close()
            right.close()
        return in_block, with_socket

    in_block, with_socket = run_with_virtual_clock(main())
    assert in_block >= 0.05 and with_socket >= 0.05


def test_the_clock_never_goes_back_and_the_factory_makes_fresh_loops() -> None:
    made = virtual_clock_loop()
    try:
        assert isinstance(made, VirtualClockLoop) and made.skipped_s == 0.0
        before = made.time()
        made.skip(-5.0)  # nothing
        made.skip(2.5)
        assert made.time() - before >= 2.5
    finally:
        made.close()


@pytest.mark.anyio
async def test_run_with_virtual_clock_refuses_a_running_loop() -> None:
    async def nothing() -> None:
        return None

    main = nothing()
    with pytest.raises(RuntimeError):
        run_with_virtual_clock(main)
    main.close()
