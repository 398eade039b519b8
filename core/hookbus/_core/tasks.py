"""Starting tasks eagerly where Python can, and stopping a background task for good.

`start_task` runs a coroutine's first step at once in a task of its own on Python 3.12
and later (`asyncio.eager_task_factory`): a handler that returns without awaiting is over
before the call returns, with no turn of the event loop in between; on 3.11 the task is
scheduled, as `loop.create_task` does. `gather_tasks` is `asyncio.gather` over such tasks.

On Python 3.11 the `asyncio.wait_for` inside nats-py's requests (KV reads, consumer info)
can swallow a cancel: a task cancelled once while it waits on one may carry on, and
awaiting it then never returns. `stop_task` cancels until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, Final, TypeVar

__all__ = ["gather_tasks", "start_task", "stop_task"]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

_eager_task: Final = getattr(asyncio, "eager_task_factory", None)
"""`asyncio.eager_task_factory` (Python 3.12+), else None."""


def start_task(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    """A task of its own running `coro` on `loop` (the running loop), its first step taken
    now on Python 3.12+ (`asyncio.eager_task_factory`: ``asyncio.current_task()`` is the new
    task during it, and the task may be done on return), else scheduled
    (``loop.create_task``). Its context is a copy of the caller's, as for any task."""
    if _eager_task is not None:
        return _eager_task(loop, coro)  # type: ignore[no-any-return]
    return loop.create_task(coro)


async def gather_tasks(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of `coros` in order, run concurrently, each in a task of its own
    (`start_task`: its own context; on Python 3.12+ its first step taken at once), as
    ``asyncio.gather(*coros)`` gives them: the first exception raised (the other tasks go
    on), a cancel passed to every task still running. When every task was over in its
    first step (3.12+), no gather and no turn of the event loop."""
    loop = asyncio.get_running_loop()
    tasks = [start_task(loop, coro) for coro in coros]
    if all(t.done() and not t.cancelled() and t.exception() is None for t in tasks):
        return [t.result() for t in tasks]
    return list(await asyncio.gather(*tasks))


async def stop_task(task: asyncio.Task[None] | None, what: str) -> None:
    """Cancel `task` again every 0.1 s until it has ended (a swallowed cancel lands on the
    next await), without swallowing the caller's own cancellation; a task that ended with
    an error is logged as `what` ended with it. None: nothing to do."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and task.exception() is not None:
        log.warning("%s ended with %r", what, task.exception())
