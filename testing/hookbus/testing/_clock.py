"""A virtual clock for tests: an asyncio event loop whose time skips ahead while the loop
has nothing to do (`virtual_clock_loop`, `run_with_virtual_clock`).

The shape of temporalio's time-skipping test environment: time advances when everything
is waiting. Every timer of hookbus (a handler's timeout, an approval's ``approval_timeout``,
a suspension's ``timeout_s``, an emit's deadline) runs on the running loop's clock
(`hookbus._core.clock`), so on this loop a 30 s approval timeout fires as soon as nothing
else can happen first, in a few milliseconds of real time, and always after everything
that was due before it: the order of events is the order of their times, however busy
the machine is.

The loop skips only when nothing outside it can wake it:

- while a socket of its own is registered (a nats-py connection to a real server), its
  time runs as a real clock's does: a reply in flight is never overtaken by a skip;
- while a function runs in a thread started through it (`run_in_executor`,
  `asyncio.to_thread`: how the kit runs sync handlers), likewise;
- within `VirtualClockLoop.real_time` (a wait on something it cannot see), likewise;
- with nothing scheduled at all (a wait without a timeout), it waits as any loop does.

Its time is the real monotonic clock plus every skip made so far, so it never goes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any, TypeVar

__all__ = ["VirtualClockLoop", "run_with_virtual_clock", "virtual_clock_loop"]

T = TypeVar("T")


class _SkippingSelector(selectors.BaseSelector):
    """The loop's selector: a real one, except that a wait with a timeout and nothing
    outside the loop to wait for returns at once, the clock moved to its end."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self._loop: VirtualClockLoop | None = None
        self._own_keys = 0
        """Keys registered when the loop was made (its self-pipe): they never count as
        something outside to wait for."""

    def bind(self, loop: VirtualClockLoop) -> None:
        self._loop = loop
        self._own_keys = len(self._real.get_map())

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self._loop
        if loop is None or timeout is None or timeout <= 0 or self._outside(loop):
            return self._real.select(timeout)
        ready = self._real.select(0)
        if not ready:
            loop.skip(timeout)
        return ready

    def _outside(self, loop: VirtualClockLoop) -> bool:
        """Whether something outside the loop may wake it: a thread it started, or a
        socket of its own."""
        return loop.threads_running > 0 or len(self._real.get_map()) > self._own_keys


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An asyncio event loop with a virtual clock (see the module docstring).

    `time` is the real monotonic clock plus `skipped_s`; `skip` moves it forward.
    Make one with `virtual_clock_loop` (a loop factory: ``asyncio.Runner(loop_factory=...)``,
    anyio's ``("asyncio", {"loop_factory": virtual_clock_loop})`` backend).
    """

    def __init__(self) -> None:
        selector = _SkippingSelector()
        super().__init__(selector)
        selector.bind(self)
        self.skipped_s = 0.0
        """Seconds the clock has skipped ahead of the real monotonic clock so far."""
        self.threads_running = 0
        """Functions running in threads started through `run_in_executor` (no skip while
        one runs: its result may come at any moment)."""

    def time(self) -> float:
        """Seconds on this loop's clock: `time.monotonic()` plus `skipped_s`."""
        return time.monotonic() + self.skipped_s

    def skip(self, seconds: float) -> None:
        """Move the clock `seconds` ahead (negative or zero: nothing)."""
        if seconds > 0:
            self.skipped_s += seconds

    @contextlib.contextmanager
    def real_time(self) -> Iterator[None]:
        """Within the block, time runs as a real clock's does (temporalio's
        ``auto_time_skipping_disabled``): for a wait on something the loop cannot see,
        e.g. a thread started by anyio's ``to_thread``."""
        self.threads_running += 1
        try:
            yield
        finally:
            self.threads_running -= 1

    def run_in_executor(
        self, executor: Executor | None, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        """As `asyncio.loop.run_in_executor`; the clock does not skip while `func` runs."""
        self.threads_running += 1
        try:
            future = super().run_in_executor(executor, func, *args)
        except BaseException:
            self.threads_running -= 1
            raise
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: asyncio.Future[Any]) -> None:
        self.threads_running -= 1

    async def shutdown_default_executor(self, *args: Any, **kwargs: Any) -> None:
        """As asyncio's, in real time: on Python 3.12+ `asyncio.Runner.close` bounds the
        join of the executor's threads with a timeout (300 s), which a skip would end at
        once (a ``TimeoutError`` from closing the loop)."""
        with self.real_time():
            await super().shutdown_default_executor(*args, **kwargs)


def virtual_clock_loop() -> VirtualClockLoop:
    """A new event loop with a virtual clock (a loop factory)."""
    return VirtualClockLoop()


def run_with_virtual_clock(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to its end on a new `VirtualClockLoop` and close it: `asyncio.run` with
    a virtual clock. Returns what `main` returns.

    Raises:
        RuntimeError: called from a running event loop (as `asyncio.run` raises).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise RuntimeError("run_with_virtual_clock cannot be called from a running event loop")
    with asyncio.Runner(loop_factory=virtual_clock_loop) as runner:
        return runner.run(main)
