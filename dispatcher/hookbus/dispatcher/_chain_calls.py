"""One chain request in flight, folded step by step as its worker reports.

A chain request sends adjacent handlers of one worker process's handler set in one
request (see `hookbus.schemas.ChainStep`). It is an optimisation of calling them one by
one, so it must give the same outcomes under every fault; this is how:

- the worker times each step (it cuts one at its timeout and reports that) and reports
  each step's reply as soon as the chain really waits on anything, naming the steps
  running then (`HookReply.running`); the final reply lists them all;
- the dispatcher waits on the step the fold reaches as `hookbus._core.chain_timing` says
  (a step named running for its own timeout from the first report naming it, one not
  named for its and every later step's timeouts from the last message heard, plus a
  grace): past that the worker counts as lost, the step fails as ``timeout`` under its
  own policy, and the chain is over. So a live worker's step is never failed here, nor
  one step for another's time;
- the steps after the one that was running when the chain ended (a lost worker, one shut
  down mid-chain, one that stopped because it was late) are "not run" (None): the caller
  calls each on its own within what is left of the emit's deadline (the worker never
  starts a step once that may happen). A step cut by a shutdown that may run twice
  (``retry_safe``) is not run either;
- in a chain whose steps are all ``retry_safe``, a step unanswered past its hedging
  window (`HEDGE_FRACTION` of its timeout) is also asked on its own (hedged, as any
  retry_safe call: `hedge`), and the first answer wins, the chain's or the hedge's;
- nothing run (no responders, every replica refused, a step the worker judges by another
  declaration: ``stale_declaration``): every step is "not run";
- a chain that timed out with nothing heard marks its subject suspect (see `_replicas`): for
  a while its steps are not sent as a chain but each on its own (steered to a live
  replica), and the live replicas are looked up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core import clock
from hookbus._core.chain_timing import GRACE_S
from hookbus._core.deadlines import Deadline
from hookbus._core.handler_options import DEFAULT_TIMEOUT_S
from hookbus.schemas import ChainStep, EventEnvelope, HookReply, WireFormatError, decode

from ._outcomes import NOT_RUN_CODES, Failed, Outcome, reply_outcome
from ._requester import HEDGE_FRACTION, HEDGE_MIN_S, MAX_REFUSALS
from ._route_table import Route

if TYPE_CHECKING:
    from ._reply_inbox import Inbox
    from ._requester import Requester

__all__ = ["ChainCall", "ChainPlan"]

_NO_RESPONDERS = "503"


class ChainCall:
    """One chain request: send it with `start`, then ask `outcomes` for each group of
    steps the fold reaches, in order; `close` when done.

    Args:
        requester: the connection's requester (its reply inbox).
        nc: the connection.
        plan: the steps and the chain subject.
        envelope: the request (its ``chain`` and ``budget_s`` are set here).
        headers: the request's headers (trace context).
        deadline: when the emit's remote calls must end (`NEVER`: no deadline).
    """

    def __init__(
        self,
        requester: Requester,
        nc: NATS,
        plan: ChainPlan,
        envelope: EventEnvelope,
        headers: dict[str, str] | None,
        deadline: Deadline,
    ) -> None:
        self._requester = requester
        self._nc = nc
        self._plan = plan
        self._envelope = envelope
        self._headers = headers
        self._deadline = deadline
        self._loop = asyncio.get_running_loop()
        self._inbox: Inbox | None = None
        self._tokens: list[str] = []
        self._avoid: set[str] = set()
        self._refusals = 0
        self._instance = ""
        self._replies: dict[str, HookReply] = {}
        self._running_since: dict[str, float] = {}
        self._heard_at = 0.0
        self._sent_at = 0.0
        self.requests = 0
        """Requests sent for the chain (more than 1: refused by a replica, sent again)."""
        self._heard = False
        self.over = False
        """No further step will run in the chain: those without a reply are not run."""
        self._lost: Failed | None = None

    async def start(self) -> Failed | None:
        """Send the request; a `Failed` if it could not be sent (then nothing ran).

        Raises:
            NotConnectedError: the connection is closed.
            PayloadTooLargeError: the envelope exceeds the server's max_payload.
        """
        target = self._plan.target.subject
        if self._requester.replicas.suspected(target, self._loop.time()) is not None:
            self.over = True  # its last request met a stalled replica: each step alone
            return Failed("timeout", "not sent: the chain subject is suspect")
        self._inbox = self._requester.open_inbox()
        self._envelope.chain = self._plan.steps
        self._sent_at = self._loop.time()
        return await self._send(target)

    @property
    def instance(self) -> str:
        """The worker instance whose replies the chain used ("" before any)."""
        return self._instance

    def close(self) -> None:
        """Stop listening for the chain's replies (later ones are dropped)."""
        for token in self._tokens:
            self._requester.close_inbox(token)
        self._tokens.clear()
        self.over = True

    async def outcomes(
        self, group: list[Route], hedge: Callable[[Route], Awaitable[Outcome]] | None = None
    ) -> list[Outcome | None]:
        """The outcome of each step of `group` (one step, or a parallel group), waiting
        for them as the module docstring says; None for a step the chain did not run
        (call it alone). `hedge(route)`: the step asked on its own (a chain of retry_safe
        steps hedges a slow step with it). Steps already answered: see `answered`, which
        gives them without a wait or a coroutine."""
        out: dict[Route, Outcome | None] = {}
        hedges: dict[Route, asyncio.Future[Outcome]] = {}
        ended = False
        try:
            while True:
                pending = [r for r in group if r not in out and not self._settle(r, out)]
                now = self._loop.time()
                for r in [r for r in pending if r in hedges and hedges[r].done()]:
                    answer = hedges[r].result()
                    # the hedge's answer wins; its failure only once the chain's is due
                    if not isinstance(answer, Failed) or self._due(r) <= now:
                        out[r] = answer
                        pending.remove(r)
                if not pending:
                    break
                waiting = [r for r in pending if r not in hedges or hedges[r].done()]
                due = min((self._due(r) for r in waiting), default=None)
                if self._plan.hedge and hedge is not None and waiting:
                    for r in [r for r in waiting if r not in hedges and self._hedge_at(r) <= now]:
                        hedges[r] = self._start_hedge(hedge, r)
                    due = min((self._hedge_at(r) for r in waiting if r not in hedges), default=due)
                if due is not None and now >= due:
                    for r in waiting:
                        if self._due(r) <= now and r not in hedges:
                            out[r] = self._timeout(r)
                            ended = True
                    continue
                await self._next(due)
        finally:
            for task in hedges.values():
                task.cancel()
        if ended:
            self.over = True
            if not self._heard:  # nothing came back at all: a stalled replica, or a lost one
                # the process the queue group chose serves every step: all are suspect
                for subject in (self._plan.target.subject, *self._plan.subjects.values()):
                    self._requester.replicas.suspect(subject, self._sent_at)
                for r in group:
                    await self._requester.discover(r.subject)
        return [out[r] for r in group]

    def answered(self, group: list[Route]) -> list[Outcome | None] | None:
        """`outcomes` of `group` if every step's reply is in already (the common case,
        without a wait), else None."""
        replies = self._replies
        out: list[Outcome | None] = []
        for r in group:
            reply = replies.get(r.name)
            if reply is None:
                return None
            out.append(self._outcome(reply))
        return out

    def _start_hedge(
        self, hedge: Callable[[Route], Awaitable[Outcome]], route: Route
    ) -> asyncio.Future[Outcome]:
        task = asyncio.ensure_future(hedge(route))
        inbox = self._inbox
        if inbox is not None:
            task.add_done_callback(lambda _: inbox.wake())
        return task

    # -- internals ---------------------------------------------------------------------------
    def _settle(self, route: Route, out: dict[Route, Outcome | None]) -> bool:
        """Put `route`'s outcome in `out` if known now; whether it was."""
        reply = self._replies.get(route.name)
        if reply is not None:
            out[route] = self._outcome(reply)
        elif self._lost is not None:
            out[route] = self._lost
        elif self.over:
            out[route] = None
        else:
            return False
        return True

    @staticmethod
    def _outcome(reply: HookReply) -> Outcome | None:
        """A step's reply as an outcome; None for a step cut by a shutdown that is safe to
        run again (asked on its own, like a refusal)."""
        err = reply.error
        return None if err is not None and err.retryable else reply_outcome(reply)

    def _timeout_s(self, route: Route) -> float:
        return route.timeout_s or DEFAULT_TIMEOUT_S

    def _start_of(self, route: Route) -> float:
        """When `route`'s step started, as far as the dispatcher knows (its clock)."""
        return self._running_since.get(route.name, self._heard_at)

    def _due(self, route: Route) -> float:
        """When the worker counts as lost while the fold waits on `route`
        (`hookbus._core.chain_timing`), cut to the emit's deadline."""
        since = self._running_since.get(route.name)
        if since is not None:
            due = since + self._timeout_s(route) + GRACE_S
        else:
            due = self._heard_at + self._plan.rest_s[route.name] + GRACE_S
        return self._deadline.cap(due)

    def _hedge_at(self, route: Route) -> float:
        return self._start_of(route) + max(HEDGE_MIN_S, self._timeout_s(route) * HEDGE_FRACTION)

    def _timeout(self, route: Route) -> Failed:
        if self._deadline.passed(self._loop.time()):
            return Failed("timeout", "no reply within the emit's deadline")
        return Failed("timeout", f"no reply within {self._timeout_s(route):.3g}s")

    async def _next(self, until: float | None) -> None:
        """Take the next message of the chain, or return at `until` (loop time; None: when
        woken)."""
        assert self._inbox is not None
        try:
            token, msg = await self._inbox.get(self._loop, until or self._loop.time() + 3600)
        except TimeoutError:
            return
        await self._take(token, msg)

    async def _take(self, token: str, msg: Msg) -> None:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None:
            if not msg.data and status == _NO_RESPONDERS and not self._heard:
                self._requester.close_inbox(token)
                self.over = True  # nobody serves the set: each step on its own
                return
            self._lose(f"a status {status!r} message, not a HookReply")
            return
        try:
            reply = decode(msg.data, HookReply)
        except WireFormatError as exc:
            self._lose(str(exc))
            return
        if reply.error is not None:
            await self._refused(reply)
            return
        if reply.chain is None:
            self._lose("a chain reply without its replies")
            return
        now = self._loop.time()
        self._heard, self._heard_at = True, now
        instance = reply.instance
        if instance and not self._instance:
            self._instance = instance
            self._requester.replicas.answered(self._plan.target.subject, instance, now)
        for r in reply.chain:
            self._replies[r.handler] = r
            subject = self._plan.subjects.get(r.handler)
            if instance and subject:  # a hedge of this handler alone may go there
                self._requester.replicas.answered(subject, instance, now)
        if reply.running is None:
            self.over = True
        else:
            since = now - max(0.0, reply.running_for_s)
            for name in reply.running:  # the first report dates it: none re-arms it
                self._running_since.setdefault(name, since)

    async def _refused(self, reply: HookReply) -> None:
        """An error answering the whole request: nothing ran (see the worker's codes)."""
        err = reply.error
        assert err is not None
        if self._heard or err.code not in NOT_RUN_CODES:
            self._lose(f"{err.code}: {err.message}", kind="error")
            return
        if reply.instance:
            self._avoid.add(reply.instance)
        self._refusals += 1
        if err.retryable and err.code in ("busy", "unavailable") and self._refusals < MAX_REFUSALS:
            subject, _ = self._requester.replicas.target(
                self._plan.target, self._avoid, self._loop.time(), chain=True
            )
            if await self._send(subject) is None:
                return
        self.over = True  # each step on its own

    def _lose(self, message: str, kind: str = "bad_reply") -> None:
        """The chain's answer cannot be read: the steps waited for fail so (a
        ``bad_reply`` always denies), and the chain is over."""
        self._lost = Failed(kind, message)  # type: ignore[arg-type]
        self.over = True

    async def _send(self, subject: str) -> Failed | None:
        assert self._inbox is not None
        now = self._loop.time()
        budget = self._deadline.cut(self._plan.total_s, now)
        if clock.no_time_left(budget):
            self.over = True
            return Failed("timeout", "not called: the emit's deadline had passed")
        self._envelope.budget_s = budget
        self._envelope.attempt = len(self._tokens) + 1
        token = self._requester.add_token(self._inbox)
        self._tokens.append(token)
        self.requests += 1
        failed = await self._requester.send(self._nc, subject, self._envelope, self._headers, token)
        if failed is not None:
            self.over = True
            return failed
        if not self._heard:
            self._heard_at = now
        return None


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """What every chain request for one sequence of handlers shares (made once per sequence)."""

    target: Route
    """The chain subject as a route (its name, for messages)."""
    steps: list[ChainStep]
    total_s: float
    """The sum of the steps' timeouts, seconds."""
    hedge: bool
    """Every step is retry_safe: a step may be asked again on its own (hedged)."""
    subjects: dict[str, str]
    """Each step's handler subject, by handler name (an instance that answers a step is a
    hedge target of that handler too: it serves it)."""
    rest_s: dict[str, float]
    """By handler name: the timeouts of its step and every later one, summed (seconds)."""

    @classmethod
    def of(cls, seg: tuple[Route, ...]) -> ChainPlan:
        steps = [
            ChainStep(
                handler=r.name,
                failure_policy=r.failure_policy,
                timeout_s=r.timeout_s or DEFAULT_TIMEOUT_S,
                parallel=r.parallel,
                tool_filter=None if r.tool_filter is None else list(r.tool_filter),
            )
            for r in seg
        ]
        head = seg[0]
        target = Route.make(
            event=head.event,
            name=f"chain of {len(seg)} handlers ({head.name!r}, ...)",
            priority=head.priority,
            timeout_s=None,
            failure_policy=head.failure_policy,
            parallel=False,
            tool_filter=None,
            subject=head.chain,
        )
        rest_s: dict[str, float] = {}
        total = 0.0
        for step in reversed(steps):
            total += step.timeout_s
            rest_s[step.handler] = total
        subjects = {r.name: r.subject for r in seg}
        return cls(target, steps, total, all(r.retry_safe for r in seg), subjects, rest_s)
