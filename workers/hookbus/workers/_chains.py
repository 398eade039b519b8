"""Chain requests: a sequence of this process's handlers of one event, run in one request.

A dispatcher sends adjacent handlers of one worker process's handler set in one request
(see `hookbus.schemas.ChainStep`); `ChainRunner` runs its steps in order, each timed here
within its own timeout (`HandlerCaller.invoke`), and stops where the dispatcher's fold
would stop (`hookbus._core.fold_rules.ends_fold`, the one stop rule), after a step that
timed out, before a step the dispatcher may have given up on, or once the worker drains.
While steps wait, progress replies go out (`ChainProgress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from hookbus._core.copies import json_copy
from hookbus._core.deadlines import Deadline
from hookbus._core.fold_rules import StepOutcome, ends_fold, group_end, modifies, widest_group
from hookbus._core.serving import Admission, Endpoint
from hookbus._core.tasks import gather_tasks
from hookbus.schemas import (
    MAX_HANDLER_SET,
    MAX_RECORD_BYTES,
    ChainStep,
    EventEnvelope,
    HookReply,
    WireError,
    WireFormatError,
    chain_instance_subject,
    chain_queue_group,
    chain_subject,
    decode,
    encode,
    handler_set_id,
)

from ._chain_progress import ChainProgress
from ._replies import log_reply, ready, sendable, sendable_step
from ._requests import RequestServer
from ._spec import HandlerSpec
from ._stalls import LoopStalls
from ._telemetry import chain_handling, handling_span
from ._telemetry_core import otel

__all__ = ["ChainRunner", "name_handler_set"]

log = logging.getLogger("hookbus.workers")

Specs = dict[tuple[str, str], HandlerSpec]
"""A worker's handlers by (event, handler name)."""


def name_handler_set(specs: Specs) -> str:
    """Name the process's handler set in every declaration of `specs` (replaced in place)
    and return its id, if it fits the bounds (`MAX_HANDLER_SET` names, each declaration
    within `MAX_RECORD_BYTES`); else "" (its handlers are not sent as chains)."""
    names = sorted({name for _, name in specs})
    if len(names) > MAX_HANDLER_SET:
        log.info("%d handlers: more than %d, not sent as chains", len(names), MAX_HANDLER_SET)
        return ""
    declared = {
        key: msgspec.structs.replace(spec.declaration, handler_set=names)
        for key, spec in specs.items()
    }
    if any(len(encode(d)) > MAX_RECORD_BYTES for d in declared.values()):
        log.info("handler names too long to declare their set: not sent as chains")
        return ""
    for key, decl in declared.items():
        specs[key] = dataclasses.replace(specs[key], declaration=decl)
    return handler_set_id(names)


class ChainRunner:
    """Serves the chain requests of one worker process's handler set.

    Args:
        specs: the process's handlers (read at each request: the same dict the worker
            holds).
        name: the handler set's id (`name_handler_set`): the subjects' token, and the
            `HookReply.handler` of a chain's replies.
        server: the process's request path (reading a request, replying, counting), and
            its `RequestServer.caller`, which runs each step's handler.
        stalls: the event loop's stalls, to date a request from.
        is_serving: whether the worker serves (else it drains, or has not finished
            starting: no further step starts, the dispatcher calls the rest itself).
    """

    __slots__ = ("_caller", "_is_serving", "_name", "_server", "_specs", "_stalls")

    def __init__(
        self,
        specs: Specs,
        name: str,
        server: RequestServer,
        stalls: LoopStalls,
        is_serving: Callable[[], bool],
    ) -> None:
        self._specs = specs
        self._name = name
        self._server = server
        self._caller = server.caller
        self._stalls = stalls
        self._is_serving = is_serving

    # -- endpoints ---------------------------------------------------------------------
    def endpoints(self) -> list[Endpoint]:
        """The chain endpoint of each event the process handles, in its queue group."""
        group = chain_queue_group(self._name)
        return [self._endpoint(subject, group) for subject in self._subjects()]

    def instance_endpoints(self, instance: str) -> list[Endpoint]:
        """The chain endpoint of each event on its subject of this process `instance`."""
        return [
            self._endpoint(chain_instance_subject(subject, instance))
            for subject in self._subjects()
        ]

    def _subjects(self) -> list[str]:
        events = dict.fromkeys(event for event, _ in self._specs)
        return [chain_subject(event, self._name) for event in events]

    def _endpoint(self, subject: str, queue_group: str = "") -> Endpoint:
        """The endpoint of this process's chain requests on `subject`."""
        return Endpoint(
            subject,
            self._serve,
            self._server.refusal(self._name),
            queue_group=queue_group,
            admit=self._admit,
        )

    def _admit(self, msg: Msg, received: int) -> Admission | Awaitable[None]:
        # a chain takes one slot of max_concurrency per handler it may run at once (its
        # widest sequence of parallel steps), so the bound still counts running handlers;
        # a plain function: only a refusal needs a coroutine (to answer)
        try:  # decoded once, here: its steps give its width, and the chain runs on it
            envelope: EventEnvelope | None = decode(msg.data, EventEnvelope)
        except WireFormatError:
            envelope = None  # admitted as one step, then answered bad_request by _run
        width = _chain_width(envelope)
        bound = self._server.max_concurrency
        if width > bound:  # never servable here: call them one by one
            error = WireError(
                code="bad_request",
                message=f"{width} parallel steps exceed max_concurrency={bound}",
            )
            return self._refuse(msg, HookReply(handler=self._name, error=error))
        return Admission(width, envelope)

    async def _refuse(self, msg: Msg, reply: HookReply) -> None:
        """Answer a chain request the serving loop must not admit (`_admit`)."""
        with contextlib.suppress(Exception):
            await self._server.respond(msg, reply)

    # -- one chain request -------------------------------------------------------------
    async def _serve(self, msg: Msg, envelope: EventEnvelope | None, received: int) -> None:
        name = self._name
        respond = self._server.respond
        replies: list[HookReply] = []
        running: list[tuple[ChainStep, HandlerSpec]] = []
        try:
            if otel.sync():
                with chain_handling(msg, envelope):  # one message: one span, steps attributes
                    reply = await self._run(msg, envelope, replies, running)
            else:  # nothing to record: not even the shared do-nothing span's enter and exit
                reply = await self._run(msg, envelope, replies, running)
            await respond(msg, reply)
        except asyncio.CancelledError:  # shutdown's grace ran out: what ran, and what was cut
            replies.extend(
                HookReply(
                    handler=step.handler,
                    error=WireError(
                        code="unavailable",
                        message="the worker shut down while the handler ran",
                        retryable=spec.declaration.retry_safe,  # as for a request of its own
                    ),
                )
                for step, spec in running
            )
            with contextlib.suppress(Exception):
                await respond(msg, HookReply(handler=name, chain=replies))
            raise
        except Exception as exc:  # never let one request take the worker down
            log.exception("unexpected error serving the chain on %s", msg.subject)
            with contextlib.suppress(Exception):
                error = WireError(code="internal", message=repr(exc))
                await respond(msg, HookReply(handler=name, error=error))
        finally:
            self._server.handled += max(1, len(replies))

    def _served(
        self, event: str, steps: list[ChainStep]
    ) -> tuple[list[HandlerSpec | None], HookReply | None]:
        """Each step's handler here (None: not served), and the reply refusing the chain
        if this process must not run it (nothing run), else None: no steps, a step it
        does not serve, or a step the dispatcher judged by another declaration than this
        process's (its tool filter: the two would skip or run different steps, e.g.
        during a rolling update)."""
        get = self._specs.get
        specs: list[HandlerSpec | None] = []
        usual = bool(steps)  # every step served here, by the declaration it was judged by
        for step in steps:
            spec = get((event, step.handler))
            specs.append(spec)
            if spec is None or step.tool_filter != spec.declaration.tool_filter:
                usual = False
        if usual:
            return specs, None
        name = self._name
        missing = [st.handler for st, sp in zip(steps, specs, strict=True) if sp is None]
        if not steps or missing:
            message = f"not served by this process: {missing}" if missing else "no steps"
            error = WireError(code="bad_request", message=message)
            return specs, HookReply(handler=name, error=error)
        stale = [
            st.handler
            for st, sp in zip(steps, specs, strict=True)
            if sp is not None and st.tool_filter != sp.declaration.tool_filter
        ]
        if stale:
            message = f"this process serves other declarations of {stale} for {event!r}"
            error = WireError(code="stale_declaration", message=message)
            return specs, HookReply(handler=name, error=error)
        return specs, None

    async def _run(
        self,
        msg: Msg,
        decoded: EventEnvelope | None,
        replies: list[HookReply],
        running: list[tuple[ChainStep, HandlerSpec]],
    ) -> HookReply:
        """Run the steps of a chain request in order, appending each step's reply to
        `replies` (and naming the steps running now in `running`); stop after a step that
        ends the fold (see `ChainStep`) or timed out, before a step the dispatcher may
        have given up on (see `ChainProgress`), or once the worker drains. `decoded`: the
        request's envelope (None: it could not be decoded). Progress replies go out while
        steps wait."""
        received = self._stalls.dated(time.monotonic())
        name = self._name
        envelope, refusal = self._server.read_request(name, msg, decoded)
        if envelope is None:
            assert refusal is not None
            return refusal
        steps = envelope.chain or []
        specs, refusal = self._served(envelope.event, steps)
        if refusal is not None:
            return refusal
        deadline = Deadline.after(envelope.budget_s, received)  # on `time.monotonic()`
        rest_s = 0.0  # the timeouts of the steps, summed
        for step in steps:
            rest_s += step.timeout_s
        respond = functools.partial(self._server.respond, msg)
        progress = ChainProgress(name, respond, received, rest_s)
        try:
            await self._run_steps(
                msg, envelope, steps, specs, deadline, rest_s, progress, replies, running
            )
        finally:
            progress.close()
        return HookReply(handler=name, chain=replies)

    async def _run_steps(
        self,
        msg: Msg,
        envelope: EventEnvelope,
        steps: list[ChainStep],
        specs: list[HandlerSpec | None],
        deadline: Deadline,
        rest_s: float,
        progress: ChainProgress,
        replies: list[HookReply],
        running: list[tuple[ChainStep, HandlerSpec]],
    ) -> None:
        """The fold of `_run`: each group of steps (one step, or adjacent parallel ones)
        whose tool filter admits the data runs in order, on the data the last modify
        made, until a step's reply stops the chain (`_stops_chain`), the next step starts
        too late or the worker drains; each reply is appended to `replies`. `deadline`:
        the request's budget ends (on `time.monotonic()`; `NEVER`: none); `rest_s`: the
        steps' timeouts, summed."""
        data = envelope.data
        size: int | None = len(msg.data)  # about its JSON's: the request's (for copies)
        n = len(steps)
        caller, is_serving = self._caller, self._is_serving
        # judged once per chain, as for a request of its own: from the next request on
        observed = otel.sync() or log.isEnabledFor(logging.DEBUG)
        # a chain without parallel steps (the usual one) is a group per step
        parallel = [step.parallel for step in steps] if _any_parallel(steps) else None
        i = 0
        while i < n:
            j = i + 1 if parallel is None else group_end(parallel, i)
            for step in steps[i:j]:
                rest_s -= step.timeout_s
            if j == i + 1:
                spec = specs[i]
                if spec is None or not spec.matches(data):
                    i = j
                    continue
                step = steps[i]
                run = [(step, spec)]
            else:
                run = [
                    (step, spec)
                    for step, spec in zip(steps[i:j], specs[i:j], strict=True)
                    if spec is not None and spec.matches(data)
                ]
                if not run:
                    i = j
                    continue
            i = j
            if progress.settle():  # replies of steps that were reported running
                await asyncio.sleep(0)  # written before the next step can hold the loop
            now = time.monotonic()
            if progress.late(now) or not is_serving():
                # the dispatcher calls the rest itself: late, or draining (a request of
                # its own would be refused now too)
                break
            running[:] = run
            if len(run) == 1:  # no task per step: the common, sequential case
                step, spec = run[0]  # (a parallel group may have one step left)
                progress.start([step], now, rest_s)
                if caller.may_wait(run):  # reported before anything the step sends
                    progress.suspended()
                # the last step may have the request's decoded data itself, as a
                # request of its own does: nothing reads it after this step (not so
                # once an earlier step's modify replaced it: that data is in its reply)
                copy = i < n or data is not envelope.data
                out, modified, modified_size = sendable_step(
                    await self._step(
                        spec, step, envelope, data, deadline, msg, copy, observed,
                        progress.suspended, size,
                    )
                )  # fmt: skip
                progress.finished(step, out)
                caller.returned(spec)  # unless a call showed it waits
                outs: list[HookReply] = [out]
            else:
                progress.start([step for step, _ in run], now, rest_s)
                if caller.may_wait(run):
                    progress.suspended()
                outs = await self._run_group(
                    run, envelope, data, deadline, msg, progress, size, observed
                )
            running.clear()
            # every step that ran is reported, those after the one that ends the fold
            # in a parallel group too: the dispatcher would call a missing one again
            replies += outs
            for (step, _), out in zip(run, outs, strict=True):
                if _stops_chain(step, out):
                    return
                result = out.result  # only a sequential step's modify gets here
                if result is not None and modifies(result):
                    # its data as the handler returned it (the reply carries its JSON)
                    data, size = modified, modified_size  # type: ignore[assignment]

    async def _run_group(
        self,
        run: list[tuple[ChainStep, HandlerSpec]],
        envelope: EventEnvelope,
        data: dict[str, Any],
        deadline: Deadline,
        msg: Msg,
        progress: ChainProgress,
        json_size: int | None,
        observed: bool,
    ) -> list[HookReply]:
        """Run a parallel group of steps concurrently, on `data` (each handler its own
        copy; `json_size`, `observed`: see `_step`), each in a task of its own (its own
        context, as `asyncio.gather` gives); each reply is handed to `progress` as its step
        finishes. On Python 3.12+ the tasks start eagerly (`gather_tasks`): when every
        handler returned without waiting the group is over with no turn of the event loop."""
        caller = self._caller

        async def one(step: ChainStep, spec: HandlerSpec) -> HookReply:
            reply = sendable(
                await self._step(spec, step, envelope, data, deadline, msg, True, observed,
                                 progress.suspended, json_size)
            )  # fmt: skip
            progress.finished(step, reply)
            caller.returned(spec)  # unless a call showed it waits
            return reply

        return await gather_tasks(one(st, sp) for st, sp in run)

    def _step(
        self,
        spec: HandlerSpec,
        step: ChainStep,
        envelope: EventEnvelope,
        data: dict[str, Any],
        deadline: Deadline,
        msg: Msg,
        copy: bool = True,
        observed: bool = True,
        suspended: Callable[[], None] | None = None,
        json_size: int | None = None,
    ) -> Awaitable[HookReply]:
        """Run one step of a chain on `data` (`copy`: on a copy of its own, as a request
        of its own would get, so in-place edits stay its own; `json_size`: about how many
        bytes the JSON of `data` takes, which msgspec decoded or encoded, see `json_copy`;
        None: not known), within the shorter of the
        step's and the handler's timeouts and what is left of the request's `deadline`
        (on `time.monotonic()`; `NEVER`: none). A plain function returning the step's
        awaitable: unless `observed` (telemetry or debug logging on), the handler's
        `HandlerCaller.invoke` itself (one coroutine frame less per step). `suspended`:
        see `HandlerCaller.invoke`."""
        timeout_s = min(step.timeout_s, spec.declaration.timeout_s)
        if not deadline.unbounded:
            timeout_s = deadline.cut(timeout_s, time.monotonic())
        if timeout_s <= 0:
            error = WireError(code="handler_timeout", message="not run: the chain's budget ran out")
            return ready(HookReply(handler=step.handler, error=error))
        if observed:
            return self._step_observed(
                spec, step, envelope, data, timeout_s, msg, copy, suspended, json_size
            )
        own = json_copy(data, json_size) if copy else data
        return self._caller.invoke(spec, envelope.event, own, timeout_s, envelope.id, suspended)

    async def _step_observed(
        self,
        spec: HandlerSpec,
        step: ChainStep,
        envelope: EventEnvelope,
        data: dict[str, Any],
        timeout_s: float,
        msg: Msg,
        copy: bool,
        suspended: Callable[[], None] | None,
        json_size: int | None,
    ) -> HookReply:
        """`_step` with its handling recorded (telemetry) and logged (debug)."""
        started = time.monotonic()
        headers = {"traceparent": step.traceparent} if step.traceparent else msg.headers
        with handling_span(spec.declaration, envelope, headers, subject=msg.subject) as handling:
            own = json_copy(data, json_size) if copy else data
            reply = await self._caller.invoke(
                spec, envelope.event, own, timeout_s, envelope.id, suspended
            )
            handling.reply(reply)
        if log.isEnabledFor(logging.DEBUG):
            log_reply(spec.declaration, reply, "call", time.monotonic() - started)
        return reply


def _any_parallel(steps: list[ChainStep]) -> bool:
    """Whether a chain has a parallel step (else each step is a group of its own)."""
    for step in steps:  # a loop, not any() over a generator: cheaper for a few steps
        if step.parallel:
            return True
    return False


def _chain_width(envelope: EventEnvelope | None) -> int:
    """The most handlers a chain request may run at once: its widest sequence of adjacent
    parallel steps (1 for a sequential chain, or a request that cannot be read)."""
    steps = (envelope.chain if envelope is not None else None) or []
    if not _any_parallel(steps):  # the usual chain: no list of flags to build and scan
        return 1
    return widest_group([step.parallel for step in steps])


def _stops_chain(step: ChainStep, reply: HookReply) -> bool:
    """Whether the chain stops after this step's reply: the dispatcher's fold stops there
    (so later steps must not run: `ends_fold`, the one stop rule, on the step's reply: a
    result's action; an error ``bad_result``, or a reply with neither, is an unreadable
    result; any other error a failure), or the step timed out (the dispatcher calls the
    steps after a timed-out one itself)."""
    outcome: StepOutcome
    result, error = reply.result, reply.error
    if result is not None:
        outcome = result.action
    elif error is None or error.code == "bad_result":
        outcome = "unreadable"
    elif error.code == "handler_timeout":
        return True
    else:
        outcome = "failed"
    return ends_fold(outcome, parallel=step.parallel, failure_policy=step.failure_policy)
