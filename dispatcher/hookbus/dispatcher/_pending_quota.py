"""The pending-approvals quota of one dispatcher: at most `max_pending` approvals pending per
agent, counted without one bucket scan per question.

An agent asking many questions at once (a flood of emits whose handler answers
``ask_user``) must neither get past the quota by racing it (every question counting the
bucket before any record is written) nor make the dispatcher scan the agent's keys once per
question (each scan a consumer and a pass over the keys, on the event loop that serves every
other agent). So:

- the approvals this process is asking for an agent are counted in memory, reserved before
  the first ``await`` of the check, so concurrent questions see each other;
- the agent's pending records in the bucket (other replicas' too) are counted by one scan
  shared by every question asked meanwhile, and reused for `rescan_s` seconds;
- a question is admitted when both counts leave room: ``max(scanned, asking) < max_pending``
  before it. A record written by another replica in the last `rescan_s` seconds can let a
  question more through; nothing lets more than `max_pending` through from one process.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Final

__all__ = ["PendingQuota"]

RESCAN_S: Final = 1.0
"""Seconds a count of an agent's pending records is reused."""


class PendingQuota:
    """Admits an agent's new approvals up to `max_pending` (see the module docstring).

    Args:
        max_pending: pending approvals one agent may have at once.
        count: ``count(agent_id)``: the agent's live pending approval records in the bucket
            (raising: not counted, the in-memory count alone decides).
        rescan_s: seconds a count is reused.
    """

    def __init__(
        self,
        max_pending: int,
        count: Callable[[str | None], Awaitable[int]],
        *,
        rescan_s: float = RESCAN_S,
    ) -> None:
        self.max_pending = max_pending
        self._count = count
        self._rescan_s = rescan_s
        self._asking: dict[str | None, int] = {}
        self._counted: dict[str | None, tuple[int, float]] = {}
        self._counting: dict[str | None, asyncio.Future[int]] = {}

    async def admit(self, agent_id: str | None) -> int | None:
        """Reserve room for one more approval of `agent_id`: None when admitted (call
        `release` once its wait ends), else the pending count that refuses it."""
        asking = self._asking.get(agent_id, 0)
        if asking >= self.max_pending:
            return asking
        self._asking[agent_id] = asking + 1  # before any await: concurrent askers see it
        try:
            counted = await self._pending(agent_id)
        except Exception:
            counted = 0
        if counted >= self.max_pending:
            self.release(agent_id)
            return counted
        return None

    def release(self, agent_id: str | None) -> None:
        """The approval admitted for `agent_id` no longer waits in this process."""
        left = self._asking.get(agent_id, 0) - 1
        if left > 0:
            self._asking[agent_id] = left
        else:
            self._asking.pop(agent_id, None)

    async def _pending(self, agent_id: str | None) -> int:
        now = time.monotonic()
        counted = self._counted.get(agent_id)
        if counted is not None and now - counted[1] < self._rescan_s:
            return counted[0]
        running = self._counting.get(agent_id)
        if running is None:
            running = asyncio.ensure_future(self._count(agent_id))
            self._counting[agent_id] = running
            running.add_done_callback(lambda f: self._done(agent_id, f))
        return await asyncio.shield(running)

    def _done(self, agent_id: str | None, future: asyncio.Future[int]) -> None:
        self._counting.pop(agent_id, None)
        if not future.cancelled() and future.exception() is None:
            self._counted[agent_id] = (future.result(), time.monotonic())
            if len(self._counted) > 4096:  # forget the oldest counts of a crowd of agents
                for key in list(self._counted)[:1024]:
                    del self._counted[key]
