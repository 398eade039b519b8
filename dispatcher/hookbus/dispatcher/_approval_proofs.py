"""Proving an approval: the approvers' answer proofs, written, read and applied.

An approver writes only its proof ``<agent>.<label>.<approver>`` (an answer, or a cancel of
kind ``"cancel"``); the decider settles the approval record from the FIRST proof in stream
order that is a cancel or whose choice is one of the options (see
`hookbus.dispatcher._approvals`). Here: the loop that applies proofs while an approval is
waited on, one approver's proof read back, and an approver's proof written and waited on
until a decider applied it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec

from hookbus._core.deadlines import Deadline
from hookbus._core.proofs import apply_proofs_until_settled, first_proof, read_proof, write_proof
from hookbus.schemas import (
    AlreadySettledError,
    ApprovalAnswer,
    BadRequestError,
    HookbusError,
    HookbusTimeoutError,
    SuspensionNotFoundError,
    approval_answer_key,
    decode,
)

from ._approval_rules import cancel_reason, settled_how
from ._suspensions import Suspensions

__all__ = ["AnswerNotAppliedError", "ApprovalProofs"]

log = logging.getLogger("hookbus.dispatcher")


class AnswerNotAppliedError(HookbusTimeoutError):
    """An approver's answer is recorded (its proof exists) but no dispatcher applied it to
    the approval in time: it decides when the agent's dispatcher (or the dispatcher
    service) next reads the approval, unless another approver's answer came first."""


class ApprovalProofs:
    """The answer proofs of the approvals in one store's bucket (see the module docstring).

    Args:
        read_s: longest time, in seconds, a proof read or write retries through a
            JetStream leader election.
        poll_s: seconds between reads of a waited-on approval's proofs besides the
            watch's signals.
    """

    def __init__(self, *, read_s: float, poll_s: float) -> None:
        self._read_s = read_s
        self._poll_s = poll_s

    async def pump(
        self, store: Suspensions, label: str, options: list[str], signal: asyncio.Event
    ) -> None:
        """While the approval is waited on: at once, at each proof the watch delivers, and
        every `poll_s` seconds, resolve it from its first valid proof (`apply`)."""
        await apply_proofs_until_settled(
            lambda: self.apply(store, label, options), signal, poll_s=self._poll_s,
            unread=lambda exc: log.info(
                "approval %r: proofs not read (%r); trying again", label, exc
            ),
        )  # fmt: skip

    async def apply(self, store: Suspensions, label: str, options: list[str]) -> bool:
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
            deadline_s=self._read_s,
        )  # fmt: skip
        if answer is None:
            return False
        with contextlib.suppress(AlreadySettledError):  # answered or closed meanwhile
            if answer.kind == "cancel":  # an approver's proven cancel: closed, the call denied
                await store.cancel_hook(label, reason=cancel_reason(answer))
            else:
                await store.resolve_hook(label, msgspec.to_builtins(answer))
        return True

    async def unproven(self, answer: ApprovalAnswer, store: Suspensions, label: str) -> str | None:
        """Why `answer` is not an approver's (None: its proof holds the same choice).

        The proof is the key ``<agent>.<label>.<approver>``, which only that approver's
        NATS user may write: a record resolved by anyone else (the agent itself included)
        carries no matching proof and decides nothing.
        """
        if not answer.answered_by:
            return "it names no approver"
        proof = await self.proof(store, label, answer.answered_by, self._read_s)
        if isinstance(proof, str):
            return proof
        if proof.choice != answer.choice or proof.answered_by != answer.answered_by:
            return f"{answer.answered_by!r} answered {proof.choice!r}, not {answer.choice!r}"
        return None

    @staticmethod
    async def proof(
        store: Suspensions, label: str, approver: str, budget_s: float
    ) -> ApprovalAnswer | str:
        """The proof of `approver` for `label` in `store`'s bucket, or why there is none."""
        try:
            key = approval_answer_key(label, store.agent_id, approver)
        except BadRequestError as exc:
            return str(exc)
        value = await read_proof(store.records.kv, key, deadline_s=budget_s)
        if value is None:
            return f"no answer of approver {approver!r} is on record"
        try:
            proof = decode(value, ApprovalAnswer)
        except HookbusError as exc:
            return f"the answer of approver {approver!r} is unreadable: {exc}"
        if proof.answered_by != approver:
            return f"the answer under approver {approver!r} names {proof.answered_by!r}"
        return proof

    async def prove(
        self,
        store: Suspensions,
        label: str,
        proof: ApprovalAnswer,
        wait_s: float,
        *,
        apply_with: list[str] | None = None,
    ) -> ApprovalAnswer:
        """Write `proof` (an answer or a cancel) as its approver's, then wait (at most
        `wait_s` seconds) for a decider to apply it (`applied`). `apply_with` (the
        approval's options, given when this client may write records): apply the first
        proof itself first, so a cancel of an approval nobody waits for ends it at once.
        Raises as `Approvals.answer`."""
        key = approval_answer_key(label, store.agent_id, proof.answered_by or "")
        proof = await write_proof(store.records.kv, key, proof, deadline_s=self._read_s)
        if apply_with is not None:
            await self.apply(store, label, apply_with)
        return await self.applied(store, label, proof, wait_s)

    @staticmethod
    async def applied(
        store: Suspensions, label: str, answer: ApprovalAnswer, wait_s: float
    ) -> ApprovalAnswer:
        """Wait (at most `wait_s` seconds) until a decider settled `label`; see
        `Approvals.answer`."""
        loop = asyncio.get_running_loop()
        deadline = Deadline.after(wait_s, loop.time())
        pause = 0.05
        while True:
            got = await store.get(label)
            record = None if got is None else got[0]
            if record is None:
                raise SuspensionNotFoundError(f"approval {label!r} vanished")
            if record.status == "cancelled":
                if answer.kind == "cancel" and record.reason == cancel_reason(answer):
                    return answer
                raise AlreadySettledError(f"approval {label!r} was {settled_how(record)} first")
            if record.status == "resolved" and answer.kind == "cancel":
                raise AlreadySettledError(f"approval {label!r} was {settled_how(record)} first")
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
            if deadline.passed(loop.time()):
                what = "cancel" if answer.kind == "cancel" else f"answer {answer.choice!r}"
                raise AnswerNotAppliedError(
                    f"the {what} of {answer.answered_by} to approval {label!r}"
                    f" is recorded, but no dispatcher applied it within {wait_s:g} s:"
                    " it decides when the agent's dispatcher (or the dispatcher service) reads"
                    " the approval, unless another approver answered first"
                )
            await asyncio.sleep(deadline.cut(pause, loop.time()))
            pause = min(pause * 2, 0.5)


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
