"""Folding handler results into one `HookResult`: pure, no I/O, tested without a server.

The semantics are amplifier-core's `HookRegistry.emit` (`amplifier_core/hooks.py`):

- handlers are folded in (priority, name) order;
- ``deny`` returns at once (short-circuit); later handlers never count;
- ``modify`` with data replaces the data for the next handler (whole replacement);
- ``inject_context`` results are collected and merged: texts joined by a blank line, role,
  ``ephemeral``, ``append_to_last_tool_result`` and ``suppress_output`` from the first;
- the first ``ask_user`` is kept (approvals cannot be merged);
- precedence of the final action: deny > ask_user > inject_context > modify > continue.

Where hookbus deliberately differs (documented in the README):

- the final chained data stays on the result whatever the action (amplifier-core returns
  a denying or asking handler's result as is, without the chained data);
- a modify chain that no higher action overrides ends as ``action="modify"`` (amplifier-core
  returns ``continue`` with the chained data; the data is the same);
- handler failures are recorded on the result (`failures`) with the policy applied, and a
  ``deny`` policy fails closed; amplifier-core only logs them;
- every injection is also kept losslessly in `context_injections` with its handler.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hookbus.schemas import (
    ContextInjection,
    FailureKind,
    FailurePolicy,
    HandlerFailure,
    HookResult,
)

__all__ = ["Fold"]


class Fold:
    """The running fold of one emit. Feed results in priority order; stop on a deny.

    Usage: ``fold = Fold(data)``; for each handler in order, ``denied = fold.apply(name, r)``
    or ``denied = fold.fail(name, kind, policy, message)``; if `denied` is not None return
    it; when every handler has been folded, return ``fold.result()``.
    """

    __slots__ = ("_ask_user", "_ask_user_by", "_failures", "_injected", "_modified_by", "data")

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        """The current chained data: what the next handler sees."""
        self._modified_by: list[str] = []
        self._ask_user: HookResult | None = None
        self._ask_user_by: str | None = None
        self._injected: list[tuple[HookResult, ContextInjection]] = []
        self._failures: list[HandlerFailure] = []

    def apply(self, handler: str, result: HookResult) -> HookResult | None:
        """Fold one handler's result. Returns the final result if it denied, else None."""
        action = result.action
        if action == "deny":
            return self._final(result, decided_by=handler)
        if action == "modify":
            if result.data is not None:
                self.data = result.data
                self._modified_by.append(handler)
        elif action == "inject_context":
            if result.context_injection:
                injection = ContextInjection(
                    handler=handler,
                    content=result.context_injection,
                    role=result.context_injection_role,
                    ephemeral=result.ephemeral,
                    append_to_last_tool_result=result.append_to_last_tool_result,
                )
                self._injected.append((result, injection))
        elif action == "ask_user":
            if self._ask_user is None:
                self._ask_user, self._ask_user_by = result, handler
        return None

    def fail(
        self, handler: str, kind: FailureKind, policy: FailurePolicy, message: str
    ) -> HookResult | None:
        """Record a handler failure. With policy ``deny`` returns the final (deny) result."""
        self._failures.append(
            HandlerFailure(handler=handler, kind=kind, policy=policy, message=message)
        )
        if policy == "deny":
            denied = HookResult(
                action="deny",
                reason=f"handler {handler!r} failed ({kind}) and its failure policy is deny"
                + (f": {message}" if message else ""),
            )
            return self._final(denied, decided_by=handler)
        return None

    @property
    def failures(self) -> list[HandlerFailure]:
        """Failures recorded so far, in the order they were folded."""
        return self._failures

    def result(self) -> HookResult:
        """The final result after every handler was folded (no deny happened)."""
        if self._ask_user is not None:
            return self._final(self._ask_user, decided_by=self._ask_user_by)
        if self._injected:
            first = self._injected[0][0]
            if len(self._injected) == 1:
                merged = first
            else:
                merged = HookResult(
                    action="inject_context",
                    context_injection="\n\n".join(i.content for _, i in self._injected),
                    context_injection_role=first.context_injection_role,
                    ephemeral=first.ephemeral,
                    append_to_last_tool_result=first.append_to_last_tool_result,
                    suppress_output=first.suppress_output,
                )
            return self._final(merged, decided_by=self._injected[0][1].handler)
        if self._modified_by:
            return self._final(HookResult(action="modify"), decided_by=self._modified_by[-1])
        return self._final(HookResult(action="continue"), decided_by=None)

    def _final(self, result: HookResult, *, decided_by: str | None) -> HookResult:
        return msgspec.structs.replace(
            result,
            data=self.data,
            context_injections=[i for _, i in self._injected],
            failures=list(self._failures),
            decided_by=decided_by,
            modified_by=list(self._modified_by),
        )
