"""The fold's rules, written once: what a dispatcher's fold (`hookbus.dispatcher`'s
``Fold`` and ``RouteFolder``) and a worker running several handlers of one chain request
(``HookWorker``) both judge by. Pure functions, no I/O.

The semantics are amplifier-core's ``HookRegistry.emit``:

- grouping (`parallel_groups`): handlers run one after another, in order; an adjacent run
  of ``parallel`` handlers runs together, on the same data;
- chaining (`modifies`): a ``modify`` with data replaces the data the next handler sees
  (whole replacement); a ``modify`` without data changes nothing;
- stopping (`ends_fold`): the fold stops at a deny (short-circuit). hookbus adds that it
  stops at a failure under policy ``deny``, at a result that cannot be read (always denied:
  `failure_policy_applied`), and at a parallel handler's modify (refused: `refused_modify`,
  judged as a ``bad_reply``, so it denies).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal

from hookbus.schemas import Action, FailureKind, FailurePolicy, HookResult

__all__ = [
    "PARALLEL_MODIFY_MESSAGE",
    "StepOutcome",
    "ends_fold",
    "failure_policy_applied",
    "group_end",
    "modifies",
    "parallel_groups",
    "refused_modify",
    "widest_group",
]

StepOutcome = Action | Literal["failed", "unreadable"]
"""How one handler call ended, as the stop rule sees it: the action of its result,
``failed`` (timeout, no responders, an error) or ``unreadable`` (a result that cannot be
read)."""

PARALLEL_MODIFY_MESSAGE = "a parallel handler may not modify"
"""The message of the ``bad_reply`` failure a parallel handler's modify is folded as."""


def ends_fold(outcome: StepOutcome, *, parallel: bool, failure_policy: FailurePolicy) -> bool:
    """Whether the fold stops at a handler call that ended with `outcome` (so no later
    handler runs): a deny, a parallel handler's modify, an unreadable result, a failure
    under policy deny. Source: amplifier-core ``HookRegistry.emit`` (deny short-circuit)
    and hookbus's failure policies (`failure_policy_applied`)."""
    if outcome == "unreadable" or outcome == "deny":
        return True
    if outcome == "failed":
        return failure_policy == "deny"
    return refused_modify(outcome, parallel=parallel)


def failure_policy_applied(kind: FailureKind, policy: FailurePolicy) -> FailurePolicy:
    """The policy a handler's failure of `kind` is folded under: its own, except that a
    result that cannot be read (``bad_reply``) always denies, as amplifier-core denies an
    unparseable handler result."""
    return "deny" if kind == "bad_reply" else policy


def refused_modify(action: str, *, parallel: bool) -> bool:
    """Whether a result with `action` is refused because its handler is parallel (it ran
    on the same data as its neighbours: its modify cannot chain)."""
    return parallel and action == "modify"


def modifies(result: HookResult) -> bool:
    """Whether `result` replaces the data the next handler sees (a ``modify`` with data;
    its ``data`` is then the new data)."""
    return result.action == "modify" and result.data is not None


def group_end(parallel: Sequence[bool], i: int) -> int:
    """The end (exclusive) of the group of handlers starting at `i`, given each handler's
    ``parallel`` flag: ``i + 1`` for a sequential handler, the end of the adjacent run of
    parallel handlers for a parallel one."""
    j = i + 1
    if parallel[i]:
        while j < len(parallel) and parallel[j]:
            j += 1
    return j


def parallel_groups(parallel: Sequence[bool]) -> Iterator[tuple[int, int]]:
    """The groups of handlers called together, as ``(start, end)`` index ranges in order
    (see `group_end`). Lazy: a caller may judge each group (e.g. tool filters on the
    chained data) after folding the one before."""
    i = 0
    while i < len(parallel):
        j = group_end(parallel, i)
        yield i, j
        i = j


def widest_group(parallel: Sequence[bool]) -> int:
    """The most handlers called at once: the widest group (at least 1)."""
    return max((j - i for i, j in parallel_groups(parallel)), default=1)
