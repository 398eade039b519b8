"""How long a dispatcher waits on a chain request, and when its worker stops starting steps.

One rule, kept by both sides (the dispatcher's `ChainCall`, the worker's `ChainProgress`):
the process that runs a step times it (the worker cuts it at its timeout, and reports the
cut), so the dispatcher only needs to tell a live worker from a lost one. It waits on the
step the fold has reached:

- a step named running by a progress reply: from the first reply that named it (a later
  one cannot re-arm it), for its own timeout;
- a step not named: from the last message heard from the worker (or the send), for the
  timeouts of it and of every step after it, summed (the worker may be running any of
  them: one that computes without awaiting sends nothing meanwhile);

plus `GRACE_S`. Past that, the worker counts as lost: the step fails as ``timeout`` under
its own policy and the dispatcher calls the steps after it on their own. A worker never
starts a step once that may have happened: it dates the same waits on its own clock from
no later than the dispatcher does (its receipt of the request, or a stall's start, against
the send), and stops `LATE_MARGIN_S` before their end without the grace. The grace thus
covers the one-way delay of the worker's link: up to `GRACE_S` + `LATE_MARGIN_S` of it
cannot make a step run twice.
"""

from __future__ import annotations

from typing import Final

__all__ = ["GRACE_S", "LATE_MARGIN_S"]

GRACE_S: Final = 1.0
"""Seconds a dispatcher waits past a chain wait's end before it counts the worker lost; and
past a single call's budget, with its request unanswered (within the emit's deadline)."""

LATE_MARGIN_S: Final = 0.05
"""Seconds before a chain wait's end (without the grace) at which a worker stops starting
steps."""
