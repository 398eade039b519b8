"""How an emit calls and folds its handlers: the plan of each routing snapshot and the four
ways to call a segment of it (one by one, an adjacent parallel group together, a chain
request to one worker process, a run of pure handlers at once), all folding the same
outcomes in the same order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

from hookbus._core import clock
from hookbus._core.deadlines import Deadline
from hookbus._core.fold_rules import (
    PARALLEL_MODIFY_MESSAGE,
    failure_policy_applied,
    group_end,
    parallel_groups,
    refused_modify,
)
from hookbus._core.tasks import gather_tasks
from hookbus.schemas import HookResult

from ._call_router import EmitContext, Router
from ._fold import Fold
from ._outcomes import Failed, Outcome
from ._route_table import Route
from ._telemetry import start_chain_span, traced_call

__all__ = ["Call", "RouteFolder"]

Call = Callable[[Route, EmitContext, dict[str, Any]], Awaitable[Outcome]]
"""One handler call of an emit: ``call(route, ctx, data)`` appends the handler's name to
``ctx.called`` and gives its outcome (never raises for the handler's failures)."""

_CallGroup = Callable[[list[Route], EmitContext, dict[str, Any]], Awaitable[list[Outcome]]]
"""How `_fold_each` gets the outcomes of a group of handlers called on the same data."""

log = logging.getLogger("hookbus.dispatcher")


class RouteFolder:
    """Calls an emit's routes and folds their outcomes (`fold_routes`).

    Args:
        router: calls remote handlers and chains (and in-process ones).
        call: one handler call (the dispatcher's traced call, see `Call`).
        chains: send a sequence of adjacent remote handlers served by one worker process
            as one chain request (one round trip); False: one request per handler.
    """

    def __init__(self, router: Router, call: Call, *, chains: bool = True) -> None:
        self._router = router
        self._call = call
        self.chains = chains
        """Whether adjacent remote handlers of one worker process go as one chain request."""
        self._plans: dict[
            tuple[tuple[Route, ...], bool], tuple[tuple[str, tuple[Route, ...]], ...]
        ] = {}

    async def _call_group(
        self, group: list[Route], ctx: EmitContext, data: dict[str, Any]
    ) -> list[Outcome]:
        """Call a group of handlers on the same data: one handler, or a parallel group,
        each on its own subject (a reply is bound to the handler whose subject it
        answers)."""
        if len(group) == 1:
            return [await self._call(group[0], ctx, data)]
        return await self._call_each(group, ctx, data)

    async def _call_each(
        self, group: list[Route], ctx: EmitContext, data: dict[str, Any]
    ) -> list[Outcome]:
        # asyncio.gather's semantics (a third of an anyio task group's cost here), each
        # call's request sent in this turn of the loop on 3.12+; `_call` returns failures
        # as outcomes, so only caller errors (closed connection) propagate.
        return await gather_tasks(self._call(r, ctx, data) for r in group)

    async def fold_routes(
        self, routes: tuple[Route, ...], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Call and fold `routes` in order; the final result if one ended the fold.

        Three ways to call, all folding the same outcomes in the same order:
        a sequence of adjacent remote handlers of one worker process's handler set goes as one
        chain request (`_fold_chain`); a sequence of adjacent pure handlers is called at once,
        speculatively (`_fold_speculative`); the rest one by one, an adjacent sequence of
        parallel handlers concurrently (`_fold_each`).
        """
        for kind, seg in self._plan(routes):
            if kind == "one":
                route = seg[0]
                if not route.matches(fold.data):
                    continue
                denied = self._fold_one(fold, route, await self._call(route, ctx, fold.data))
            elif kind == "chain":
                denied = await self._fold_chain(seg, ctx, fold)
            elif kind == "pure":
                denied = await self._fold_speculative(seg, ctx, fold)
            else:  # a sequence of parallel handlers
                denied = await self._fold_each(seg, ctx, fold, self._call_group)
            if denied is not None:
                return denied
        return None

    def _plan(self, routes: tuple[Route, ...]) -> tuple[tuple[str, tuple[Route, ...]], ...]:
        """How `fold_routes` calls `routes`: segments ``("one" | "chain" | "pure" |
        "parallel", routes)`` in call order. Made once per routing snapshot (the table
        hands out the same tuple until the routes change)."""
        key = (routes, self.chains)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        segments: list[tuple[str, tuple[Route, ...]]] = []
        parallel = [r.parallel for r in routes]
        i, n = 0, len(routes)
        while i < n:
            route = routes[i]
            j = i + 1
            if self.chains and route.chain:
                # one chain: the same process's handlers, all retry_safe or none (a chain
                # is hedged only when every step may run twice)
                while (
                    j < n
                    and routes[j].chain == route.chain
                    and routes[j].retry_safe == route.retry_safe
                    and routes[j].name in route.handler_set
                ):
                    j += 1
                j = _whole_parallel_runs(routes, i, j)
                if j - i > 1:
                    segments.append(("chain", routes[i:j]))
                    i = j
                    continue
                j = i + 1
            if route.parallel:  # called together anyway: no speculation needed
                j = group_end(parallel, i)
                segments.append(("parallel", routes[i:j]))
            elif route.pure:
                while j < n and routes[j].pure and not routes[j].parallel:
                    j += 1
                segments.append(("pure" if j - i > 1 else "one", routes[i:j]))
            else:
                segments.append(("one", routes[i:j]))
            i = j
        if len(self._plans) >= 1024:  # stale snapshots: start over
            self._plans.clear()
        plan = self._plans[key] = tuple(segments)
        return plan

    async def _fold_each(
        self, routes: Sequence[Route], ctx: EmitContext, fold: Fold, call: _CallGroup
    ) -> HookResult | None:
        """Call and fold `routes` in amplifier-core's order (see `_groups`); `call` gives
        the outcomes of a group called on the same data."""
        for group in _groups(routes, fold):
            for route, outcome in zip(group, await call(group, ctx, fold.data), strict=True):
                denied = self._fold_one(fold, route, outcome)
                if denied is not None:
                    return denied
        return None

    async def _fold_chain(
        self, seg: tuple[Route, ...], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Fold `seg` from one chain request to its worker process: the same outcomes, in
        the same order, as one request per handler would give, whatever happens to the
        process (see `_chain_calls`). Steps the chain did not run are called alone within
        what is left of the emit's deadline; if nothing matches the data, nothing is sent.
        """
        seg = _from_first_match(seg, fold.data)
        if len(seg) < 2:
            return await self._fold_each(seg, ctx, fold, self._call_group)
        span = start_chain_span(seg)  # one message: one send span, the steps its children
        try:
            chain = await self._router.call_chain(seg, ctx, fold.data, span.headers)
        except BaseException as exc:
            span.end(exc)
            raise
        if isinstance(chain, Failed):  # nothing sent: no span, each call makes its own
            span.drop()
            return await self._fold_each(seg, ctx, fold, self._call_group)
        try:
            for group in _groups(seg, fold):
                outcomes = chain.answered(group)  # the common case: the replies are in
                if outcomes is None:
                    data = fold.data
                    outcomes = await chain.outcomes(
                        group,
                        lambda r: self._hedge(r, ctx, data),  # noqa: B023 (awaited here)
                    )
                called: dict[Route, Outcome] = {}
                if any(o is None for o in outcomes):  # not run by the chain: called alone
                    alone = [r for r, o in zip(group, outcomes, strict=True) if o is None]
                    outs = await self._call_group(alone, ctx, fold.data)
                    called = dict(zip(alone, outs, strict=True))
                for route, outcome in zip(group, outcomes, strict=True):
                    if outcome is None:
                        outcome = called[route]
                    else:
                        ctx.called.append(route.name)
                        span.step(route, outcome)
                    denied = self._fold_one(fold, route, outcome)
                    if denied is not None:
                        return denied
        finally:
            chain.close()
            span.delivered(chain.requests, chain.instance)
            span.end()
        return None

    @traced_call
    def _hedge(self, route: Route, ctx: EmitContext, data: dict[str, Any]) -> Awaitable[Outcome]:
        """A chain step asked on its own while the chain is slow (hedged): a ``send`` span
        of its own (the trace shows the second message and who answered it); not added to
        ``ctx.called``, where the fold records the step once, whichever answer it used."""
        return self._router.call(route, ctx, data)

    async def _fold_speculative(
        self, run: Sequence[Route], ctx: EmitContext, fold: Fold
    ) -> HookResult | None:
        """Call a sequence of pure handlers at once on the current data and fold their
        results in priority order as each arrives; the decision is the one calling them
        one by one gives (the reference).

        A deny (or a failure that ends the fold) returns at once. A modify replaces the
        data: every later handler's call, made on the stale data, is dropped (cancelled;
        an in-process handler gets the cancellation) and the rest of the run is called
        again at once on the new data. Each result is judged as if its call had started
        when the one before it ended (`_as_if_sequential`): a call the emit's deadline
        would have cut, called one by one, is a ``timeout`` here too.
        """
        next_start = clock.now()  # when the next handler would start, called one by one
        k = 0
        while k < len(run):
            data = fold.data
            launched = clock.now()
            calls = {
                r: asyncio.ensure_future(self._timed_call(r, ctx, data))
                for r in run[k:]
                if r.matches(data)
            }
            try:
                for idx in range(k, len(run)):
                    route = run[idx]
                    call = calls.get(route)
                    if call is None:  # its tool filter does not admit this data
                        continue
                    outcome, ended = await call
                    outcome, next_start = _as_if_sequential(
                        outcome, next_start, ended - launched, ctx.deadline
                    )
                    denied = self._fold_one(fold, route, outcome)
                    if denied is not None:
                        return denied
                    if fold.data is not data:  # modified: the later calls saw stale data
                        k = idx + 1
                        break
                else:
                    return None
            finally:
                _drop(calls.values())
        return None

    async def _timed_call(
        self, route: Route, ctx: EmitContext, data: dict[str, Any]
    ) -> tuple[Outcome, float]:
        """`_call`'s outcome and when it came (`clock.now()` seconds)."""
        outcome = await self._call(route, ctx, data)
        return outcome, clock.now()

    @staticmethod
    def _fold_one(fold: Fold, route: Route, outcome: Outcome) -> HookResult | None:
        if isinstance(outcome, Failed):
            log.warning(
                "handler %r failed (%s, policy %s): %s",
                route.name,
                outcome.kind,
                failure_policy_applied(outcome.kind, route.failure_policy),
                outcome.message,
            )
            return fold.fail(route.name, outcome.kind, route.failure_policy, outcome.message)
        if refused_modify(outcome.action, parallel=route.parallel):
            return fold.fail(route.name, "bad_reply", route.failure_policy, PARALLEL_MODIFY_MESSAGE)
        return fold.apply(route.name, outcome)


def _groups(routes: Sequence[Route], fold: Fold) -> Iterator[list[Route]]:
    """amplifier-core's order, as groups to call on the same data: each handler whose
    tool filter matches the data it would see, alone; an adjacent sequence of parallel handlers
    together (those matching the data at the run's start). Lazy: each group is formed
    after the previous one was folded, on the data it left (`parallel_groups`)."""
    if not any(r.parallel for r in routes):  # the common case: each handler alone
        for route in routes:
            if route.matches(fold.data):
                yield [route]
        return
    for i, j in parallel_groups([r.parallel for r in routes]):
        group = [r for r in routes[i:j] if r.matches(fold.data)]
        if group:
            yield group


def _whole_parallel_runs(routes: Sequence[Route], i: int, j: int) -> int:
    """The end of a chain ``routes[i:j]`` cut so that it never ends inside a run of adjacent
    parallel handlers that goes on past it (the run is called together, on the same data
    and deadline: a chain holding part of it would be waited for before the rest is
    called). Returns the new end (``i + 1`` or less: no chain)."""
    if j >= len(routes) or not (routes[j].parallel and routes[j - 1].parallel):
        return j
    k = j - 1
    while k > i and routes[k - 1].parallel:
        k -= 1
    return k


def _from_first_match(seg: tuple[Route, ...], data: dict[str, Any]) -> tuple[Route, ...]:
    """`seg` from its first handler whose tool filter admits `data` on: the handlers
    before it never run (only a handler that runs can change the data), and with none
    left, nothing is sent at all."""
    for i, route in enumerate(seg):
        if route.matches(data):
            return seg[i:]
    return ()


def _as_if_sequential(
    outcome: Outcome, start: float, took: float, deadline: Deadline
) -> tuple[Outcome, float]:
    """A speculative call's `outcome` as the same call, started at `start` (`clock.now()`
    seconds: when the handler before it would have ended, called one by one) and taking
    `took` seconds, gives it: a ``timeout`` if it would have ended at the emit's
    `deadline` or past it (`NEVER`: no deadline), since called one by one it would have been
    cut, or not called at all (no time left). At the deadline exactly, the cut wins: the
    loop's timer for the deadline and the handler's own wake-up fall due in one turn of the
    loop, and the cancel reaches the handler before it runs again; "exactly" is within
    `clock.NO_TIME_S`, as a call with less time left than that is not made. Also returns
    when the next handler would start. A speculative call starts no later, so its own cut
    is never earlier than that one."""
    end = start + took
    if not deadline.passed(end, early_s=clock.NO_TIME_S):
        return outcome, end
    if not (isinstance(outcome, Failed) and outcome.kind == "timeout"):
        outcome = Failed("timeout", "called one by one, it would have run past the deadline")
    return outcome, deadline.when


def _drop(calls: Iterable[asyncio.Future[tuple[Outcome, float]]]) -> None:
    """Cancel the speculative calls still running (their results are stale or not needed)
    and retrieve the errors of those that ended, so none is logged as never retrieved."""
    for call in calls:
        if not call.done():
            call.cancel()
        elif not call.cancelled():
            call.exception()
