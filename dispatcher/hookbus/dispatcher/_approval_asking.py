"""Asking an approval: a handler's ``ask_user`` opened as an approval record and waited on.

The asker cuts the question's timeout, denies at once what nobody may be asked (no allowing
option, over the agent's quota, a record it may not write), allows by a verified grant, or
creates (or takes over) the approval and waits for its answer, its timeout or the caller's
deadline. The rules are told in `hookbus.dispatcher._approvals`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

import nats.errors
import nats.js.errors

from hookbus._core.deadlines import Deadline, caller_bound, caller_deadline
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    AlreadySettledError,
    ApprovalAnswer,
    HookbusError,
    HookbusTimeoutError,
    HookResult,
    SuspensionCancelledError,
    SuspensionError,
    SuspensionNotFoundError,
    SuspensionRecord,
    SuspensionTimeoutError,
)
from hookbus.schemas import telemetry as tn

from ._approval_answers import ApprovalAnswers, UsedUp
from ._approval_proofs import ApprovalProofs
from ._approval_rules import (
    CALLERS_DEADLINE,
    MAX_APPROVAL_TIMEOUT_S,
    NO_ALLOWING_OPTION,
    NOT_ASKED,
    TIMED_OUT,
    allowing_options,
    approval_label,
    approval_left,
    approval_metadata,
    call_data,
    cut_timeout,
    decided,
    next_approval_label,
    text_or_none,
)
from ._pending_quota import PendingQuota
from ._records import RecordStore
from ._suspensions import Suspensions

__all__ = ["SETTLE_READS_S", "ApprovalAsker"]

log = logging.getLogger("hookbus.dispatcher")

_MIN_READ_S = 0.5
"""A grant read gets at least this many seconds, even for an approval with a shorter timeout."""

SETTLE_READS_S = 0.5
"""Seconds the reads at the caller's deadline (an answer that landed meanwhile decides)
may take past it."""


class _Question(NamedTuple):
    """One handler's question about one call, as it is asked (its timeout already cut)."""

    event: str
    result: HookResult
    handler: str
    options: list[str]
    allowing: list[str]
    """The `options` that allow (never empty: a question none of whose options allows is
    denied without asking)."""
    store: Suspensions
    """The approval records of the call's agent."""


class ApprovalAsker:
    """Asks the approvals in `records` and waits for their answers (`decide`).

    Args:
        records: the approval records (see `Approvals`).
        answers: folds a record's answer into the decision, and finds grants.
        proofs: applies the approvers' proofs while an approval is waited on.
        read_s: longest time, in seconds, a grant read or the pending count retries through
            a JetStream leader election (a grant read: never longer than the approval's
            own timeout, but at least 0.5 s).
        max_pending: pending approvals one agent may have at once (None: no limit).
    """

    def __init__(
        self,
        records: Suspensions,
        answers: ApprovalAnswers,
        proofs: ApprovalProofs,
        *,
        read_s: float,
        max_pending: int | None,
    ) -> None:
        self._records = records
        self._answers = answers
        self._proofs = proofs
        self._read_s = read_s
        self.max_pending = max_pending
        self._quota = (
            None if max_pending is None else PendingQuota(max_pending, self._count_pending)
        )
        self.max_timeout_s = MAX_APPROVAL_TIMEOUT_S
        """See `Approvals.max_timeout_s`."""
        self.own_agent_secured = False
        """Whether these are an agent's own records on a secured server (it may not create
        approvals there: no pending count)."""

    async def decide(
        self, event: str, result: HookResult, *, call_id: str, wait_s: float | None,
        longest_s: float | None,
    ) -> HookResult:  # fmt: skip
        """See `Approvals.decide`."""
        with caller_deadline(wait_s):
            return await self._decide(
                event, result, call_id=call_id, wait_s=wait_s, longest_s=longest_s
            )

    async def _decide(
        self, event: str, result: HookResult, *, call_id: str, wait_s: float | None,
        longest_s: float | None,
    ) -> HookResult:  # fmt: skip
        started = time.monotonic()
        caller = Deadline.after(wait_s, started)  # on `time.monotonic()`, as `started`
        handler = result.decided_by or "?"
        result = cut_timeout(result, self.max_timeout_s, longest_s)
        options = list(result.approval_options or APPROVAL_DEFAULT_OPTIONS)
        allowing = allowing_options(options, result.approval_allow_options)
        if not allowing:
            return self._no_allowing_option(event, result, handler, options)
        budget = min(x for x in (self._read_s, result.approval_timeout, wait_s) if x is not None)
        granted = await self._answers.granted(
            event, result, handler, budget_s=max(budget, _MIN_READ_S)
        )
        if granted is not None:
            return granted
        data = call_data(result)
        store = self._records.for_agent(text_or_none(data.get("agent_id")))
        label = approval_label(event, data, handler, call_id=call_id)
        question = _Question(event, result, handler, options, allowing, store)
        while True:
            try:
                return await self._decide_at(question, label, started, caller)
            except UsedUp:  # its "Allow once" went to another decision: ask afresh
                now = time.monotonic()
                if caller.passed(now):
                    return decided(
                        result, allow=False,
                        reason=f"{CALLERS_DEADLINE}: its one-time allow was used by"
                        " another decision, and no time is left to ask again",
                    )  # fmt: skip
                started = now
                label = next_approval_label(label)

    async def _decide_at(
        self, question: _Question, label: str, started: float, caller: Deadline
    ) -> HookResult:
        """Decide `question` by the approval `label` (asked, taken over, or read: see
        `_decide`), asked at `started` (`time.monotonic()`) within the caller's deadline
        `caller` (on that clock). Raises `UsedUp` when its one-time allow went to another
        decision."""
        result, options, store = question.result, question.options, question.store
        try:
            got = await store.get(label)  # a retry of this call finds its approval
        except HookbusError as exc:
            if _out_of_time(exc):
                raise
            return self._not_asked(result, exc)
        if got is not None and got[0].used_by:
            raise UsedUp
        reserved = False
        if got is not None:
            decision = await self._answers.from_record(result, got[0], options, store)
            if decision is not None:
                return decision
        else:
            over = await self._over_quota(store)
            if over is not None:
                return decided(result, allow=False, reason=over)
            reserved = self._quota is not None and not self.own_agent_secured
        try:
            return await self._asked(question, label, started, caller, got)
        finally:
            if reserved and self._quota is not None:
                self._quota.release(store.agent_id)

    async def _asked(
        self,
        question: _Question,
        label: str,
        started: float,
        caller: Deadline,
        got: tuple[SuspensionRecord, int] | None,
    ) -> HookResult:
        """Ask `question` as the approval `label` (or take it over, `got`) and decide from
        its answer."""
        event, result, handler, options, allowing, store = question
        remaining = approval_left(result.approval_timeout, started)
        caller_left = None if caller.unbounded else caller.left(time.monotonic())
        cut = caller_left is not None and (remaining is None or caller_left < remaining)
        metadata = approval_metadata(event, result, handler, options, allowing)
        try:
            answer = await self._wait(store, label, metadata, caller_left if cut else remaining)
        except SuspensionTimeoutError:
            if cut:  # past the caller's deadline: a few reads only
                with caller_deadline(SETTLE_READS_S, extend=True):
                    return await self._callers_deadline(result, label, options, store)
            return await self._timed_out(result, label, options, store)
        except SuspensionCancelledError as exc:
            return self._answers.cancelled(result, exc.reason)
        except SuspensionError:
            raise
        except HookbusError as exc:
            if got is None and not _out_of_time(exc):  # the approval could not be asked
                return self._not_asked(result, exc)
            raise
        return await self._answers.answered(result, answer, options, store, label)

    def _not_asked(self, result: HookResult, exc: BaseException) -> HookResult:
        """The deny of a question whose approval record could not be written or read."""
        log.warning("approval not asked: the approval record could not be written (%s)", exc)
        return decided(
            result, allow=False,
            reason=f"{NOT_ASKED}: this dispatcher could not write the approval record"
            f" ({type(exc).__name__}); on a secured server an agent's approvals are asked"
            " through the dispatcher service",
        )  # fmt: skip

    async def _over_quota(self, store: Suspensions) -> str | None:
        """The deny reason when `store`'s agent already has `max_pending` live pending
        approvals (`PendingQuota`: those this process asks, and one shared count of the
        agent's keys of the approvals bucket), else None: then room is reserved."""
        if self._quota is None or self.own_agent_secured:
            return None  # none, or the agent may not create approvals at all: no count
        try:  # the count is shared: only this wait for it is cut
            async with caller_bound().timeout():
                pending = await self._quota.admit(store.agent_id)
        except TimeoutError:  # the caller's deadline: its room stays reserved, released
            return None  # as an admitted question's (which then fails for lack of time)
        if pending is None:
            return None
        log.warning("agent %r has %d pending approvals: not asking more", store.agent_id, pending)
        return (
            f"quota: agent {store.agent_id!r} already has {pending} pending approvals (at most"
            f" {self.max_pending}); answer or cancel them first"
        )

    async def _count_pending(self, agent_id: str | None) -> int:
        """The live pending approval records of `agent_id` in the bucket (one pass over its
        keys). Raises what the scan raises (then it is not counted)."""
        scoped = RecordStore(
            self._records.records.kv, deadline_s=self._read_s, agent_id=agent_id,
            scoped=True,
        )  # fmt: skip
        try:
            records, _ = await scoped.scan()
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("pending approvals of %r not counted (%s)", agent_id, exc)
            raise
        now = time.time()
        return sum(
            1 for r in records
            if r.status == "pending" and r.metadata.get("kind") == "approval"
            and (not isinstance(t := r.metadata.get("timeout_s"), int | float)
                 or r.created_at + t > now)
        )  # fmt: skip

    def _no_allowing_option(
        self, event: str, result: HookResult, handler: str, options: list[str]
    ) -> HookResult:
        """The deny of a question none of whose `options` allows (nobody is asked: every
        answer would deny, and a human's refusal must not be made up); logged as a warning."""
        allow_options = result.approval_allow_options
        rule = (
            "none starts with 'allow' and no approval_allow_options were given"
            if allow_options is None
            else f"none is in approval_allow_options {allow_options}"
        )
        log.warning(
            "handler %r asked about %r with options %s, which %s (%s): denied without asking",
            handler, event, options, NO_ALLOWING_OPTION, rule,
        )  # fmt: skip
        return decided(
            result, allow=False,
            reason=f"handler {handler!r} asked with options {options}, which"
            f" {NO_ALLOWING_OPTION} ({rule}): denied without asking anyone",
        )  # fmt: skip

    async def _wait(
        self, store: Suspensions, label: str, metadata: dict[str, Any], timeout_s: float | None
    ) -> ApprovalAnswer:
        """Create (or take over) the approval `label` and wait `timeout_s` seconds (None:
        no limit) for its answer, resolving it from the first approver's proof meanwhile
        (`ApprovalProofs.pump`). Raises as `Suspensions.hook`."""
        options = metadata["options"]
        key = store.records.key(label)
        signal = store.watch.listen_proofs(key)
        pump = asyncio.get_running_loop().create_task(
            self._proofs.pump(store, label, options, signal), name=f"proofs of {label}"
        )
        try:
            return await store.hook(
                label,
                payload=ApprovalAnswer,
                metadata=metadata,
                timeout_s=timeout_s,
                schema={
                    "type": "object",
                    "properties": {"choice": {"enum": options}},
                    "required": ["choice"],
                },
                shared=True,  # a retried call (same call id) takes over the same approval
                kind="approval",
                span_attributes={
                    tn.HANDLER: metadata["handler"],
                    tn.GEN_AI_TOOL_NAME: metadata["tool_name"] or "",
                    tn.GEN_AI_CONVERSATION_ID: metadata["session_id"] or "",
                },
            )
        finally:
            await stop_task(pump, "an approval's proof reads")
            store.watch.unlisten_proofs(key, signal)

    async def _settled_by_proof(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult | None:
        """The decision of an answer proven but not applied yet (applied now), or None."""
        try:
            if await self._proofs.apply(store, label, options):
                got = await store.get(label)
                if got is not None:
                    return await self._answers.from_record(
                        result, got[0], options, store, remember=True
                    )
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("approval %r: proofs unreadable at the end of the wait (%s)", label, exc)
        return None

    async def _callers_deadline(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """The caller's deadline ended the wait: an answer that landed meanwhile decides;
        otherwise deny and leave the approval pending (never its default: the human was not
        silent for the approval's time), so a retry of the call gets the answer."""
        decision = await self._settled_by_proof(result, label, options, store)
        if decision is not None:
            return decision
        try:
            got = await store.get(label)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("approval %r could not be read at the caller's deadline (%s)", label, exc)
            got = None
        decision = (
            None if got is None else await self._answers.from_record(result, got[0], options, store)
        )
        if decision is not None:
            return decision
        return decided(
            result, allow=False,
            reason=f"{CALLERS_DEADLINE}; the approval stays pending: the same call retried"
            " (same idempotency key) gets its answer",
        )  # fmt: skip

    async def _timed_out(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """Close the approval; if an answer won the race (or is proven), it decides, not
        the clock. The default decides only once this close is stored (then no answer can
        win): a close that could not be stored, a record settled but unreadable, or gone,
        denies, since a human's answer may be there unseen."""
        decision = await self._settled_by_proof(result, label, options, store)
        if decision is not None:
            return decision
        reason = f"{TIMED_OUT}{result.approval_timeout}s; default {result.approval_default}"
        try:
            await store.cancel_hook(label, reason=f"{reason} applied")
        except AlreadySettledError:
            got = await store.get(label)
            decision = (
                None
                if got is None
                else await self._answers.from_record(result, got[0], options, store)
            )
            if decision is not None:
                return decision
            why = "it was settled meanwhile and is unreadable"
        except SuspensionNotFoundError:
            why = "its record is gone"
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            why = f"it could not be closed ({exc})"
        else:
            return decided(result, allow=result.approval_default == "allow", reason=reason)
        log.warning("approval %r timed out, but %s: denied, whatever its default", label, why)
        return decided(
            result, allow=False,
            reason=f"{TIMED_OUT}{result.approval_timeout}s, but {why}: whether a human answered"
            " is unknown; denied",
        )  # fmt: skip


def _out_of_time(exc: BaseException) -> bool:
    """Whether `exc` is the store giving up at the caller's deadline (`caller_deadline`):
    the store could not be reached in time (the caller records that failure), not a
    question this dispatcher may not ask."""
    return isinstance(exc, HookbusTimeoutError) and caller_bound().passed()
