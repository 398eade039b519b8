"""The expiry sweep: a dispatcher service ends approvals nobody waits for.

An approval whose asker is gone (a caller's deadline, a stopped emit, a crashed
dispatcher) is ended past its ``timeout_s`` plus `EXPIRY_MARGIN_S`, by the server's clock,
by whoever next reads it and may write the record (see `hookbus.dispatcher._approvals`).
With nobody reading it, it would stay pending on every console; the dispatcher service,
which may write approval records, reads them every `EXPIRY_SWEEP_S` seconds (each pause
drawn within `EXPIRY_SWEEP_JITTER` of it, so replicas do not sweep in step) and ends the
overdue ones (`ApprovalsClient.end_overdue`): a proven answer or cancel decides, else the
default is applied. Replicas sweeping at once are safe: every close is a compare-and-set.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
import nats.js.errors

from hookbus._core.tasks import stop_task
from hookbus.schemas import HookbusError

__all__ = ["EXPIRY_SWEEP_JITTER", "EXPIRY_SWEEP_S", "ExpirySweep"]

log = logging.getLogger("hookbus.dispatcher")

EXPIRY_SWEEP_S = 15.0
"""Seconds between two sweeps of a dispatcher service, on average."""

EXPIRY_SWEEP_JITTER = 0.2
"""Each pause is `EXPIRY_SWEEP_S` times a factor drawn in [1 - this, 1 + this]."""


class ExpirySweep:
    """Call `end` (which ends the overdue approvals and returns those it ended) every
    `interval_s` seconds, jittered, from `start` until `stop`. A failed sweep is logged
    (a warning) and the next one runs as planned.

    Args:
        end: one sweep, e.g. ``ApprovalsClient.end_overdue``.
        interval_s: mean seconds between sweeps (> 0).
    Raises:
        ValueError: `interval_s` is not positive.
    """

    def __init__(
        self, end: Callable[[], Awaitable[list[Any]]], *, interval_s: float = EXPIRY_SWEEP_S
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the expiry sweep's interval must be positive, not {interval_s}")
        self._end = end
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sweeping (idempotent); the first sweep comes after one pause."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="approvals expiry sweep"
            )

    async def stop(self) -> None:
        """Stop sweeping (idempotent); a sweep in progress is cancelled (its closes are
        compare-and-sets: one cut short leaves the record pending, for the next reader)."""
        task, self._task = self._task, None
        await stop_task(task, "the approvals expiry sweep")

    async def sweep(self) -> int:
        """One sweep now: the number of approvals ended; never raises for a store error
        (logged)."""
        try:
            ended = await self._end()
        except (HookbusError, nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("approvals expiry sweep failed (%r); trying again later", exc)
            return 0
        if ended:
            log.info("approvals expiry sweep ended %d approval(s) nobody waited for", len(ended))
        return len(ended)

    async def _run(self) -> None:
        while True:
            factor = random.uniform(1 - EXPIRY_SWEEP_JITTER, 1 + EXPIRY_SWEEP_JITTER)
            await asyncio.sleep(self._interval_s * factor)
            await self.sweep()
