"""A tool approval is an approver's: decided only by an answer proof, the key
``<agent>.<label>.<approver>`` beside its record, which only that approver's NATS user may
write. The waiting agent resolves the record from the first valid proof in stream order
(the kernel's `hookbus._core.proofs`, which the dispatcher's approvals read too); a
resolution without a matching proof is refused."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from ai.types import tools as ai_tools

from hookbus._core.deadlines import Deadline
from hookbus._core.proofs import apply_proofs_until_settled, first_proof, read_proof, write_proof
from hookbus.dispatcher import AnswerNotAppliedError, Suspensions
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    AlreadySettledError,
    ApprovalAnswer,
    HookbusError,
    ResolutionRejectedError,
    approval_answer_key,
    decode,
)

from .labels import HooksSettings, M, log

__all__ = ["ToolApprovalProofs"]

PROOF_POLL_S = 2.0
"""Seconds between two reads of a waited tool approval's proofs when its watch signals none."""


def _resolution(answer: ApprovalAnswer) -> dict[str, Any]:
    """The record's resolution made from an approver's `answer`: a ``ToolApproval``'s
    fields, plus who answered."""
    return {
        "granted": answer.choice == "Allow",
        "reason": f"{answer.answered_by} chose {answer.choice!r}",
        "choice": answer.choice,
        "answered_by": answer.answered_by,
        "answered_at": answer.answered_at,
    }


def _valid_proof(key: str, value: bytes, label: str, agent_id: str | None) -> ApprovalAnswer | None:
    """The proof under `key` if it answers `label`: it decodes, names the approver its key
    names, and chooses "Allow" or "Deny"."""
    try:
        answer = decode(value, ApprovalAnswer)
        if not answer.answered_by or answer.choice not in APPROVAL_DEFAULT_OPTIONS:
            return None
        if approval_answer_key(label, agent_id, answer.answered_by) != key:
            return None
    except HookbusError:
        return None
    return answer


class ToolApprovalProofs:
    """The answer proofs of the store's tool approvals: written by an approver
    (`approve`), applied by the waiting agent (`apply`, `pump`), checked against the
    resolution it gets (`proven`)."""

    def __init__(self, settings: HooksSettings) -> None:
        self._settings = settings

    @property
    def suspensions(self) -> Suspensions:
        """The store of the hooks served (read at each use)."""
        return self._settings.suspensions

    async def approve(
        self, label: str, choice: str, *, approver: str, wait_s: float
    ) -> ApprovalAnswer:
        """Write `approver`'s proof answering the tool approval `label` with `choice`, then
        wait up to `wait_s` seconds for the waiting agent to apply it; see
        `HookbusHooks.approve` (the same errors)."""
        if choice not in APPROVAL_DEFAULT_OPTIONS:
            raise ResolutionRejectedError(
                f"choice {choice!r} is not one of the options {list(APPROVAL_DEFAULT_OPTIONS)}"
            )
        store = self.suspensions
        answer = ApprovalAnswer(choice=choice, answered_by=approver, answered_at=time.time())
        key = approval_answer_key(label, store.agent_id, approver)
        found = await store.get(label)
        if found is not None and found[0].status != "pending":
            raise AlreadySettledError(f"tool approval {label!r} is already {found[0].status}")
        answer = await write_proof(
            store.records.kv, key, answer, deadline_s=store.records.deadline_s
        )
        if found is None:
            return answer  # the hook takes it when it starts
        deadline = Deadline.after(wait_s)  # on the loop's clock
        while True:
            got = await store.get(label)
            record = None if got is None else got[0]
            if record is None:  # consumed and removed by the run's end: who decided it?
                first = await self._first(label)
                if first is not None and first.answered_by == approver:
                    return answer
                raise AlreadySettledError(
                    f"tool approval {label!r} was decided first by"
                    f" {first.answered_by if first is not None else 'another resolution'}"
                )
            if record.status == "cancelled":
                raise AlreadySettledError(f"tool approval {label!r} was cancelled first")
            if record.status == "resolved":
                won = record.resolution if isinstance(record.resolution, dict) else {}
                if (won.get("answered_by"), won.get("choice")) == (approver, answer.choice):
                    return answer
                raise AlreadySettledError(
                    f"tool approval {label!r} was decided first by"
                    f" {won.get('answered_by') or 'an unproven resolution'}"
                    f" ({won.get('choice') or won.get('granted')!r})"
                )
            if deadline.passed():
                raise AnswerNotAppliedError(
                    f"the answer {choice!r} of {approver} to tool approval {label!r} is"
                    f" recorded, but the agent did not apply it within {wait_s:g} s: it decides"
                    " when the agent next waits on it"
                )
            await asyncio.sleep(0.05)

    async def _first(self, label: str, *, after: int = 0) -> ApprovalAnswer | None:
        """The first valid proof of the tool approval `label` stored after stream sequence
        `after`, in stream order, or None."""
        store = self.suspensions
        return await first_proof(
            store.records.kv, store.records.key(label),
            lambda key, value: _valid_proof(key, value, label, store.agent_id),
            deadline_s=store.records.deadline_s, after=after,
        )  # fmt: skip

    async def _answers_after(self, label: str) -> int:
        """The stream sequence at or below which a proof of the tool approval `label`
        answered an earlier ask of the same label (the same tool call in another run):
        what its pending record was written over (`SuspensionRecord.created_over`), or,
        with no record, the delete marker the key holds (0: never written)."""
        entry = await self.suspensions.records.latest(label)
        if entry is None:
            return 0
        return entry.revision if entry.record is None else entry.record.created_over

    async def apply(self, label: str) -> bool:
        """Resolve the tool approval `label` (pending, or not created yet: pre-registered)
        from its first valid proof in stream order. True once it is settled."""
        store = self.suspensions
        found = await store.get(label)
        if found is not None and found[0].status == "resolved" and found[0].consumed:
            return False  # a used one, kept (see `ToolApprovals.mark_used`): asked anew
        if found is not None and found[0].status != "pending":
            return True
        # the proofs that answer it: stored after what its record was written over (the
        # record read above; with none, the key's delete marker, read again)
        after = found[0].created_over if found is not None else await self._answers_after(label)
        answer = await self._first(label, after=after)
        if answer is None:
            return False
        with contextlib.suppress(AlreadySettledError):  # settled meanwhile
            await store.resolve_hook(label, _resolution(answer))
        return True

    async def pump(self, label: str) -> None:
        """While a tool approval is waited on: at once, at each proof the store's watch
        delivers, and every few seconds, resolve it from its first valid proof."""
        store = self.suspensions
        key = store.records.key(label)
        signal = store.watch.listen_proofs(key)
        try:
            await apply_proofs_until_settled(
                lambda: self.apply(label), signal, poll_s=PROOF_POLL_S,
                unread=lambda exc: log.info("tool approval %r: proofs not read (%r)", label, exc),
            )  # fmt: skip
        finally:
            store.watch.unlisten_proofs(key, signal)

    async def proven(self, label: str, value: Any, payload: type[M]) -> M:
        """The tool approval's resolution `value` as `payload` if an approver's proof holds
        it; else a refusal (``granted=False``) for a ``ToolApproval``, or
        `ResolutionRejectedError`."""
        problem = None
        who = value.get("answered_by") if isinstance(value, dict) else None
        if not isinstance(who, str) or not who:
            problem = "it names no approver"
        else:
            store = self.suspensions
            key = approval_answer_key(label, store.agent_id, who)
            raw = await read_proof(
                store.records.kv, key, deadline_s=store.records.deadline_s,
                after=await self._answers_after(label),
            )  # fmt: skip
            proof = None if raw is None else _valid_proof(key, raw, label, store.agent_id)
            if proof is None:
                problem = f"no answer of approver {who!r} is on record"
            elif _resolution(proof) != value:
                problem = f"{who!r} answered {proof.choice!r}, which the resolution does not say"
        if problem is None:
            return payload.model_validate(value)
        log.warning("tool approval %r: resolution refused: %s", label, problem)
        if issubclass(payload, ai_tools.ToolApproval):
            return payload.model_validate({"granted": False, "reason": f"refused: {problem}"})
        raise ResolutionRejectedError(f"tool approval {label!r}: resolution refused: {problem}")
