"""Stopping a background task for good.

On Python 3.11 the `asyncio.wait_for` inside nats-py's requests (KV reads, consumer info)
can swallow a cancel: a task cancelled once while it waits on one may carry on, and
awaiting it then never returns. `stop_task` cancels until the task has ended.
"""

from __future__ import annotations

import asyncio
import logging

__all__ = ["stop_task"]

log = logging.getLogger("hookbus.dispatcher")


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
