"""A worker's handlers of one event run as one chain, in this process, and folded
(`run_chain`): what a worker serving a chain request runs and a dispatcher folds, with
the network taken out.

The rules are the ones both sides of the bus judge by, never a copy of them: the order and
the groups of parallel handlers, where the fold stops and which modify chains come from
the kernel's fold rules (`hookbus._core.fold_rules`); the folding itself (deny
short-circuit, whole-data modify, context merging, the first ``ask_user``, failure
policies) is the dispatcher's `Fold`; what a handler returned becomes a result as a worker
reads it (`hookbus._core.results`), and each handler gets a JSON copy of the data of its
own (`hookbus._core.copies`). A failure is folded as a dispatcher folds a worker's error
reply: kind ``timeout`` (``handler_timeout: ran past 5s``), ``error``
(``handler_error: <Type>: <text>``) or ``bad_reply`` (``bad_result: ...``, always denied).

Timeouts run on the event loop's clock: on a `VirtualClockLoop` a handler that waits past
its ``timeout_s`` is cut at once, in no real time.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from typing import Any

from hookbus._core import clock
from hookbus._core.copies import json_copy
from hookbus._core.deadlines import NEVER, Deadline
from hookbus._core.fold_rules import (
    PARALLEL_MODIFY_MESSAGE,
    ends_fold,
    parallel_groups,
    refused_modify,
)
from hookbus._core.results import to_hook_result
from hookbus.dispatcher import Fold
from hookbus.schemas import HookbusError, HookResult
from hookbus.workers import HandlerSpec

__all__ = ["ordered", "run_chain"]


def ordered(specs: Sequence[HandlerSpec], event: str) -> list[HandlerSpec]:
    """The handlers of `event` among `specs`, in call order: priority, then name (the
    order every dispatcher's routing table keeps)."""
    mine = [s for s in specs if s.declaration.event == event]
    return sorted(mine, key=lambda s: (s.declaration.priority, s.declaration.name))


async def run_chain(
    chain: Sequence[HandlerSpec], event: str, fold: Fold, *, deadline: Deadline = NEVER
) -> HookResult | None:
    """Run `chain` (handlers of `event` in call order, see `ordered`) on ``fold.data``,
    folding each outcome into `fold`. Returns the final result when one ended the fold (a
    deny, a failure under policy deny, a result that cannot be read), else None (the
    caller takes ``fold.result()``).

    A handler whose tool filter does not admit the data as it is when its turn comes is
    skipped; an adjacent run of ``parallel`` handlers is called at once on the same data
    and folded in order. Each call runs at most its ``timeout_s`` and never past
    `deadline` (on the loop's clock; `NEVER`: none).
    """
    parallel = [s.declaration.parallel for s in chain]
    for start, end in parallel_groups(parallel):
        group = [s for s in chain[start:end] if s.matches(fold.data)]
        if not group:
            continue
        data = fold.data
        outcomes = await asyncio.gather(*(_call(s, event, data, deadline) for s in group))
        for spec, outcome in zip(group, outcomes, strict=True):
            denied, stop = _fold(fold, spec, outcome)
            if denied is not None:
                return denied
            if stop:
                return None
    return None


def _fold(
    fold: Fold, spec: HandlerSpec, outcome: HookResult | tuple[str, str]
) -> tuple[HookResult | None, bool]:
    """Fold one outcome: (the final result if it ended the fold, whether the chain stops)."""
    decl = spec.declaration
    policy = decl.failure_policy
    if isinstance(outcome, HookResult):
        if refused_modify(outcome.action, parallel=decl.parallel):
            return fold.fail(decl.name, "bad_reply", policy, PARALLEL_MODIFY_MESSAGE), True
        denied = fold.apply(decl.name, outcome)
        return denied, ends_fold(outcome.action, parallel=decl.parallel, failure_policy=policy)
    kind, message = outcome
    denied = fold.fail(decl.name, kind, policy, message)  # type: ignore[arg-type]
    unreadable = "unreadable" if kind == "bad_reply" else "failed"
    return denied, ends_fold(unreadable, parallel=decl.parallel, failure_policy=policy)


async def _call(
    spec: HandlerSpec, event: str, data: dict[str, Any], deadline: Deadline
) -> HookResult | tuple[str, str]:
    """One handler call on a copy of `data`: its result, or ``(kind, message)`` of its
    failure as a dispatcher reads a worker's error reply."""
    decl = spec.declaration
    timeout_s = decl.timeout_s
    if not deadline.unbounded:
        timeout_s = deadline.cut(timeout_s)
        if clock.no_time_left(timeout_s):
            return "timeout", "not called: the emit's deadline had passed"
    try:
        async with asyncio.timeout(timeout_s):
            if spec.is_async:
                raw = await spec.fn(event, json_copy(data))
            else:  # in a thread, as a worker runs it (the virtual clock waits for it)
                raw = await asyncio.to_thread(spec.fn, event, json_copy(data))
            if inspect.isawaitable(raw):
                raw = await raw
    except TimeoutError:
        return "timeout", f"handler_timeout: ran past {timeout_s:.3g}s"
    except Exception as exc:
        return "error", f"handler_error: {type(exc).__name__}: {exc}"
    try:
        return to_hook_result(raw)
    except HookbusError as exc:
        return "bad_reply", f"bad_result: {exc}"
