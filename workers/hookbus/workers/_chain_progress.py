"""What a worker tells the dispatcher while it runs a chain request: its progress replies.

A chain request runs several handlers in one process. Were its answers sent only at the
end, a process killed or paused mid-chain would take the answers of the steps that had
already run with it, and the dispatcher could not tell which step was running. So the
worker reports, on the request's reply subject, the replies so far whenever the chain may
wait on something, and names the steps running then:

- before a step that may wait (suspend: see `HookWorker._may_wait`) starts, the replies
  not yet reported go out (`report`), appended to the client's buffer before anything
  the step itself sends, so no fault while it runs can lose them (as a request of its
  own would have had its reply out already);
- after a member of a parallel group finishes while others run, a report is scheduled
  for the event loop's next turn (`loop.call_soon`); it goes out only if steps are still
  running then;
- a chain of handlers that return at once sends none: nothing can happen between its
  steps, and the final reply carries everything, so a fast chain still costs one message;
- a report is incremental (the replies finished since the last one); the final reply
  (`HookReply.running` None) lists every reply.

The dispatcher dates each running step from its report and gives up on it at its own
timeout, as it would on a request of its own; the steps after it it calls one by one. So a
worker must never start a step once the dispatcher may have given up on the chain
(`late`): after a pause (SIGSTOP, a starved event loop) the rest of the chain is left to
the dispatcher, and no handler runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors

from hookbus.schemas import ChainStep, HookReply

from ._coroutines import Resumed

__all__ = ["LATE_MARGIN_S", "ChainProgress"]

LATE_MARGIN_S = 0.05
"""Seconds before the dispatcher's earliest give-up at which a worker stops starting steps
(the dispatcher dates a first step from its send, the worker from its receipt)."""

_sending: set[asyncio.Future[None]] = set()


class ChainProgress:
    """The progress replies of one chain request.

    Args:
        name: the handler set's id (the `HookReply.handler` of a chain's replies).
        send: publishes one reply on the request's reply subject.
        received: `time.monotonic()` when the request arrived.
    """

    __slots__ = (
        "_closed",
        "_heard_at",
        "_name",
        "_running",
        "_scheduled",
        "_send",
        "_started",
        "_unreported",
        "_watch_deadline",
    )

    def __init__(
        self, name: str, send: Callable[[HookReply], Awaitable[None]], received: float
    ) -> None:
        self._name = name
        self._send = send
        self._unreported: list[HookReply] = []
        self._running: list[ChainStep] = []
        self._started = received
        self._scheduled = False
        self._closed = False
        self._heard_at = received
        """From when the dispatcher dates steps not reported running: the request's
        receipt (every report names steps running)."""
        self._watch_deadline: float | None = None
        """When the dispatcher may give up on the steps it waits for (None: set by the
        next `start`)."""

    def start(self, steps: list[ChainStep], now: float) -> None:
        """Steps `steps` (one, or a parallel group) start running at `now` (the list is
        kept as it is: give a list of its own)."""
        self._running = steps
        self._started = now
        if self._watch_deadline is None:  # not reported: dated from what it last heard
            self._watch_deadline = self._heard_at + _earliest(steps)

    def finished(self, step: ChainStep, reply: HookReply) -> None:
        """`step` finished with `reply`: reported before the next step that may wait
        (`report`), or, while other members of its parallel group run, at the loop's next
        turn."""
        self._unreported.append(reply)
        running = self._running
        if len(running) > 1:
            self._running = [s for s in running if s is not step]
            self._schedule()
        else:
            self._running = []

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def report(self) -> None:
        """Report the replies not yet reported now (appended to the client's buffer before
        anything the next step sends), naming the steps just started."""
        self._flush()

    def late(self, now: float) -> bool:
        """Whether starting another step at `now` could race the dispatcher's give-up on
        the chain: then the worker stops and the dispatcher calls the rest itself."""
        deadline = self._watch_deadline
        return deadline is not None and now >= deadline - LATE_MARGIN_S

    def close(self) -> None:
        """The chain is over (its final reply goes now): no more progress replies."""
        self._closed = True

    def _flush(self) -> None:
        self._scheduled = False
        if self._closed or not self._unreported or not self._running:
            return  # over, nothing new, or between steps: the next `start` schedules it
        now = time.monotonic()
        reply = HookReply(
            handler=self._name,
            chain=self._unreported,
            running=[s.handler for s in self._running],
            running_for_s=max(0.0, now - self._started),
        )
        self._unreported = []
        # the dispatcher now dates the running steps from this report
        self._watch_deadline = self._started + _earliest(self._running)
        _publish_now(self._publish(reply))

    async def _publish(self, reply: HookReply) -> None:
        with contextlib.suppress(nats.errors.Error, OSError):
            await self._send(reply)


def _publish_now(coro: Coroutine[Any, Any, None]) -> None:
    """Run a publish's coroutine up to its first suspension now, the rest in a task.

    Why not a task at once: a publish that needs no flush appends the message to the
    client's buffer without suspending, so it lands there before anything the next step
    publishes (this callback runs before the client's flusher, scheduled later); a task
    would run after the flusher, and a process killed in between would lose the report.
    """
    try:
        suspended_on = coro.send(None)
    except StopIteration:
        return
    except Exception:  # a closed connection: the final reply (or its absence) tells
        return
    task = asyncio.ensure_future(Resumed(coro, suspended_on))  # `_publish` suppresses errors
    _sending.add(task)  # held until sent (the loop keeps only weak references)
    task.add_done_callback(_sending.discard)


def _earliest(steps: list[ChainStep]) -> float:
    """The shortest timeout among `steps`, seconds (the dispatcher's first give-up)."""
    if len(steps) == 1:  # a sequential step: no generator
        return steps[0].timeout_s
    return min((s.timeout_s for s in steps), default=0.0)
