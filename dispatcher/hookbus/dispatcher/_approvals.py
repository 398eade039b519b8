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

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus._core.buckets import approvals_bucket_config
from hookbus._core.forwarded import Forwarded
from hookbus._core.jetstream import bind_key_value
from hookbus._core.kv import open_bucket
from hookbus._core.leader_reads import own_keys_only
from hookbus.schemas import (
    APPROVALS_BUCKET,
    ApprovalAnswer,
    ApprovalGrant,
    HookResult,
    SuspensionRecord,
)

from ._approval_answers import EXPIRY_MARGIN_S, ApprovalAnswers
from ._approval_asking import ApprovalAsker
from ._approval_proofs import AnswerNotAppliedError, ApprovalProofs
from ._approval_rules import (
    APPROVAL_LABEL_PREFIX,
    CALLERS_DEADLINE,
    allowing_options,
    allows,
    approval_label,
    is_allow,
    joined_decision,
    next_approval_label,
    uses_up,
)
from ._grants import Grants
from ._suspensions import Suspensions

__all__ = [
    "APPROVAL_LABEL_PREFIX",
    "CALLERS_DEADLINE",
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
        proofs = ApprovalProofs(read_s=grant_read_s, poll_s=proof_poll_s)
        self._answers = ApprovalAnswers(
            records, self.grants, proofs, read_s=grant_read_s, grant_ttl_s=grant_ttl_s,
            answer_wait_s=answer_wait_s,
        )  # fmt: skip
        self._asker = ApprovalAsker(
            records, self._answers, proofs, read_s=grant_read_s, max_pending=max_pending
        )

    grant_ttl_s = Forwarded[float](
        "_answers",
        """Seconds an "Allow always" grant allows from its answer.""",
    )

    answer_wait_s = Forwarded[float](
        "_answers",
        """Seconds `answer` and `cancel` wait, by default, for a dispatcher to apply them.""",
    )

    max_pending = Forwarded[int | None](
        "_asker",
        """Pending approvals one agent may have at once (None: no limit).""",
    )

    closes_records = Forwarded[bool](
        "_answers",
        """Whether `end_if_overdue` (from `answer`) writes the record it closes (False:
        credentials that may not write approval records only judge).""",
    )

    max_timeout_s = Forwarded[float](
        "_asker",
        """Longest approval wait, seconds: a handler's ``approval_timeout`` is cut to it (a
        door that waits less than a handler's timeout sets it, so every approval it asks
        ends, with its ``approval_default``, within the door's wait).""",
    )

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
        own_keys = own_keys_only(nc, scoped=suspensions.records.scoped)
        if own_keys:  # an agent: it may only get its own keys, by direct get
            kv = bind_key_value(nc, APPROVALS_BUCKET, js_domain=js_domain, direct=True)
        else:
            kv = await open_bucket(
                nc, approvals_bucket_config(replicas=replicas), js_domain=js_domain
            )
        deadline = 3.0 if own_keys else 15.0
        store = Suspensions(
            nc, kv, leases=suspensions.leases, agent_id=suspensions.agent_id,
            scoped=suspensions.records.scoped, write_deadline_s=deadline,
        )  # fmt: skip
        approvals = cls(
            store, kv, grant_ttl_s=grant_ttl_s, answer_wait_s=answer_wait_s,
            max_pending=max_pending,
        )  # fmt: skip
        approvals._asker.own_agent_secured = deadline < 15.0  # it may not ask: no count
        approvals.closes_records = deadline >= 15.0
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
        return await self._asker.decide(
            event, result, call_id=call_id, wait_s=wait_s, longest_s=longest_s
        )

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
        return await self._answers.answer(
            label, choice, agent_id=agent_id, approver=approver, wait_s=wait_s
        )

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
        return await self._answers.cancel(
            label, agent_id=agent_id, approver=approver, reason=reason, wait_s=wait_s
        )

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
        return await self._answers.end_if_overdue(label, agent_id=agent_id, write=write)
