"""Answering and ending an approval: what an answer (or a cancel, or the clock) does to it.

An approver's answer or cancel is written as its proof (`ApprovalProofs`); the decider
folds the answer a record holds into the asker's decision (an "Allow once" used up by it,
an "Allow always" stored as a grant that allows later calls after it is verified again);
an approval nobody waits for is ended past its timeout by whoever reads it next. The
rules are told in `hookbus.dispatcher._approvals`.
"""

from __future__ import annotations

import logging
import time
import uuid

import msgspec
import nats.errors
import nats.js.errors

from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    AlreadySettledError,
    ApprovalAnswer,
    ApprovalGrant,
    HookbusError,
    HookResult,
    ResolutionRejectedError,
    SuspensionNotFoundError,
    SuspensionRecord,
)

from ._approval_proofs import ApprovalProofs
from ._approval_rules import (
    TIMED_OUT,
    allows,
    call_data,
    decided,
    is_always,
    record_allows,
    settled_how,
    text_or_none,
    uses_up,
)
from ._grants import Grants
from ._server_clock import server_age
from ._suspension_events import publish
from ._suspensions import Suspensions

__all__ = ["EXPIRY_MARGIN_S", "ApprovalAnswers", "UsedUp"]

log = logging.getLogger("hookbus.dispatcher")

EXPIRY_MARGIN_S = 5.0
"""Seconds past its ``timeout_s`` (by the server's clock) a pending approval nobody closed
is ended by a reader (`Approvals.end_if_overdue`): its asker, if alive, closes it first."""


class UsedUp(Exception):
    """The approval's one-time allow was used by another decision (internal): ask again."""


class ApprovalAnswers:
    """Answers, cancels, grants and the expiry of the approvals in `records`.

    Args:
        records: the approval records (see `Approvals`).
        grants: the "Allow always" grants of the same bucket.
        proofs: the answer proofs of the same bucket.
        read_s: longest time, in seconds, a grant or proof read or write retries through a
            JetStream leader election (a grant that cannot be stored in that time is not
            remembered, and the reason says so).
        grant_ttl_s: seconds an "Allow always" grant allows from its answer.
        answer_wait_s: seconds `answer` and `cancel` wait, by default, for a decider.
    """

    def __init__(
        self,
        records: Suspensions,
        grants: Grants,
        proofs: ApprovalProofs,
        *,
        read_s: float,
        grant_ttl_s: float,
        answer_wait_s: float,
    ) -> None:
        self._records = records
        self._grants = grants
        self._proofs = proofs
        self._read_s = read_s
        self.grant_ttl_s = grant_ttl_s
        self.answer_wait_s = answer_wait_s
        self.closes_records = True
        """See `Approvals.closes_records`."""

    # -- the approver's side ------------------------------------------------------------
    async def answer(
        self, label: str, choice: str, *, agent_id: str | None, approver: str,
        wait_s: float | None,
    ) -> ApprovalAnswer:  # fmt: skip
        """See `Approvals.answer`."""
        store = self._records.for_agent(agent_id)
        options = await self._pending_options(store, label)
        if choice not in options:
            raise ResolutionRejectedError(f"choice {choice!r} is not one of the options {options}")
        await self._not_overdue(label, agent_id)
        answer = ApprovalAnswer(choice=choice, answered_by=approver, answered_at=time.time())
        return await self._proofs.prove(store, label, answer, self._wait(wait_s))

    async def cancel(
        self, label: str, *, agent_id: str | None, approver: str, reason: str | None,
        wait_s: float | None,
    ) -> ApprovalAnswer:  # fmt: skip
        """See `Approvals.cancel`."""
        store = self._records.for_agent(agent_id)
        options = await self._pending_options(store, label)
        await self._not_overdue(label, agent_id)
        proof = ApprovalAnswer(
            choice="", answered_by=approver, answered_at=time.time(), kind="cancel",
            reason=reason,
        )  # fmt: skip
        return await self._proofs.prove(
            store, label, proof, self._wait(wait_s),
            apply_with=options if self.closes_records else None,
        )  # fmt: skip

    def _wait(self, wait_s: float | None) -> float:
        return self.answer_wait_s if wait_s is None else wait_s

    @staticmethod
    async def _pending_options(store: Suspensions, label: str) -> list[str]:
        """The options of the pending approval `label` of `store`'s agent. Raises
        `SuspensionNotFoundError` (no such approval) or `AlreadySettledError`."""
        got = await store.get(label)
        if got is None or got[0].metadata.get("kind") != "approval":
            raise SuspensionNotFoundError(f"no approval {label!r} for agent {store.agent_id!r}")
        record = got[0]
        if record.status != "pending":
            raise AlreadySettledError(f"approval {label!r} is already {settled_how(record)}")
        return list(record.metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)

    async def _not_overdue(self, label: str, agent_id: str | None) -> None:
        """Raises `AlreadySettledError` when the approval `label` is ended now, overdue
        (`end_if_overdue`: written when `closes_records`)."""
        ended = await self.end_if_overdue(label, agent_id=agent_id, write=self.closes_records)
        if ended is not None:
            raise AlreadySettledError(f"approval {label!r} is already {settled_how(ended)}")

    async def end_if_overdue(
        self, label: str, *, agent_id: str | None, write: bool = True
    ) -> SuspensionRecord | None:
        """See `Approvals.end_if_overdue`."""
        store = self._records.for_agent(agent_id)
        got = await store.get(label)
        if got is None or got[0].status != "pending" or got[0].metadata.get("kind") != "approval":
            return None
        record, revision = got
        timeout = record.metadata.get("timeout_s")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            return None
        age = await server_age(store.records.kv, store.records.key(label), revision)
        if age is None or age < float(timeout) + EXPIRY_MARGIN_S:
            return None
        options = list(record.metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)
        default = record.metadata.get("default")
        reason = f"{TIMED_OUT}{timeout}s; default {default} applied"
        closed = msgspec.structs.replace(
            record, status="cancelled", reason=reason, settled_at=time.time()
        )
        if not write:
            return closed
        if await self._proofs.apply(store, label, options):  # an answer came first: it decides
            again = await store.get(label)
            return None if again is None else again[0]
        if await store.records.swap(closed, last=revision) is None:  # settled meanwhile
            again = await store.get(label)
            return None if again is None else again[0]
        log.info("approval %r of agent %r expired: nobody waited past its %ss", label,
                 agent_id, timeout)  # fmt: skip
        await publish(store._nc, closed)  # the feed drops it from every console
        return closed

    # -- the decider's side: an answer folded into the asker's decision ---------------------
    def cancelled(self, result: HookResult, reason: str | None) -> HookResult:
        """The decision of an approval closed with `reason`: by its own timeout, its
        default; otherwise deny ("approval cancelled: ...")."""
        if reason is not None and reason.startswith(TIMED_OUT):  # closed by its own timeout
            return decided(
                result,
                allow=result.approval_default == "allow",
                reason=reason.removesuffix(" applied"),
            )
        return decided(result, allow=False, reason=f"approval cancelled: {reason}")

    async def from_record(
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
        e.g. by a retry, never re-creates a grant that was revoked since). Raises `UsedUp`
        when its one-time allow went to another decision."""
        if record.status == "cancelled":
            return self.cancelled(result, record.reason)
        if record.status != "resolved":
            return None
        try:
            answer = msgspec.convert(record.resolution, ApprovalAnswer)
        except msgspec.ValidationError as exc:
            return decided(result, allow=False, reason=f"the stored answer is invalid: {exc}")
        return await self.answered(result, answer, options, store, record.label, remember=remember)

    async def answered(
        self,
        result: HookResult,
        answer: ApprovalAnswer,
        options: list[str],
        store: Suspensions,
        label: str,
        *,
        remember: bool = True,
    ) -> HookResult:
        """The decision `answer` (the resolution of approval `label`) makes: refused when
        no approver's proof holds it; an "Allow once" is used up by it (`UsedUp` when
        another decision used it first); an allowing "Allow always" is remembered as a
        grant when `remember`."""
        choice = answer.choice
        if choice not in options:
            return decided(
                result, allow=False, reason=f"answer {choice!r} is not one of the options {options}"
            )
        problem = await self._proofs.unproven(answer, store, label)
        if problem is not None:
            log.warning("approval %r: answer refused: %s", label, problem)
            return decided(result, allow=False, reason=f"answer refused: {problem}")
        allow = allows(choice, result.approval_allow_options)
        if allow and uses_up(choice, result.approval_allow_options):
            if not await self._use(store, label):
                raise UsedUp
        reason = f"{answer.answered_by} chose {choice!r}"
        session = text_or_none(call_data(result).get("session_id"))
        if allow and is_always(choice) and session is None:
            reason += "; allowed this call only: the call has no session id to remember it for"
        elif allow and is_always(choice) and remember:
            stored = await self._grant(result, answer, store, label)
            if stored is not None:
                reason += f"; {stored}"
        decision = decided(result, allow=allow, reason=reason)
        return msgspec.structs.replace(decision, approved_by=answer.answered_by)

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

    # -- "Allow always" grants -------------------------------------------------------------
    async def granted(
        self, event: str, result: HookResult, handler: str, *, budget_s: float
    ) -> HookResult | None:
        """The allow of a verified "Allow always" grant for this handler's question, or None
        (no session, no grant, a grant that fails `_grant_problem`, or the approvals bucket
        failed: then the human is asked)."""
        data = call_data(result)
        tool = text_or_none(data.get("tool_name"))
        session, agent = text_or_none(data.get("session_id")), text_or_none(data.get("agent_id"))
        if session is None:
            return None
        try:
            grant = await self._grants.find(agent, session, event, handler, tool, budget_s=budget_s)
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
        decision = decided(
            result, allow=True,
            reason=f"allowed always for {tool or 'this call'} in session {session}"
            f" (granted by {grant.approved_by} in {grant.label})",
        )  # fmt: skip
        return msgspec.structs.replace(decision, approved_by=grant.approved_by)

    async def _grant_problem(self, grant: ApprovalGrant, budget_s: float) -> str | None:
        """Why `grant` allows nothing (None: it holds). It must be live (``expires_at``),
        name the approval it came from and its approver, that approver's proof must hold
        its choice, the choice must allow and be an "always" one by the approval record's
        ``allow_options``, and the record must be about the grant's scope."""
        if grant.expires_at is None or grant.expires_at <= time.time():
            return "it has expired" if grant.expires_at else "it carries no expiry"
        if not grant.label or not grant.approved_by:
            return "it names no approval or no approver"
        store = self._records.for_agent(grant.agent_id)
        got = await store.get(grant.label)
        if got is None or got[0].metadata.get("kind") != "approval":
            return f"no approval {grant.label!r} is on record"
        meta = got[0].metadata
        scope = {"event": grant.event, "handler": grant.handler, "tool_name": grant.tool,
                 "session_id": grant.session_id, "agent_id": grant.agent_id}  # fmt: skip
        differs = [k for k, v in scope.items() if meta.get(k) != v]
        if differs:
            return f"approval {grant.label!r} was about another {', '.join(differs)}"
        proof = await self._proofs.proof(store, grant.label, grant.approved_by, budget_s)
        if isinstance(proof, str):
            return proof
        if proof.choice != grant.choice:
            return f"{grant.approved_by!r} answered {proof.choice!r}, not {grant.choice!r}"
        if not (record_allows(got[0], proof.choice) and is_always(proof.choice)):
            return f"{proof.choice!r} is not an allowing 'Allow always' answer"
        return None

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
        session = text_or_none(meta.get("session_id"))
        if session is None:
            return None  # nothing to remember it for; the reason says so
        now = time.time()  # the decider's clock, not the approver's answered_at
        grant = ApprovalGrant(
            agent_id=store.agent_id, session_id=session, event=str(meta.get("event") or "?"),
            handler=str(meta.get("handler") or "?"), tool=text_or_none(meta.get("tool_name")),
            choice=answer.choice, label=label, granted_at=now,
            approved_by=answer.answered_by or "", expires_at=now + self.grant_ttl_s,
        )  # fmt: skip
        try:
            await self._grants.put(grant, budget_s=self._read_s)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("grant of approval %r not stored (%s)", label, exc)
            return f"not remembered: the grant could not be stored ({type(exc).__name__})"
        return None
