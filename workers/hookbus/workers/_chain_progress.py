"""What a worker tells the dispatcher while it runs a chain request: its progress replies.

A chain request runs several handlers in one process, and the process that runs a step
is the one that times it (each step within its own timeout: `HandlerCaller.invoke`). The
dispatcher waits for the chain's replies and gives up on it only when the worker may be
lost. So that it never gives up on a live worker's step, and never blames one step for
another's time, the worker reports, on the request's reply subject:

- the replies not yet reported, and the steps running, before a step that is likely to
  wait starts (one not yet seen to return at once, seen to wait, or sync:
  `HandlerCaller.may_wait`), appended to the client's buffer ahead of anything the step
  sends, so no fault while it runs can lose them (as a request of its own would have had
  its reply out already); and, for a step that waits against that guess, the moment it
  really waits (its coroutine suspends), before the loop runs anything else;
- the reply of a step that was reported running, as soon as it ends, before the next
  step starts (and the loop is given one turn to write it: a next step that computes
  without awaiting would otherwise hold it in the client's buffer);
- after a member of a parallel group finishes while others run, a report at the event
  loop's next turn (`loop.call_soon`), if steps still run then;
- nothing else: a chain of handlers that return at once (or compute without awaiting)
  costs one message, the final reply (`HookReply.running` None), which lists every reply.

How long the dispatcher waits, and so when a worker stops starting steps (`late`): see
`hookbus._core.chain_timing`. After a pause (SIGSTOP, a starved event loop, a request read
long after it came: see `LoopStalls`) the rest of the chain is left to the dispatcher, and
no handler runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors

from hookbus._core.chain_timing import LATE_MARGIN_S
from hookbus._core.deadlines import Deadline
from hookbus.schemas import ChainStep, HookReply

from ._coroutines import Resumed

__all__ = ["ChainProgress"]

_sending: set[asyncio.Future[None]] = set()


class ChainProgress:
    """The progress replies of one chain request.

    Args:
        name: the handler set's id (the `HookReply.handler` of a chain's replies).
        send: publishes one reply on the request's reply subject.
        received: `time.monotonic()` from which the request is dated (its receipt, or
            earlier: `LoopStalls.dated`).
        total_s: the sum of the chain's step timeouts, seconds.
    """

    __slots__ = (
        "_closed",
        "_give_up",
        "_name",
        "_named",
        "_rest_s",
        "_running",
        "_scheduled",
        "_send",
        "_started",
        "_unreported",
    )

    def __init__(
        self,
        name: str,
        send: Callable[[HookReply], Awaitable[None]],
        received: float,
        total_s: float,
    ) -> None:
        self._name = name
        self._send = send
        self._unreported: list[HookReply] = []
        self._running: list[ChainStep] = []
        self._started = received
        self._rest_s = total_s
        self._scheduled = False
        self._closed = False
        self._named = False
        """The running steps were named in a report (their replies go out as they end)."""
        self._give_up = Deadline.after(total_s, received)
        """When the dispatcher may give up (its grace aside), dated on this clock: no
        report yet, so from the request for every step's timeout."""

    def start(self, steps: list[ChainStep], now: float, rest_s: float) -> None:
        """Steps `steps` (one, or a parallel group) start running at `now` (the list is
        kept as it is: give a list of its own); `rest_s`: the timeouts of the steps after
        them, summed."""
        self._running = steps
        self._started = now
        self._rest_s = rest_s
        self._named = False

    def suspended(self) -> None:
        """A running step waits on something now: report the replies not yet reported,
        naming the running steps (nothing to report: nothing sent, the dispatcher's
        dating of them from its last news still holds)."""
        if self._unreported and not self._named:
            self._flush()

    def finished(self, step: ChainStep, reply: HookReply) -> None:
        """`step` finished with `reply`: reported before the next step if it was named
        running (`settle`), while other members of its parallel group run at the loop's
        next turn, else with the next report or the final reply."""
        self._unreported.append(reply)
        running = self._running
        if len(running) > 1:
            self._running = [s for s in running if s is not step]
            self._schedule()
        else:
            self._running = []

    def settle(self) -> bool:
        """Between steps: report the replies of steps that were named running (the
        dispatcher times those from their report). Returns whether a report went out (the
        caller then yields once, so that the client writes it before the next step)."""
        if not self._named or not self._unreported or self._closed:
            return False
        self._named = False
        now = time.monotonic()
        reply = HookReply(handler=self._name, chain=self._unreported, running=[])
        self._unreported = []
        self._give_up = Deadline.after(self._rest_s, now)  # the next steps, from this report
        _publish_now(self._publish(reply))
        return True

    def _schedule(self) -> None:
        if not self._scheduled and not self._closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def late(self, now: float) -> bool:
        """Whether starting another step at `now` could race the dispatcher's give-up on
        the chain: then the worker stops and the dispatcher calls the rest itself."""
        return self._give_up.passed(now, early_s=LATE_MARGIN_S)

    def close(self) -> None:
        """The chain is over (its final reply goes now): no more progress replies."""
        self._closed = True

    def _flush(self) -> None:
        self._scheduled = False
        if self._closed or not self._unreported or not self._running:
            return  # over, nothing new, or between steps
        now = time.monotonic()
        reply = HookReply(
            handler=self._name,
            chain=self._unreported,
            running=[s.handler for s in self._running],
            running_for_s=max(0.0, now - self._started),
        )
        self._unreported = []
        self._named = True
        # the dispatcher has every earlier reply: it now waits on the running steps only,
        # each dated from its start for its own timeout (a later report cannot move that)
        self._give_up = Deadline.after(_earliest(self._running), self._started)
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
