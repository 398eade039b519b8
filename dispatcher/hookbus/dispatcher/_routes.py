"""The routing table: every handler of every event, in call order. Pure, no I/O.

Order (amplifier-core: "lower priority numbers execute first"): by priority; at equal
priority, in-process handlers first in registration order (exactly amplifier-core's stable
sort, so an in-process-only dispatcher behaves like `HookRegistry`), then remote handlers
by name (deterministic across dispatcher replicas).

Lookups on the emit path are one dict get of an immutable tuple, rebuilt on change.
"""

from __future__ import annotations

import fnmatch
import itertools
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hookbus.schemas import FailurePolicy, HandlerDeclaration

__all__ = ["LocalHandler", "Route", "RoutingTable"]

LocalHandler = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""amplifier-core's handler signature: ``async def handler(event, data) -> HookResult``."""


def _compile_filter(patterns: Iterable[str] | None) -> re.Pattern[str] | None:
    if patterns is None:
        return None
    return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns) or "(?!)")


@dataclass(frozen=True, slots=True, eq=False)
class Route:
    """One handler as the dispatcher calls it: in-process (`local`) or remote (`subject`)."""

    event: str
    name: str
    priority: int
    timeout_s: float | None
    """Seconds per call; None: no limit (amplifier-core in-process default)."""
    failure_policy: FailurePolicy
    parallel: bool
    tool_filter: tuple[str, ...] | None
    local: LocalHandler | None = None
    subject: str = ""
    retry_safe: bool = False
    """Running it twice for one call is harmless: a slow call may be hedged."""
    order: tuple[int, int, int | str] = (0, 0, 0)
    _filter: re.Pattern[str] | None = field(default=None, repr=False)

    @property
    def remote(self) -> bool:
        return self.local is None

    def matches(self, data: dict[str, Any]) -> bool:
        """Whether the tool filter admits this event's ``data["tool_name"]``.

        No filter admits everything; a filter never admits data without a string tool name.
        """
        if self._filter is None:
            return True
        tool = data.get("tool_name")
        return isinstance(tool, str) and self._filter.fullmatch(tool) is not None

    @classmethod
    def make(
        cls,
        *,
        event: str,
        name: str,
        priority: int,
        timeout_s: float | None,
        failure_policy: FailurePolicy,
        parallel: bool,
        tool_filter: Iterable[str] | None,
        local: LocalHandler | None = None,
        subject: str = "",
        seq: int = 0,
        retry_safe: bool = False,
    ) -> Route:
        patterns = None if tool_filter is None else tuple(tool_filter)
        order: tuple[int, int, int | str] = (priority, 0, seq) if local else (priority, 1, name)
        return cls(
            event=event,
            name=name,
            priority=priority,
            timeout_s=timeout_s,
            failure_policy=failure_policy,
            parallel=parallel,
            tool_filter=patterns,
            local=local,
            subject=subject,
            retry_safe=retry_safe,
            order=order,
            _filter=_compile_filter(patterns),
        )

    @classmethod
    def from_declaration(cls, decl: HandlerDeclaration) -> Route:
        return cls.make(
            event=decl.event,
            name=decl.name,
            priority=decl.priority,
            timeout_s=decl.timeout_s,
            failure_policy=decl.failure_policy,
            parallel=decl.parallel,
            tool_filter=decl.tool_filter,
            subject=decl.subject,
            retry_safe=decl.retry_safe,
        )


class RoutingTable:
    """In-process and remote routes per event, with copy-on-write snapshots."""

    def __init__(self) -> None:
        self._local: dict[str, list[Route]] = {}
        self._remote: dict[str, dict[str, Route]] = {}
        self._snapshots: dict[str, tuple[Route, ...]] = {}
        self._seq = itertools.count()

    def routes(self, event: str) -> tuple[Route, ...]:
        """The routes of `event` in call order (an immutable snapshot)."""
        return self._snapshots.get(event, ())

    def events(self) -> list[str]:
        """Events with at least one route, in first-registration order."""
        return list(self._snapshots)

    def next_seq(self) -> int:
        return next(self._seq)

    def add_local(self, route: Route) -> Callable[[], None]:
        """Add an in-process route; returns the function that removes it (idempotent)."""
        self._local.setdefault(route.event, []).append(route)
        self._rebuild(route.event)

        def remove() -> None:
            routes = self._local.get(route.event, [])
            if route in routes:
                routes.remove(route)
                self._rebuild(route.event)

        return remove

    def put_remote(self, decl: HandlerDeclaration) -> None:
        """Add or replace the remote route of a declaration."""
        self._remote.setdefault(decl.event, {})[decl.name] = Route.from_declaration(decl)
        self._rebuild(decl.event)

    def delete_remote(self, event: str, name: str) -> None:
        if self._remote.get(event, {}).pop(name, None) is not None:
            self._rebuild(event)

    def replace_remote(self, decls: Iterable[HandlerDeclaration]) -> None:
        """Replace every remote route at once (a full resync of the registry)."""
        old_events = set(self._remote)
        self._remote = {}
        for decl in decls:
            self._remote.setdefault(decl.event, {})[decl.name] = Route.from_declaration(decl)
        for event in old_events | set(self._remote):
            self._rebuild(event)

    def _rebuild(self, event: str) -> None:
        routes = [*self._local.get(event, ()), *self._remote.get(event, {}).values()]
        if routes:
            self._snapshots[event] = tuple(sorted(routes, key=lambda r: r.order))
        else:
            self._snapshots.pop(event, None)
