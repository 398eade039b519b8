"""Approvals: a handler's ``ask_user`` result becomes a durable approval suspension.

amplifier-core's `HookResult` carries the question (`approval_prompt`), the choices
(`approval_options`, default ``["Allow", "Deny"]``), how long to wait (`approval_timeout`,
seconds) and what to do then (`approval_default`). hookbus turns that into a suspension
whose metadata carries them; the emit waits for an `ApprovalAnswer` and returns continue or
deny.

**Which answers allow.** The options a handler lists in `approval_allow_options` (hookbus's
field), else those starting with "allow" (any case); every other option denies. A question
whose options offer no allowing answer is denied without asking anyone (the reason says so,
and a warning is logged): a made-up refusal is never reported as a human's.

**Every asker is asked.** When several handlers answer ``ask_user`` for one call, each
handler's question is asked (or allowed by that handler's own grant), one after the other in
priority order: the first refusal denies, and the call goes on only when every question was
allowed (`joined_decision`).

**What ends a wait.** The approval's own `approval_timeout` applies `approval_default` and
closes the approval. The caller's deadline (``emit(..., timeout_s=...)``) ending the wait
first is not the human's silence: the call is denied and the approval stays pending, so a
retry of the call (same idempotency key) gets its answer. A caller that knows its wait
(a door: ``emit(..., approval_timeout_s=...)``) cuts the approval's timeout to it instead,
so the approval ends, closed, within that wait; a cut that shortens the wait applies deny
where the default is allow (only the handler's full timeout allows by default).

**An approval nobody waits for ends at its own timeout.** Its asker gone (a caller's
deadline, a stopped emit, a crashed dispatcher), a pending approval is ended by whoever
next reads it past ``timeout_s`` plus `EXPIRY_MARGIN_S` and may write the record (an
approver's `ApprovalsClient` on an open server, the console, ``hookbus approvals``, an
answer to it, the dispatcher service's expiry sweep): a proven answer written before that
decides as usual, else the record is
closed by compare-and-set on the revision it judged, with the asker's own reason ("timed
out after ...; default ... applied"), so a retry of the call gets the default. The age is
the server's: the time JetStream stamped on the record's current revision against the
time it reports now (``STREAM.INFO``), never the record's ``created_at`` (the asker's wall
clock) nor the reader's. An approval without a timeout never expires; `cancel` ends one by
hand: the approver's cancel proof (kind ``"cancel"``, same key as its answer), which the
decider applies as it applies answers, closing the record with the reason ``"by
<approver>[: <reason>]"`` (the call is denied "approval cancelled: by ...").

**One approval per call and asker.** The label is derived from the call: event, agent, session,
handler, the call's id (the caller's idempotency key, else the emit's own random id) and
its data (without the timestamp). A retry of the same call (same key, e.g. after a lost
reply or a dispatcher restart) finds its approval and its answer: a refusal, a timeout or
an "Allow always" decides it again without asking; a new call, even an identical one,
asks anew; a decided approval (answered, cancelled, timed out) never decides another call,
and a key reused for other data does not reuse the answer. An answer that won the
compare-and-set is applied whatever the clock says: on timeout the approval is cancelled,
and if that cancel loses to an answer, the answer wins.

**An "Allow once" allows once.** Every allowing answer other than "Allow always"
(`uses_up`) is used up by the first decision it allows: that decider marks the record
(`SuspensionRecord.used_by`, a compare-and-set reconciled after a lost ack, so of two
dispatchers deciding the same call at once exactly one allows, and a mark whose outcome
stays unknown allows nothing). A later decision of the same call (a resumed run, a retry
with the same idempotency key, the loser of that race) asks again, in a fresh approval
whose label follows from the used one (`next_approval_label`), with fresh answers.

**Who decides.** Approval records live in `APPROVALS_BUCKET` (``<agent>.<label>``, the
same keys as suspensions), written only by the dispatcher that asks and waits (the decider:
an embedded dispatcher on an open server, the dispatcher service on a secured one, where an
agent's own NATS user may not write there: its question is then denied at once, "approval
not asked"). An approver writes only its answer proof ``<agent>.<label>.<approver>``
(`Approvals.answer`, or its cancel, `Approvals.cancel`); the decider settles the record
from the FIRST proof in stream order that is a cancel or whose choice is one of the
options (two deciders take the same one), also when the proof was written while nobody
waited (a retry or a restarted dispatcher resumes the approval and applies it). A
resolution without a matching proof still decides nothing. An agent may have at most
`Approvals.max_pending` pending approvals; beyond them a question is denied with a reason
starting ``quota:``. Records live the bucket's TTL (7 days, the longest approval).

**"Allow always"** makes the decider store an `ApprovalGrant` in `APPROVALS_BUCKET` under
`grant_key` (agent, session, event, handler, tool), with its lineage: the approval's label,
the approver (``approved_by``) and ``expires_at`` (the answer's time plus the grant
lifetime, 24 h by default). It allows every later call of that tool **with any input** by
the same agent in the same session when the same handler asks (another handler's question
about the same call is still asked), until it expires or is revoked
(`Approvals.grants.revoke`, ``hookbus approvals revoke``). Each use verifies it again: the
approver's proof of that approval holds the grant's choice, that choice allows and is an
"Allow always" by the approval's ``allow_options``, and the approval was about the grant's
scope; a grant that fails is ignored (logged) and the human is asked. The allowed result
names the approver (``approved_by``). Only an "Allow always" that allows stores one. A call
without a session id is never remembered: "Allow always" then allows that call only, and
the reason says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import logging
import math
import time
import uuid
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.api
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus._core.buckets import approvals_bucket_config
from hookbus._core.jetstream import bind_key_value, caller_deadline, time_left
from hookbus._core.kv import kv_retry, open_bucket
from hookbus._core.tasks import stop_task
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    APPROVALS_BUCKET,
    AlreadySettledError,
    ApprovalAnswer,
    ApprovalGrant,
    BadRequestError,
    HookbusError,
    HookbusTimeoutError,
    HookResult,
    ResolutionRejectedError,
    SuspensionCancelledError,
    SuspensionError,
    SuspensionNotFoundError,
    SuspensionRecord,
    SuspensionTimeoutError,
    approval_answer_key,
    decode,
    encode,
)
from hookbus.schemas import telemetry as tn

from ._grants import Grants
from ._pending_quota import PendingQuota
from ._proofs import first_proof, write_proof
from ._records import RecordStore
from ._suspension_events import publish
from ._suspensions import Suspensions

__all__ = [
    "APPROVAL_LABEL_PREFIX",
    "EXPIRY_MARGIN_S",
    "AnswerNotAppliedError",
    "ApprovalGrant",
    "Approvals",
    "allowing_options",
    "allows",
    "approval_label",
    "is_allow",
    "joined_decision",
    "next_approval_label",
    "uses_up",
]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

APPROVAL_LABEL_PREFIX = "approval:"
"""Every approval suspension's label starts with this (``hookbus approvals`` lists them)."""

_MIN_READ_S = 0.5
"""A grant read gets at least this many seconds, even for an approval with a shorter timeout."""

_TIMED_OUT = "timed out after "
"""How the cancel reason of an approval closed by its timeout starts."""

EXPIRY_MARGIN_S = 5.0
"""Seconds past its ``timeout_s`` (by the server's clock) a pending approval nobody closed
is ended by a reader (`Approvals.end_if_overdue`): its asker, if alive, closes it first."""

NO_ALLOWING_OPTION = "offer no allowing answer"
"""Words of the reason of a deny decided because none of a question's options allows."""

NOT_ASKED = "approval not asked"
"""How the reason of a deny starts when the approval record could not be written (e.g. an
agent's own dispatcher on a secured server, where approvals are asked through the
dispatcher service)."""

SETTLE_READS_S = 0.5
"""Seconds the reads at the caller's deadline (an answer that landed meanwhile decides)
may take past it."""

CALLERS_DEADLINE = "the caller's deadline ended the wait before an answer"
"""How the reason of a deny decided by the caller's deadline (not the approval's own
timeout) starts; the approval stays pending."""


def is_allow(choice: str) -> bool:
    """Whether an approval choice allows the call by the default rule: it starts with
    "allow", any case ("Allow", "Allow once", "Allow always"). A handler's
    `HookResult.approval_allow_options` replaces this rule for its question."""
    return choice.strip().lower().startswith("allow")


def allows(choice: str, allow_options: list[str] | None) -> bool:
    """Whether `choice` allows the call: it is one of `allow_options` (exact text), or,
    when those are None, it passes `is_allow`."""
    return is_allow(choice) if allow_options is None else choice in allow_options


def allowing_options(options: list[str], allow_options: list[str] | None) -> list[str]:
    """The offered `options` that allow (see `allows`), in their order; empty when no
    answer could allow."""
    return [o for o in options if allows(o, allow_options)]


def _is_always(choice: str) -> bool:
    return choice.strip().lower() == "allow always"


def uses_up(choice: str, allow_options: list[str] | None) -> bool:
    """Whether `choice` allows one decision only: it allows (see `allows`) and is not
    "Allow always" (any case). The first decision it allows marks its approval used; the
    same call decided again is asked again."""
    return allows(choice, allow_options) and not _is_always(choice)


MAX_APPROVAL_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest approval wait, in seconds (a handler's `approval_timeout` is clamped to it)."""


def _clamp(timeout_s: float | None, longest: float = MAX_APPROVAL_TIMEOUT_S) -> float | None:
    """A handler's `approval_timeout` within [0, `longest`] (NaN: 0; None: `longest` when
    that is below `MAX_APPROVAL_TIMEOUT_S`, else None, no limit)."""
    if timeout_s is None:
        return longest if longest < MAX_APPROVAL_TIMEOUT_S else None
    if not timeout_s >= 0:  # negative or NaN
        return 0.0
    return min(float(timeout_s), longest)


def _cut(result: HookResult, most_s: float, callers_s: float | None) -> HookResult:
    """`result` with its ``approval_timeout`` within `most_s` (`Approvals.max_timeout_s`) and
    the caller's `callers_s` (seconds; None: no cut). When the caller's cut shortens the
    wait, an ``approval_default`` of ``"allow"`` becomes ``"deny"``: a caller that waits less
    than the handler asked for never turns the handler's silence window into an allow."""
    own = _clamp(result.approval_timeout, most_s)
    if callers_s is None:
        return msgspec.structs.replace(result, approval_timeout=own)
    cut = _clamp(own, callers_s)
    shortened = cut is not None and (own is None or cut < own)
    default = "deny" if shortened else result.approval_default
    return msgspec.structs.replace(result, approval_timeout=cut, approval_default=default)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def approval_label(event: str, data: dict[str, Any], handler: str, *, call_id: str) -> str:
    """The label of the approval of one call: ``approval:<32 hex digits>``.

    A digest of the event, ``data["agent_id"]``, ``data["session_id"]``, the handler, the
    call's id (`call_id`: the caller's idempotency key, else the emit's own id) and the
    data without ``timestamp``. Same call (a retry) -> same label; another call id or
    other data -> another label.
    """
    stable = {k: v for k, v in data.items() if k != "timestamp"}
    agent, session = _text(data.get("agent_id")), _text(data.get("session_id"))
    digest = hashlib.sha256(encode([event, agent, session, handler, call_id, stable]))
    return f"{APPROVAL_LABEL_PREFIX}{digest.hexdigest()[:32]}"


def next_approval_label(label: str) -> str:
    """The label of the fresh approval asked once approval `label`'s one-time allow was
    used (``approval:<32 hex digits>``): the same call decided again gets it, and the one
    after that ``next_approval_label`` of it, and so on."""
    digest = hashlib.sha256(encode(["again", label]))
    return f"{APPROVAL_LABEL_PREFIX}{digest.hexdigest()[:32]}"


class _UsedUp(Exception):
    """The approval's one-time allow was used by another decision (internal): ask again."""


class AnswerNotAppliedError(HookbusTimeoutError):
    """An approver's answer is recorded (its proof exists) but no dispatcher applied it to
    the approval in time: it decides when the agent's dispatcher (or the dispatcher
    service) next reads the approval, unless another approver's answer came first."""


class Approvals:
    """Turns ``ask_user`` results into answers (see the module docstring). Made by
    `HookDispatcher.start`.

    Args:
        records: the approval records: a `Suspensions` store over `APPROVALS_BUCKET` (the
            records ``<agent>.<label>``, the approvers' proofs ``<agent>.<label>.<p>`` and
            the grants share that bucket; the store ignores proofs and grants).
        grants: the approvals bucket (the grants' key-value view of it).
        grant_read_s: longest time, in seconds, a grant read or write retries through a
            JetStream leader election (a read: never longer than the approval's own
            timeout, but at least 0.5 s); after that the human is asked (a read) or the
            grant is not stored and the reason says so (a write).
        grant_ttl_s: seconds an "Allow always" grant allows from its answer (its
            ``expires_at``, checked when it is read).
        answer_wait_s: seconds `answer` waits for a dispatcher to apply the answer.
        max_pending: pending approvals one agent may have at once (None: no limit); a
            question beyond it is denied with a reason starting ``quota:``.
        proof_poll_s: seconds between reads of a waited-on approval's proofs besides the
            watch's signals.
    """

    def __init__(
        self,
        records: Suspensions,
        grants: KeyValue,
        *,
        grant_read_s: float = 15.0,
        grant_ttl_s: float = 24 * 3600,
        answer_wait_s: float = 5.0,
        max_pending: int | None = 16,
        proof_poll_s: float = 2.0,
    ) -> None:
        self.records = records
        """The approval records (list: ``records.page(status="pending")``)."""
        self.grants = Grants(grants)
        """The "Allow always" grants: list, revoke."""
        self._grant_read_s = grant_read_s
        self.grant_ttl_s = grant_ttl_s
        self.answer_wait_s = answer_wait_s
        self.max_pending = max_pending
        self._quota = (
            None if max_pending is None else PendingQuota(max_pending, self._count_pending)
        )
        self._proof_poll_s = proof_poll_s
        self.closes_records = True
        """Whether `end_if_overdue` (from `answer`) writes the record it closes (False:
        credentials that may not write approval records only judge)."""
        self.max_timeout_s = MAX_APPROVAL_TIMEOUT_S
        """Longest approval wait, seconds: a handler's ``approval_timeout`` is cut to it (a
        door that waits less than a handler's timeout sets it, so every approval it asks
        ends, with its ``approval_default``, within the door's wait)."""
        self._own_agent_secured = False  # an agent's own store on a secured server

    @classmethod
    async def open(
        cls,
        nc: NATS,
        suspensions: Suspensions,
        *,
        replicas: int = 1,
        grant_ttl_s: float = 24 * 3600,
        answer_wait_s: float = 5.0,
        max_pending: int | None = 16,
        js_domain: str | None = None,
    ) -> Approvals:
        """Open (create if absent) the approvals bucket, and a record store over it for
        `suspensions`' agent (same scope, same waiter lease), in the JetStream domain
        `js_domain` (None: the one bound to `nc`, else the connection's own JetStream).

        An agent's own dispatcher (a scoped store) on a server that requires
        authentication binds the bucket without reading its configuration (its NATS user
        may only get its own keys there) and gets 3 s, not 15, per approval write: there
        it may not write approval records (they are asked through the dispatcher service),
        and a refused write must deny promptly.
        """
        info = getattr(nc, "_server_info", None) or {}
        secured = bool(info.get("auth_required"))
        if suspensions.records.scoped and secured:  # an agent: it may only get its own keys
            kv = bind_key_value(nc, APPROVALS_BUCKET, js_domain=js_domain, direct=True)
        else:
            kv = await open_bucket(
                nc, approvals_bucket_config(replicas=replicas), js_domain=js_domain
            )
        deadline = 3.0 if suspensions.records.scoped and secured else 15.0
        store = Suspensions(
            nc, kv, leases=suspensions.leases, agent_id=suspensions.agent_id,
            scoped=suspensions.records.scoped, write_deadline_s=deadline,
        )  # fmt: skip
        approvals = cls(
            store, kv, grant_ttl_s=grant_ttl_s, answer_wait_s=answer_wait_s,
            max_pending=max_pending,
        )  # fmt: skip
        approvals._own_agent_secured = deadline < 15.0
        approvals.closes_records = not approvals._own_agent_secured
        return approvals

    async def close(self) -> None:
        """Stop the approval store's watch (the lease is the suspension store's)."""
        await self.records.close(leases=False)

    async def decide(
        self,
        event: str,
        result: HookResult,
        *,
        call_id: str,
        wait_s: float | None = None,
        longest_s: float | None = None,
    ) -> HookResult:
        """Ask, wait, and fold the answer into `result`: continue or deny.

        Args:
            event: the emitted event.
            result: one folded ``ask_user`` result (``decided_by`` is the asking handler).
            call_id: the call's id: the caller's idempotency key, else the emit's own id.
            wait_s: seconds the caller still waits (its deadline), None: no deadline. When it
                ends the wait before the approval's own timeout, the call is denied and the
                approval stays pending; it never applies `approval_default`. Every store
                read and write of the question (grants, the record, its creation, the
                waiter lease) ends by then; the reads that look for an answer landed
                meanwhile take at most `SETTLE_READS_S` more.
            longest_s: seconds this approval may wait at most (the emit's
                ``approval_timeout_s``): the handler's ``approval_timeout`` is cut to it,
                and its end applies ``approval_default``, except that a default of
                ``"allow"`` becomes ``"deny"`` when the cut shortened the wait (only the
                handler's own full timeout may allow by default; a caller cannot hurry
                it). None: no cut besides `max_timeout_s`.
        Returns:
            `result` with ``action`` continue or deny and the ``reason``: a grant, the
            human's choice, the timeout's `approval_default`, a cancel (deny), options that
            offer no allowing answer (deny, nobody asked), the agent's pending approvals
            over `max_pending` (deny, ``quota: ...``), an approval record this dispatcher
            may not write (deny) or the caller's deadline (deny).
        Raises:
            SuspensionAbortedError: the wait was aborted (a draining dispatcher); the approval
                stays pending and a retry with the same call id resumes it.
            HookbusError: the approval store failed while waiting (e.g.
                `HookbusTimeoutError`: JetStream stayed unavailable); a grant store failure
                only means the human is asked.
        """
        with caller_deadline(wait_s):
            return await self._decide(
                event, result, call_id=call_id, wait_s=wait_s, longest_s=longest_s
            )

    async def _decide(
        self, event: str, result: HookResult, *, call_id: str, wait_s: float | None,
        longest_s: float | None,
    ) -> HookResult:  # fmt: skip
        started = time.monotonic()
        handler = result.decided_by or "?"
        result = _cut(result, self.max_timeout_s, longest_s)
        options = list(result.approval_options or APPROVAL_DEFAULT_OPTIONS)
        allowing = allowing_options(options, result.approval_allow_options)
        if not allowing:
            return self._no_allowing_option(event, result, handler, options)
        budget = min(
            x for x in (self._grant_read_s, result.approval_timeout, wait_s) if x is not None
        )
        granted = await self._granted(event, result, handler, budget_s=max(budget, _MIN_READ_S))
        if granted is not None:
            return granted
        data = _call_data(result)
        store = self.records.for_agent(_text(data.get("agent_id")))
        label = approval_label(event, data, handler, call_id=call_id)
        while True:
            try:
                return await self._decide_at(
                    event, result, handler, options, allowing, store, label, started, wait_s
                )
            except _UsedUp:  # its "Allow once" went to another decision: ask afresh
                now = time.monotonic()
                if wait_s is not None:
                    wait_s = max(0.0, wait_s - (now - started))
                    if wait_s <= 0:
                        return self._answer(
                            result, allow=False,
                            reason=f"{CALLERS_DEADLINE}: its one-time allow was used by"
                            " another decision, and no time is left to ask again",
                        )  # fmt: skip
                started = now
                label = next_approval_label(label)

    async def _decide_at(
        self,
        event: str,
        result: HookResult,
        handler: str,
        options: list[str],
        allowing: list[str],
        store: Suspensions,
        label: str,
        started: float,
        wait_s: float | None,
    ) -> HookResult:
        """Decide by the approval `label` (asked, taken over, or read: see `_decide`).
        Raises `_UsedUp` when its one-time allow went to another decision."""
        try:
            got = await store.get(label)  # a retry of this call finds its approval
        except HookbusError as exc:
            if _out_of_time(exc):
                raise
            return self._not_asked(result, exc)
        if got is not None and got[0].used_by:
            raise _UsedUp
        reserved = False
        if got is not None:
            decided = await self._from_record(result, got[0], options, store)
            if decided is not None:
                return decided
        else:
            over = await self._over_quota(store)
            if over is not None:
                return self._answer(result, allow=False, reason=over)
            reserved = self._quota is not None and not self._own_agent_secured
        try:
            return await self._asked(event, result, handler, options, allowing, store,
                                     label, started, wait_s, got)  # fmt: skip
        finally:
            if reserved and self._quota is not None:
                self._quota.release(store.agent_id)

    async def _asked(
        self,
        event: str,
        result: HookResult,
        handler: str,
        options: list[str],
        allowing: list[str],
        store: Suspensions,
        label: str,
        started: float,
        wait_s: float | None,
        got: tuple[SuspensionRecord, int] | None,
    ) -> HookResult:
        """Ask (or take over, `got`) the approval `label` and decide from its answer."""
        remaining = _approval_left(result.approval_timeout, started)
        caller_left = None if wait_s is None else max(0.0, wait_s - (time.monotonic() - started))
        cut = caller_left is not None and (remaining is None or caller_left < remaining)
        metadata = _metadata(event, result, handler, options, allowing)
        try:
            answer = await self._wait(store, label, metadata, caller_left if cut else remaining)
        except SuspensionTimeoutError:
            if cut:  # past the caller's deadline: a few reads only
                with caller_deadline(SETTLE_READS_S, extend=True):
                    return await self._callers_deadline(result, label, options, store)
            return await self._timed_out(result, label, options, store)
        except SuspensionCancelledError as exc:
            return self._cancelled(result, exc.reason)
        except SuspensionError:
            raise
        except HookbusError as exc:
            if got is None and not _out_of_time(exc):  # the approval could not be asked
                return self._not_asked(result, exc)
            raise
        return await self._answered(result, answer, options, store, label)

    def _not_asked(self, result: HookResult, exc: BaseException) -> HookResult:
        """The deny of a question whose approval record could not be written or read."""
        log.warning("approval not asked: the approval record could not be written (%s)", exc)
        return self._answer(
            result, allow=False,
            reason=f"{NOT_ASKED}: this dispatcher could not write the approval record"
            f" ({type(exc).__name__}); on a secured server an agent's approvals are asked"
            " through the dispatcher service",
        )  # fmt: skip

    async def _over_quota(self, store: Suspensions) -> str | None:
        """The deny reason when `store`'s agent already has `max_pending` live pending
        approvals (`PendingQuota`: those this process asks, and one shared count of the
        agent's keys of the approvals bucket), else None: then room is reserved."""
        if self._quota is None or self._own_agent_secured:
            return None  # none, or the agent may not create approvals at all: no count
        left = time_left(math.inf)  # the count is shared: only this wait for it is cut
        try:
            async with asyncio.timeout(None if left == math.inf else left):
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
            self.records.records.kv, deadline_s=self._grant_read_s, agent_id=agent_id,
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
        return self._answer(
            result, allow=False,
            reason=f"handler {handler!r} asked with options {options}, which"
            f" {NO_ALLOWING_OPTION} ({rule}): denied without asking anyone",
        )  # fmt: skip

    async def _granted(
        self, event: str, result: HookResult, handler: str, *, budget_s: float
    ) -> HookResult | None:
        """The allow of a verified "Allow always" grant for this handler's question, or None
        (no session, no grant, a grant that fails `_grant_problem`, or the approvals bucket
        failed: then the human is asked)."""
        data = _call_data(result)
        tool = _text(data.get("tool_name"))
        session, agent = _text(data.get("session_id")), _text(data.get("agent_id"))
        if session is None:
            return None
        try:
            grant = await self.grants.find(agent, session, event, handler, tool, budget_s=budget_s)
            problem = None if grant is None else await self._grant_problem(grant, budget_s)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            # unavailable or refused: ask the human, never allow by accident
            log.warning("grant read failed (%s); asking instead", exc)
            return None
        if grant is None:
            return None
        if problem is not None:
            log.warning(
                "ignoring the grant %s: %s; asking instead", Grants.key(grant)[:200], problem
            )
            return None
        decided = self._answer(
            result, allow=True,
            reason=f"allowed always for {tool or 'this call'} in session {session}"
            f" (granted by {grant.approved_by} in {grant.label})",
        )  # fmt: skip
        return msgspec.structs.replace(decided, approved_by=grant.approved_by)

    async def _grant_problem(self, grant: ApprovalGrant, budget_s: float) -> str | None:
        """Why `grant` allows nothing (None: it holds). It must be live (``expires_at``),
        name the approval it came from and its approver, that approver's proof must hold
        its choice, the choice must allow and be an "always" one by the approval record's
        ``allow_options``, and the record must be about the grant's scope."""
        if grant.expires_at is None or grant.expires_at <= time.time():
            return "it has expired" if grant.expires_at else "it carries no expiry"
        if not grant.label or not grant.approved_by:
            return "it names no approval or no approver"
        store = self.records.for_agent(grant.agent_id)
        got = await store.get(grant.label)
        if got is None or got[0].metadata.get("kind") != "approval":
            return f"no approval {grant.label!r} is on record"
        meta = got[0].metadata
        scope = {"event": grant.event, "handler": grant.handler, "tool_name": grant.tool,
                 "session_id": grant.session_id, "agent_id": grant.agent_id}  # fmt: skip
        differs = [k for k, v in scope.items() if meta.get(k) != v]
        if differs:
            return f"approval {grant.label!r} was about another {', '.join(differs)}"
        proof = await self._proof(store, grant.label, grant.approved_by, budget_s)
        if isinstance(proof, str):
            return proof
        if proof.choice != grant.choice:
            return f"{grant.approved_by!r} answered {proof.choice!r}, not {grant.choice!r}"
        if not (_record_allows(got[0], proof.choice) and _is_always(proof.choice)):
            return f"{proof.choice!r} is not an allowing 'Allow always' answer"
        return None

    async def _wait(
        self, store: Suspensions, label: str, metadata: dict[str, Any], timeout_s: float | None
    ) -> ApprovalAnswer:
        """Create (or take over) the approval `label` and wait `timeout_s` seconds (None:
        no limit) for its answer, resolving it from the first approver's proof meanwhile
        (`_apply_proofs`). Raises as `Suspensions.hook`."""
        options = metadata["options"]
        key = store.records.key(label)
        signal = store.watch.listen_proofs(key)
        pump = asyncio.get_running_loop().create_task(
            self._pump(store, label, options, signal), name=f"proofs of {label}"
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

    async def _pump(
        self, store: Suspensions, label: str, options: list[str], signal: asyncio.Event
    ) -> None:
        """While the approval is waited on: at once, at each proof the watch delivers, and
        every `proof_poll_s` seconds, resolve it from its first valid proof."""
        while True:
            signal.clear()
            try:
                if await self._apply_proofs(store, label, options):
                    return
            except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
                log.info("approval %r: proofs not read (%r); trying again", label, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._proof_poll_s):
                    await signal.wait()

    async def _apply_proofs(self, store: Suspensions, label: str, options: list[str]) -> bool:
        """Resolve the pending approval `label` with its first proof in stream order whose
        choice is one of `options` (compare-and-set: another decider applying the same
        proofs writes the same answer). True once it is settled (by this or anyone)."""
        got = await store.get(label)
        if got is None:
            return False
        if got[0].status != "pending":
            return True
        answer = await first_proof(
            store.records.kv, store.records.key(label),
            lambda key, value: _valid_answer(key, value, label, store.agent_id, options),
            deadline_s=self._grant_read_s,
        )  # fmt: skip
        if answer is None:
            return False
        with contextlib.suppress(AlreadySettledError):  # answered or closed meanwhile
            if answer.kind == "cancel":  # an approver's proven cancel: closed, the call denied
                await store.cancel_hook(label, reason=cancel_reason(answer))
            else:
                await store.resolve_hook(label, msgspec.to_builtins(answer))
        return True

    async def _settled_by_proof(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult | None:
        """The decision of an answer proven but not applied yet (applied now), or None."""
        try:
            if await self._apply_proofs(store, label, options):
                got = await store.get(label)
                if got is not None:
                    return await self._from_record(result, got[0], options, store, remember=True)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("approval %r: proofs unreadable at the end of the wait (%s)", label, exc)
        return None

    async def _callers_deadline(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """The caller's deadline ended the wait: an answer that landed meanwhile decides;
        otherwise deny and leave the approval pending (never its default: the human was not
        silent for the approval's time), so a retry of the call gets the answer."""
        decided = await self._settled_by_proof(result, label, options, store)
        if decided is not None:
            return decided
        try:
            got = await store.get(label)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("approval %r could not be read at the caller's deadline (%s)", label, exc)
            got = None
        decided = None if got is None else await self._from_record(result, got[0], options, store)
        if decided is not None:
            return decided
        return self._answer(
            result, allow=False,
            reason=f"{CALLERS_DEADLINE}; the approval stays pending: the same call retried"
            " (same idempotency key) gets its answer",
        )  # fmt: skip

    async def _timed_out(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """Close the approval; if an answer won the race (or is proven), it decides, not
        the clock."""
        decided = await self._settled_by_proof(result, label, options, store)
        if decided is not None:
            return decided
        reason = f"{_TIMED_OUT}{result.approval_timeout}s; default {result.approval_default}"
        try:
            await store.cancel_hook(label, reason=f"{reason} applied")
        except AlreadySettledError:
            got = await store.get(label)
            decided = (
                None if got is None else await self._from_record(result, got[0], options, store)
            )
            if decided is not None:
                return decided
            log.warning("approval %r settled but unreadable after its timeout", label)
        except SuspensionNotFoundError:
            log.warning("approval %r vanished at its timeout; default applied", label)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning(
                "approval %r could not be closed at its timeout (%s); default %s applied and a"
                " later answer is ignored by this call", label, exc, result.approval_default,
            )  # fmt: skip
        return self._answer(result, allow=result.approval_default == "allow", reason=reason)

    def _cancelled(self, result: HookResult, reason: str | None) -> HookResult:
        if reason is not None and reason.startswith(_TIMED_OUT):  # closed by its own timeout
            return self._answer(
                result,
                allow=result.approval_default == "allow",
                reason=reason.removesuffix(" applied"),
            )
        return self._answer(result, allow=False, reason=f"approval cancelled: {reason}")

    async def _from_record(
        self,
        result: HookResult,
        record: SuspensionRecord,
        options: list[str],
        store: Suspensions,
        *,
        remember: bool = False,
    ) -> HookResult | None:
        """The decision a settled approval record holds (None while it is pending).
        `remember`: the answer was just applied, store its grant (a record read again,
        e.g. by a retry, never re-creates a grant that was revoked since)."""
        if record.status == "cancelled":
            return self._cancelled(result, record.reason)
        if record.status != "resolved":
            return None
        try:
            answer = msgspec.convert(record.resolution, ApprovalAnswer)
        except msgspec.ValidationError as exc:
            return self._answer(result, allow=False, reason=f"the stored answer is invalid: {exc}")
        return await self._answered(result, answer, options, store, record.label, remember=remember)

    async def _answered(
        self,
        result: HookResult,
        answer: ApprovalAnswer,
        options: list[str],
        store: Suspensions,
        label: str,
        *,
        remember: bool = True,
    ) -> HookResult:
        choice = answer.choice
        if choice not in options:
            return self._answer(
                result, allow=False, reason=f"answer {choice!r} is not one of the options {options}"
            )
        problem = await self._unproven(answer, store, label)
        if problem is not None:
            log.warning("approval %r: answer refused: %s", label, problem)
            return self._answer(result, allow=False, reason=f"answer refused: {problem}")
        allow = allows(choice, result.approval_allow_options)
        if allow and uses_up(choice, result.approval_allow_options):
            if not await self._use(store, label):
                raise _UsedUp
        reason = f"{answer.answered_by} chose {choice!r}"
        session = _text(_call_data(result).get("session_id"))
        if allow and _is_always(choice) and session is None:
            reason += "; allowed this call only: the call has no session id to remember it for"
        elif allow and _is_always(choice) and remember:
            stored = await self._grant(result, answer, store, label)
            if stored is not None:
                reason += f"; {stored}"
        decided = self._answer(result, allow=allow, reason=reason)
        return msgspec.structs.replace(decided, approved_by=answer.answered_by)

    @staticmethod
    async def _use(store: Suspensions, label: str) -> bool:
        """Mark the resolved approval `label` used (`SuspensionRecord.used_by`, a
        compare-and-set on its revision): True when this decision's mark is stored, False
        when another decision used it first, or the record is gone or no longer resolved.
        A mark whose outcome stays unknown while the record was removed counts as not
        stored (`RecordStore` reconciles): a one-time allow is never handed out twice.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable (the outcome is unknown:
                the caller denies).
        """
        use = uuid.uuid4().hex
        while True:
            got = await store.get(label)
            if got is None:
                return False
            record, revision = got
            if record.used_by or record.status != "resolved":
                return False
            used = msgspec.structs.replace(record, used_by=use)
            if await store.records.swap(used, last=revision, if_deleted="lost") is not None:
                return True

    async def _unproven(self, answer: ApprovalAnswer, store: Suspensions, label: str) -> str | None:
        """Why `answer` is not an approver's (None: its proof holds the same choice).

        The proof is the key ``<agent>.<label>.<approver>``, which only that approver's
        NATS user may write: a record resolved by anyone else (the agent itself included)
        carries no matching proof and decides nothing.
        """
        if not answer.answered_by:
            return "it names no approver"
        proof = await self._proof(store, label, answer.answered_by, self._grant_read_s)
        if isinstance(proof, str):
            return proof
        if proof.choice != answer.choice or proof.answered_by != answer.answered_by:
            return f"{answer.answered_by!r} answered {proof.choice!r}, not {answer.choice!r}"
        return None

    @staticmethod
    async def _proof(
        store: Suspensions, label: str, approver: str, budget_s: float
    ) -> ApprovalAnswer | str:
        """The proof of `approver` for `label` in `store`'s bucket, or why there is none."""
        try:
            key = approval_answer_key(label, store.agent_id, approver)
        except BadRequestError as exc:
            return str(exc)
        kv = store.records.kv

        async def get() -> bytes | None:
            try:
                return (await kv.get(key)).value or None
            except nats.js.errors.KeyNotFoundError:
                return None

        value = await kv_retry(get, deadline_s=budget_s, what=f"reading {key[:80]}")
        if value is None:
            return f"no answer of approver {approver!r} is on record"
        try:
            proof = decode(value, ApprovalAnswer)
        except HookbusError as exc:
            return f"the answer of approver {approver!r} is unreadable: {exc}"
        if proof.answered_by != approver:
            return f"the answer under approver {approver!r} names {proof.answered_by!r}"
        return proof

    async def end_if_overdue(
        self, label: str, *, agent_id: str | None, write: bool = True
    ) -> SuspensionRecord | None:
        """End the pending approval `label` of `agent_id` if nobody closed it within its
        ``timeout_s`` plus `EXPIRY_MARGIN_S`, by the server's clock (see the module
        docstring): a proven answer decides it, else it is closed with its default.

        Args:
            write: False: only judge (credentials that may not write the record, e.g. an
                approver's on a secured server): the returned record is the closed one it
                would write, not stored.
        Returns:
            The settled record (as stored, or as it would be with `write` False), or None:
            not an approval, not pending, no timeout, or not overdue.
        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        store = self.records.for_agent(agent_id)
        got = await store.get(label)
        if got is None or got[0].status != "pending" or got[0].metadata.get("kind") != "approval":
            return None
        record, revision = got
        timeout = record.metadata.get("timeout_s")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            return None
        age = await _server_age(store.records.kv, store.records.key(label), revision)
        if age is None or age < float(timeout) + EXPIRY_MARGIN_S:
            return None
        options = list(record.metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)
        default = record.metadata.get("default")
        reason = f"{_TIMED_OUT}{timeout}s; default {default} applied"
        closed = msgspec.structs.replace(
            record, status="cancelled", reason=reason, settled_at=time.time()
        )
        if not write:
            return closed
        if await self._apply_proofs(store, label, options):  # an answer came first: it decides
            again = await store.get(label)
            return None if again is None else again[0]
        if await store.records.swap(closed, last=revision) is None:  # settled meanwhile
            again = await store.get(label)
            return None if again is None else again[0]
        log.info("approval %r of agent %r expired: nobody waited past its %ss", label,
                 agent_id, timeout)  # fmt: skip
        await publish(store._nc, closed)  # the feed drops it from every console
        return closed

    async def answer(
        self,
        label: str,
        choice: str,
        *,
        agent_id: str | None,
        approver: str,
        wait_s: float | None = None,
    ) -> ApprovalAnswer:
        """Answer the pending approval `label` of agent `agent_id` as `approver`.

        The approver writes only its answer proof ``<agent>.<label>.<approver>`` (a key
        only this approver's NATS user may write); the dispatcher waiting on the approval
        (the decider) resolves the record from the first proof written, and stores the
        grant of an allowing "Allow always". This waits up to `wait_s` seconds (default
        `answer_wait_s`) for that.

        Returns:
            The answer that decided the approval (this one).
        Raises:
            SuspensionNotFoundError: no approval with this label for this agent.
            AlreadySettledError: it was answered (another approver's answer decided: the
                message names it), cancelled or timed out first, or this approver already
                answered it otherwise.
            ResolutionRejectedError: `choice` is not one of its options.
            BadRequestError: `approver` is empty or too long.
            AnswerNotAppliedError: the answer is recorded but no dispatcher applied it
                within the wait: it decides when the agent's dispatcher (or the
                dispatcher service) reads the approval.
            HookbusTimeoutError: JetStream stayed unavailable (or this client's NATS user
                may not write the proof: a refused publish is never acknowledged).
        """
        store = self.records.for_agent(agent_id)
        got = await store.get(label)
        if got is None or got[0].metadata.get("kind") != "approval":
            raise SuspensionNotFoundError(f"no approval {label!r} for agent {agent_id!r}")
        record = got[0]
        if record.status != "pending":
            raise AlreadySettledError(f"approval {label!r} is already {_settled(record)}")
        options = list(record.metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)
        if choice not in options:
            raise ResolutionRejectedError(f"choice {choice!r} is not one of the options {options}")
        ended = await self.end_if_overdue(label, agent_id=agent_id, write=self.closes_records)
        if ended is not None:
            raise AlreadySettledError(f"approval {label!r} is already {_settled(ended)}")
        answer = ApprovalAnswer(choice=choice, answered_by=approver, answered_at=time.time())
        return await self._prove(store, label, answer, wait_s)

    async def cancel(
        self,
        label: str,
        *,
        agent_id: str | None,
        approver: str,
        reason: str | None = None,
        wait_s: float | None = None,
    ) -> ApprovalAnswer:
        """End the pending approval `label` of agent `agent_id` without an answer, as
        `approver`: its waiting call (or a retry of it) is denied, "approval cancelled: by
        <approver>[: <reason>]".

        Like `answer`, the approver writes only its proof ``<agent>.<label>.<approver>``
        (kind ``"cancel"``); the decider closes the record from it (the first proof in
        stream order decides, a cancel or an answer). Waits up to `wait_s` seconds
        (default `answer_wait_s`) for that.

        Returns:
            The cancel proof that ended the approval.
        Raises:
            SuspensionNotFoundError: no approval with this label for this agent.
            AlreadySettledError: it was answered, cancelled or timed out first, or this
                approver already answered it.
            BadRequestError: `approver` is empty or too long.
            AnswerNotAppliedError: the cancel is recorded but no dispatcher applied it
                within the wait: it ends the approval when a dispatcher reads it.
            HookbusTimeoutError: JetStream stayed unavailable (or this client's NATS user
                may not write the proof).
        """
        store = self.records.for_agent(agent_id)
        got = await store.get(label)
        if got is None or got[0].metadata.get("kind") != "approval":
            raise SuspensionNotFoundError(f"no approval {label!r} for agent {agent_id!r}")
        if got[0].status != "pending":
            raise AlreadySettledError(f"approval {label!r} is already {_settled(got[0])}")
        ended = await self.end_if_overdue(label, agent_id=agent_id, write=self.closes_records)
        if ended is not None:
            raise AlreadySettledError(f"approval {label!r} is already {_settled(ended)}")
        proof = ApprovalAnswer(
            choice="", answered_by=approver, answered_at=time.time(), kind="cancel",
            reason=reason,
        )  # fmt: skip
        options = list(got[0].metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)
        return await self._prove(store, label, proof, wait_s, apply_with=options)

    async def _prove(
        self,
        store: Suspensions,
        label: str,
        proof: ApprovalAnswer,
        wait_s: float | None,
        *,
        apply_with: list[str] | None = None,
    ) -> ApprovalAnswer:
        """Write `proof` (an answer or a cancel) as its approver's, then wait for a decider
        to apply it (`_applied`). `apply_with` (the approval's options): when this client
        may write records (`closes_records`), apply the first proof itself first, so a
        cancel of an approval nobody waits for ends it at once."""
        key = approval_answer_key(label, store.agent_id, proof.answered_by or "")
        proof = await write_proof(store.records.kv, key, proof, deadline_s=self._grant_read_s)
        if apply_with is not None and self.closes_records:
            await self._apply_proofs(store, label, apply_with)
        return await self._applied(
            store, label, proof, self.answer_wait_s if wait_s is None else wait_s
        )

    async def _applied(
        self, store: Suspensions, label: str, answer: ApprovalAnswer, wait_s: float
    ) -> ApprovalAnswer:
        """Wait (at most `wait_s` seconds) until a decider settled `label`; see `answer`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        pause = 0.05
        while True:
            got = await store.get(label)
            record = None if got is None else got[0]
            if record is None:
                raise SuspensionNotFoundError(f"approval {label!r} vanished")
            if record.status == "cancelled":
                if answer.kind == "cancel" and record.reason == cancel_reason(answer):
                    return answer
                raise AlreadySettledError(f"approval {label!r} was {_settled(record)} first")
            if record.status == "resolved" and answer.kind == "cancel":
                raise AlreadySettledError(f"approval {label!r} was {_settled(record)} first")
            if record.status == "resolved":
                try:
                    won = msgspec.convert(record.resolution, ApprovalAnswer)
                except msgspec.ValidationError:
                    won = None
                if won is not None and (won.answered_by, won.choice) == (
                    answer.answered_by, answer.choice,
                ):  # fmt: skip
                    return won
                who = (
                    "an unproven answer"
                    if won is None
                    else (f"{won.answered_by}'s answer {won.choice!r}")
                )
                raise AlreadySettledError(f"approval {label!r} was decided first by {who}")
            if loop.time() >= deadline:
                what = "cancel" if answer.kind == "cancel" else f"answer {answer.choice!r}"
                raise AnswerNotAppliedError(
                    f"the {what} of {answer.answered_by} to approval {label!r}"
                    f" is recorded, but no dispatcher applied it within {wait_s:g} s:"
                    " it decides when the agent's dispatcher (or the dispatcher service) reads"
                    " the approval, unless another approver answered first"
                )
            await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
            pause = min(pause * 2, 0.5)

    async def _grant(
        self, result: HookResult, answer: ApprovalAnswer, store: Suspensions, label: str
    ) -> str | None:
        """Store the grant of an allowing "Allow always" `answer` to approval `label` (the
        decider's write, with its lineage); None when stored, else why not (for the
        reason)."""
        got = await store.get(label)
        if got is None:
            return "not remembered: the approval record is gone"
        meta = got[0].metadata
        session = _text(meta.get("session_id"))
        if session is None:
            return None  # nothing to remember it for; the reason says so
        now = time.time()  # the decider's clock, not the approver's answered_at
        grant = ApprovalGrant(
            agent_id=store.agent_id, session_id=session, event=str(meta.get("event") or "?"),
            handler=str(meta.get("handler") or "?"), tool=_text(meta.get("tool_name")),
            choice=answer.choice, label=label, granted_at=now,
            approved_by=answer.answered_by or "", expires_at=now + self.grant_ttl_s,
        )  # fmt: skip
        try:
            await self.grants.put(grant, budget_s=self._grant_read_s)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("grant of approval %r not stored (%s)", label, exc)
            return f"not remembered: the grant could not be stored ({type(exc).__name__})"
        return None

    @staticmethod
    def _answer(result: HookResult, *, allow: bool, reason: str) -> HookResult:
        """The decided result: an allow goes on with the call's data (``continue`` with
        the chained data, as a plain continue returns it); a deny keeps the asking
        handler's own data, as a deny does."""
        if not allow:
            return msgspec.structs.replace(result, action="deny", reason=reason)
        return msgspec.structs.replace(
            result, action="continue", reason=reason, data=result.chained_data
        )


def _valid_answer(
    key: str, value: bytes, label: str, agent_id: str | None, options: list[str]
) -> ApprovalAnswer | None:
    """The proof stored under `key` if it is a valid answer to approval `label`: it decodes,
    its approver is the one its key names, and its choice is one of `options`."""
    try:
        answer = decode(value, ApprovalAnswer)
        if not answer.answered_by:
            return None
        if approval_answer_key(label, agent_id, answer.answered_by) != key:
            return None
    except HookbusError:
        return None
    if answer.kind == "cancel":
        return answer
    return answer if answer.choice in options else None


def cancel_reason(proof: ApprovalAnswer) -> str:
    """The reason an approval closed by the cancel proof `proof` carries: ``"by
    <approver>"``, then ``": <reason>"`` when the cancel gave one."""
    return f"by {proof.answered_by}" + (f": {proof.reason}" if proof.reason else "")


def _settled(record: SuspensionRecord) -> str:
    """How a settled approval record was settled, for an error message."""
    if record.status == "cancelled" and record.reason:
        return f"cancelled ({record.reason})"
    if record.status == "resolved" and isinstance(record.resolution, dict):
        who, choice = record.resolution.get("answered_by"), record.resolution.get("choice")
        return f"resolved by {who or 'nobody named'}'s answer {choice!r}"
    return record.status


def joined_decision(asks: list[HookResult], decisions: list[HookResult]) -> HookResult:
    """One emit's decision from the decisions of its askers' questions.

    Args:
        asks: every ``ask_user`` of the emit, in priority order (`Fold.asks`).
        decisions: the decisions of the first ``len(decisions)`` of them, asked one after
            the other; the last is a deny or every ask was allowed.
    Returns:
        One asker: its decision. Several: amplifier-core's shape, the first ask's fields
        (as amplifier-core returns the first ``ask_user``). A deny: ``decided_by`` the
        handler whose question was refused, `reason` and ``approved_by`` of that refusal,
        the first ask's own data (a deny keeps it). Every question allowed: continue with
        the chained data, ``decided_by`` the first asker, the reasons as ``"<handler>:
        <reason>"`` joined by ``"; "``, ``approved_by`` every approver who allowed one (in
        order, once each, joined by ``", "``; None when grants allowed them all).
    """
    first, last = decisions[0], decisions[-1]
    if len(asks) == 1 or (len(decisions) == 1 and last.action != "continue"):
        return last
    if last.action != "continue":
        return msgspec.structs.replace(
            first, action="deny", data=asks[0].data, reason=last.reason,
            decided_by=last.decided_by, approved_by=last.approved_by, failures=last.failures,
        )  # fmt: skip
    approvers = list(dict.fromkeys(d.approved_by for d in decisions if d.approved_by))
    return msgspec.structs.replace(
        first,
        reason="; ".join(f"{d.decided_by}: {d.reason}" for d in decisions),
        approved_by=", ".join(approvers) or None,
        failures=last.failures,
    )


SERVER_CLOCK_TTL_S = 30.0
"""Seconds a reading of the server's clock (``STREAM.INFO``'s ``ts``) is carried forward on
this process's monotonic clock before it is read again (one request per 30 s, not one per
approval judged: a monotonic clock's rate is true to well under a second in that time)."""

_server_clocks: dict[tuple[str, str], tuple[datetime.datetime, float]] = {}
"""By (JetStream API prefix, stream): the server's time read and `time.monotonic()` then."""


async def _server_age(kv: KeyValue, key: str, revision: int) -> float | None:
    """Seconds, by the server's clock, since revision `revision` of `key` was written: the
    time JetStream stamped on the key's last message against the server's time now (read
    from ``STREAM.INFO``, carried forward `SERVER_CLOCK_TTL_S`). None: the key's last
    message is another revision (it changed meanwhile)."""
    js: Any = kv._js  # type: ignore[attr-defined]
    stream: str = kv._stream  # type: ignore[attr-defined]
    subject = f"{kv._pre}{key}"  # type: ignore[attr-defined]
    clock_key = (str(js._prefix), stream)

    async def read() -> float | None:
        last = await js.get_last_msg(stream, subject, direct=True)
        if last.seq != revision or last.time is None:
            return None
        read_at = _server_clocks.get(clock_key)
        if read_at is None or time.monotonic() - read_at[1] > SERVER_CLOCK_TTL_S:
            info = await js._nc.request(f"{js._prefix}.STREAM.INFO.{stream}", b"", timeout=2.0)
            server_now = nats.js.api.Base._parse_utc_iso(msgspec.json.decode(info.data)["ts"])
            read_at = _server_clocks[clock_key] = (server_now, time.monotonic())
        now = read_at[0] + datetime.timedelta(seconds=time.monotonic() - read_at[1])
        return (now - last.time).total_seconds()

    return await kv_retry(read, deadline_s=5.0, what=f"reading the age of {key[:80]}")


def _approval_left(timeout_s: float | None, started: float) -> float | None:
    """Seconds the approval still waits (None: no limit): `timeout_s` from `started` (a
    `time.monotonic` reading), on this process's clock only. A retry that resumes an
    approval another host asked waits its own timeout from the retry: the record's
    ``created_at`` is that host's wall clock, and no decision compares two hosts' clocks
    (one an hour ahead would apply the default at once). The asker, if alive, closes the
    approval at its own timeout, and the retry then gets that outcome."""
    if timeout_s is None:
        return None
    return max(0.0, timeout_s - (time.monotonic() - started))


def _metadata(
    event: str, result: HookResult, handler: str, options: list[str], allowing: list[str]
) -> dict[str, Any]:
    """The approval record's metadata (an `ApprovalMetadata`, every key written) for the
    question `result` of `handler` (its ``approval_timeout`` already clamped)."""
    data = _call_data(result)
    tool = _text(data.get("tool_name"))
    return {
        "kind": "approval",
        "prompt": result.approval_prompt or f"Allow {tool or 'this call'} ({event})?",
        "options": options,
        "allow_options": allowing,
        "timeout_s": result.approval_timeout,
        "default": result.approval_default,
        "handler": handler,
        "event": event,
        "tool_name": tool,
        "session_id": _text(data.get("session_id")),
        "agent_id": _text(data.get("agent_id")),
        **_shown_data(data),
    }


APPROVAL_DATA_MAX_BYTES = 16 * 1024
"""Largest call data an approval record carries whole (its JSON, bytes); larger data is
shown as the start of its JSON text."""


def _record_allows(record: SuspensionRecord, choice: str) -> bool:
    """Whether `choice` allows by the approval record's ``allow_options`` (a record
    written without them: the default rule, `is_allow`)."""
    allowing = record.metadata.get("allow_options")
    if isinstance(allowing, list):
        return choice in allowing
    return is_allow(choice)


def _shown_data(data: dict[str, Any]) -> dict[str, Any]:
    """What an approval's metadata shows of the call's data (what the handlers saw, after
    any data chaining): ``{"data": data}`` when its JSON is at most
    `APPROVAL_DATA_MAX_BYTES`, else ``{"data": None, "data_preview": <the JSON's first
    APPROVAL_DATA_MAX_BYTES characters>, "data_bytes": <its full size>}``."""
    try:
        text = encode(data)
    except (HookbusError, TypeError):
        return {"data": None}
    if len(text) <= APPROVAL_DATA_MAX_BYTES:
        return {"data": data}
    preview = text[:APPROVAL_DATA_MAX_BYTES].decode("utf-8", "ignore")
    return {"data": None, "data_preview": preview, "data_bytes": len(text)}


def _call_data(result: HookResult) -> dict[str, Any]:
    """The data of the call an ``ask_user`` result is about (the chained data of the emit;
    a result made outside an emit has only its own)."""
    return result.chained_data or result.data or {}


def _out_of_time(exc: BaseException) -> bool:
    """Whether `exc` is the store giving up at the caller's deadline (`caller_deadline`):
    the store could not be reached in time (the caller records that failure), not a
    question this dispatcher may not ask."""
    return isinstance(exc, HookbusTimeoutError) and time_left(math.inf) <= 0
