"""Approvals as a test sees them (`Approval`), and the in-process approvals of the test
environment (`MemoryApprovals`): a handler's ``ask_user`` becomes a question the test
answers, or lets time out.

The in-process side decides by the dispatcher's own rules, imported, not copied: which
choices allow (`allows`: the handler's ``approval_allow_options``, else the options that
start with "allow"), the label of one call's approval (`approval_label`) and how the
decisions of several askers join (`joined_decision`: asked one after the other, the first
refusal denies). What it leaves out, being in memory: "Allow always" grants, the
one-time use of an "Allow once", quotas and restarts (the real environment has them all).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

import msgspec

from hookbus._core.deadlines import Deadline
from hookbus.dispatcher import allows, approval_label, joined_decision
from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    AlreadySettledError,
    ApprovalMetadata,
    HookResult,
    ResolutionRejectedError,
    SuspensionNotFoundError,
)

__all__ = ["CALLERS_DEADLINE", "Approval", "MemoryApprovals"]

CALLERS_DEADLINE = "the caller's deadline ended the wait before an answer"
"""The reason of the deny decided when the emit's deadline (``timeout_s``) ends an
approval's wait first (as the dispatcher's reason starts)."""


@dataclass(frozen=True, slots=True)
class Approval:
    """A pending approval: the question one handler's ``ask_user`` put to a human.

    `question` is what an approver is shown, as the approval record carries it on NATS:
    ``prompt``, ``options`` (answer with one of them), ``allow_options``, ``timeout_s``
    (seconds; None: no limit), ``default`` (``"allow"`` | ``"deny"``: the decision when
    nobody answers in time), ``handler``, ``event``, ``tool_name``, ``session_id``,
    ``agent_id``.
    """

    label: str
    """The approval's label (``approval:<32 hex digits>``): one per call and asker."""
    question: ApprovalMetadata
    """What the approver is asked (see above)."""

    @property
    def allow_choice(self) -> str:
        """The first option that allows (what `HookTestEnv.allow` answers)."""
        return self.question.allow_options[0]

    @property
    def deny_choice(self) -> str:
        """The first option that does not allow (what `HookTestEnv.deny` answers).

        Raises:
            ValueError: every option allows.
        """
        for option in self.question.options:
            if option not in self.question.allow_options:
                return option
        raise ValueError(f"every option of {self.label} allows: {self.question.options}")


class MemoryApprovals:
    """The approvals of an in-process test environment: questions queued for the test,
    answers awaited on the event loop's clock (virtual on a `VirtualClockLoop`)."""

    def __init__(self) -> None:
        self._asked: asyncio.Queue[Approval] = asyncio.Queue()
        self._waiting: dict[str, tuple[Approval, asyncio.Future[tuple[str, str]]]] = {}

    async def decide(
        self,
        event: str,
        asks: list[HookResult],
        *,
        call_id: str,
        longest_s: float | None,
        deadline: Deadline,
    ) -> HookResult:
        """Ask each of `asks` (an emit's ``ask_user`` results, `Fold.asks`) in turn, until
        one is refused; the emit's decision (`joined_decision`). `longest_s`: the emit's
        ``approval_timeout_s``; `deadline`: the emit's end on the loop's clock (`NEVER`:
        none), which ends a wait as a deny, never as the question's default."""
        decisions: list[HookResult] = []
        for ask in asks:
            decided = await self._decide_one(
                event, ask, call_id=call_id, longest_s=longest_s, deadline=deadline
            )
            decisions.append(decided)
            if decided.action != "continue":
                break
        return joined_decision(asks, decisions)

    async def _decide_one(
        self,
        event: str,
        result: HookResult,
        *,
        call_id: str,
        longest_s: float | None,
        deadline: Deadline,
    ) -> HookResult:
        handler = result.decided_by or "?"
        result = _cut(result, longest_s)
        options = list(result.approval_options or APPROVAL_DEFAULT_OPTIONS)
        allowing = [o for o in options if allows(o, result.approval_allow_options)]
        if not allowing:
            reason = f"the options {options} offer no allowing answer: nobody was asked"
            return _decided(result, allow=False, reason=reason)
        data = result.chained_data or result.data or {}
        label = approval_label(event, data, handler, call_id=call_id)
        tool, session, agent = (_text(data.get(k)) for k in ("tool_name", "session_id", "agent_id"))
        question = ApprovalMetadata(
            kind="approval",
            prompt=result.approval_prompt or f"Allow {tool or 'this call'} ({event})?",
            options=options,
            allow_options=allowing,
            timeout_s=None if result.approval_timeout is None else float(result.approval_timeout),
            default=result.approval_default,
            handler=handler,
            event=event,
            tool_name=tool,
            session_id=session,
            agent_id=agent,
        )
        approval = Approval(label=label, question=question)
        answered: asyncio.Future[tuple[str, str]] = asyncio.get_running_loop().create_future()
        self._waiting[label] = (approval, answered)
        self._asked.put_nowait(approval)
        ends = Deadline.after(question.timeout_s)  # the question's own timeout
        until = ends.earlier(deadline)  # the caller's deadline if strictly earlier, else `ends`
        callers = until is not ends
        try:
            async with until.timeout():
                choice, approver = await answered
        except TimeoutError:
            if callers:
                return _decided(result, allow=False, reason=CALLERS_DEADLINE)
            reason = f"timed out after {question.timeout_s}s; default {question.default}"
            return _decided(result, allow=question.default == "allow", reason=reason)
        finally:
            self._waiting.pop(label, None)
        allow = allows(choice, result.approval_allow_options)
        decided = _decided(result, allow=allow, reason=f"{approver} chose {choice!r}")
        return msgspec.structs.replace(decided, approved_by=approver)

    async def next_approval(self, timeout_s: float | None) -> Approval:
        """The next question asked that still waits for an answer (in the order asked),
        waiting up to `timeout_s` seconds on the loop's clock for one. Raises
        `TimeoutError`."""
        async with asyncio.timeout(timeout_s):
            while True:
                approval = await self._asked.get()
                if approval.label in self._waiting:
                    return approval

    def answer(self, label: str, choice: str, *, approver: str) -> None:
        """Answer the pending approval `label` with `choice` as `approver`.

        Raises:
            SuspensionNotFoundError: no approval `label` waits (never asked, or decided).
            ResolutionRejectedError: `choice` is not one of its options.
            AlreadySettledError: it was answered already.
        """
        waiting = self._waiting.get(label)
        if waiting is None:
            raise SuspensionNotFoundError(f"no pending approval {label!r}")
        approval, answered = waiting
        if choice not in approval.question.options:
            raise ResolutionRejectedError(
                f"{choice!r} is not one of the options {approval.question.options}"
            )
        if answered.done():
            raise AlreadySettledError(f"approval {label!r} was answered already")
        answered.set_result((choice, approver))


def _cut(result: HookResult, longest_s: float | None) -> HookResult:
    """`result`'s ``approval_timeout`` within the emit's `longest_s` (its
    ``approval_timeout_s``): a cut that shortens the wait turns a default allow into deny,
    as the dispatcher's does (only the handler's own full timeout may allow by default)."""
    own = result.approval_timeout
    if longest_s is None or (own is not None and math.isfinite(own) and own <= longest_s):
        return result
    return msgspec.structs.replace(result, approval_timeout=longest_s, approval_default="deny")


def _decided(result: HookResult, *, allow: bool, reason: str) -> HookResult:
    """The decided result: an allow goes on with the call's data (``continue`` with the
    chained data); a deny keeps the asking handler's own data."""
    if not allow:
        return msgspec.structs.replace(result, action="deny", reason=reason)
    return msgspec.structs.replace(
        result, action="continue", reason=reason, data=result.chained_data
    )


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
