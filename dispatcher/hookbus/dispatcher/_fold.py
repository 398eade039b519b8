"""Folding handler results into one `HookResult`: pure, no I/O, tested without a server.

The semantics are amplifier-core 2.0.2's `HookRegistry.emit`, result for result (the
rules a worker serving a chain shares are `hookbus._core.fold_rules`):

- handlers are folded in (priority, registration) order;
- ``deny`` returns at once (short-circuit), as its handler made it (``data`` is the
  handler's, None if it set none); later handlers never run;
- ``modify`` with data replaces the data for the next handler (whole replacement);
  ``modify`` without data and ``continue`` with data change nothing;
- ``inject_context`` results are collected in order: a result's `context_injections`
  items, else its scalar ``context_injection`` (None injects nothing; "" does). One
  injecting handler: its result as it made it; several: a new result whose only kept
  field is the first one's ``suppress_output``. Either way the scalar fields are projected
  from the items: texts joined by a blank line, the first item's role, ``ephemeral`` and
  ``append_to_last_tool_result`` if any item has them;
- the first ``ask_user`` is kept, as its handler made it (approvals cannot be merged);
- precedence of the final action: deny > ask_user > inject_context > continue; a modify
  chain ends as ``continue`` with the chained data.

hookbus adds, in fields of its own that amplifier-core code never reads: the chained data
whatever the action (`chained_data`), the deciding handler (`decided_by`), the modifiers
(`modified_by`) and every handler failure with the policy applied (`failures`; a ``deny``
policy fails closed, and a result that cannot be read always does, as amplifier-core
denies an unparseable handler result).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hookbus._core.fold_rules import failure_policy_applied, modifies
from hookbus.schemas import (
    ContextInjection,
    FailureKind,
    FailurePolicy,
    HandlerFailure,
    HookResult,
)

__all__ = ["INVALID_RESULT_REASON", "Fold"]

INVALID_RESULT_REASON = "Hook handler returned invalid response"
"""The reason of the deny a result that cannot be read decides (amplifier-core's words)."""
_CONTINUE = HookResult()
"""The template of a final ``continue`` (replaced, never handed out or changed)."""


class Fold:
    """The running fold of one emit. Feed results in priority order; stop on a deny.

    Usage: ``fold = Fold(data, event)``; for each handler in order,
    ``denied = fold.apply(name, r)`` or ``denied = fold.fail(name, kind, policy, message)``;
    if `denied` is not None return it; when every handler has been folded, return
    ``fold.result()``.
    """

    __slots__ = (
        "_ask_user",
        "_ask_user_by",
        "_asks",
        "_event",
        "_failures",
        "_injectors",
        "_items",
        "_modified_by",
        "data",
    )

    def __init__(self, data: dict[str, Any], event: str = "") -> None:
        self.data = data
        """The current chained data: what the next handler sees."""
        self._event = event
        self._modified_by: list[str] = []
        self._ask_user: HookResult | None = None
        self._ask_user_by: str | None = None
        self._asks: list[tuple[str, HookResult]] = []
        self._injectors: list[tuple[str, HookResult]] = []
        self._items: list[ContextInjection] = []
        self._failures: list[HandlerFailure] = []

    def apply(self, handler: str, result: HookResult) -> HookResult | None:
        """Fold one handler's result. Returns the final result if it denied, else None."""
        action = result.action
        if action == "deny":
            return self._final(result, decided_by=handler)
        if action == "modify":
            if modifies(result):
                self.data = result.data  # type: ignore[assignment]  # modifies: not None
                self._modified_by.append(handler)
        elif action == "inject_context":
            items = self._injections(handler, result)
            if items:
                self._injectors.append((handler, result))
                self._items.extend(items)
        elif action == "ask_user":
            self._asks.append((handler, result))
            if self._ask_user is None:
                self._ask_user, self._ask_user_by = result, handler
        return None

    def fail(
        self, handler: str, kind: FailureKind, policy: FailurePolicy, message: str
    ) -> HookResult | None:
        """Record a handler failure. With policy ``deny`` — and always for a ``bad_reply``,
        a result that could not be read — returns the final (deny) result."""
        policy = failure_policy_applied(kind, policy)
        self._failures.append(
            HandlerFailure(handler=handler, kind=kind, policy=policy, message=message)
        )
        if policy == "deny":
            if kind == "bad_reply":  # the details are on the failure
                reason = INVALID_RESULT_REASON
            else:
                reason = f"handler {handler!r} failed ({kind}) and its failure policy is deny"
                reason += f": {message}" if message else ""
            return self._final(HookResult(action="deny", reason=reason), decided_by=handler)
        return None

    @property
    def failures(self) -> list[HandlerFailure]:
        """Failures recorded so far, in the order they were folded."""
        return self._failures

    def asks(self) -> list[HookResult]:
        """Every ``ask_user`` result folded so far, in fold (priority) order, each as its
        handler made it with hookbus's fields of this fold set (``decided_by``: that
        handler). `result` keeps the first only (amplifier-core's rule for its result); an
        approval asks every one of these."""
        return [self._final(r, decided_by=handler) for handler, r in self._asks]

    def result(self) -> HookResult:
        """The final result after every handler was folded (no deny happened)."""
        if self._ask_user is not None:
            return self._final(self._ask_user, decided_by=self._ask_user_by)
        if self._items:
            first_handler, first = self._injectors[0]
            items = self._items
            base = (
                first
                if len(self._injectors) == 1
                else HookResult(action="inject_context", suppress_output=first.suppress_output)
            )
            merged = msgspec.structs.replace(
                base,
                context_injection="\n\n".join(i.content for i in items),
                context_injection_role=items[0].role,
                ephemeral=any(i.ephemeral for i in items),
                append_to_last_tool_result=any(i.append_to_last_tool_result for i in items),
                context_injections=list(items),
            )
            return self._final(merged, decided_by=first_handler)
        # `_final` of a continue with the data, in one replace of a template: HookResult's
        # metaclass (which drops unknown keywords) makes constructing one, and passing
        # keywords on through `**`, each cost several times this replace
        return msgspec.structs.replace(
            _CONTINUE,
            data=self.data,
            context_injections=[],  # the template's list is never handed out
            chained_data=self.data,
            failures=list(self._failures),
            decided_by=self._modified_by[-1] if self._modified_by else None,
            modified_by=list(self._modified_by),
        )

    def _injections(self, handler: str, result: HookResult) -> list[ContextInjection]:
        """The injections one result makes, stamped with its handler and the event."""
        if result.context_injections:
            return [
                msgspec.structs.replace(i, hook_name=handler, event=self._event)
                for i in result.context_injections
            ]
        if result.context_injection is None:
            return []
        return [
            ContextInjection(
                content=result.context_injection,
                role=result.context_injection_role,
                ephemeral=result.ephemeral,
                append_to_last_tool_result=result.append_to_last_tool_result,
                hook_name=handler,
                event=self._event,
            )
        ]

    def _final(self, result: HookResult, *, decided_by: str | None) -> HookResult:
        """`result` with hookbus's fields of this fold set (fresh lists)."""
        return msgspec.structs.replace(
            result,
            chained_data=self.data,
            failures=list(self._failures),
            decided_by=decided_by,
            modified_by=list(self._modified_by),
        )
