"""The routing table: every handler of every event, in call order. Pure, no I/O.

Order (amplifier-core: "lower priority numbers execute first"): by priority; at equal
priority, in-process handlers first in registration order (exactly amplifier-core's stable
sort, so an in-process-only dispatcher behaves like `HookRegistry`), then remote handlers
by name (deterministic across dispatcher replicas).

Lookups on the emit path are one dict get of an immutable tuple, rebuilt on change.

Remote routes come from validated declarations only (`check_declaration`): the subject is
always derived from (event, name). A `RequiredHandler` with no declaration (and no
in-process handler of that name) becomes a route of its own to the handler's derived
subject, so the call fails with ``no_responders`` and the requirement's failure policy
decides: a required handler is never silently absent. A required handler that is declared
(or registered in-process) keeps the stricter of the two failure policies: a declaration
cannot loosen the operator's requirement (a ``deny`` requirement stays fail-closed).

Options (priority, timeout, failure policy, tool filter) are bounded and tool filters
matched by `hookbus._core.handler_options`, as workers judge them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hookbus._core.handler_options import OPTIONS, HandlerOptions, ToolFilter, stricter_policy
from hookbus.schemas import (
    FailurePolicy,
    HandlerDeclaration,
    RequiredHandler,
    chain_subject,
    handler_set_id,
    handler_subject,
)

__all__ = ["LocalHandler", "Route", "RoutingTable"]

LocalHandler = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""amplifier-core's handler signature: ``async def handler(event, data) -> HookResult``."""

_EVERY = ToolFilter.EVERY
"""No filter (`ToolFilter.of(None)`): it admits every event's data."""


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
    pure: bool = False
    """Free of side effects: may be called speculatively, at once with adjacent pure
    handlers (see `HandlerDeclaration.pure`)."""
    chain: str = ""
    """The chain subject of the worker processes serving it with others (its declared
    handler set), or "" (in-process, no set, or a set too large)."""
    handler_set: frozenset[str] = frozenset()
    """The names its worker process serves (what a chain to `chain` may hold)."""
    order: tuple[int, int, int | str] = (0, 0, 0)
    _filter: ToolFilter = field(default=ToolFilter.EVERY, repr=False)

    @property
    def remote(self) -> bool:
        return self.local is None

    def matches(self, data: dict[str, Any]) -> bool:
        """Whether the tool filter admits this event's ``data["tool_name"]`` (`ToolFilter`:
        no filter admits everything; a filter never admits data without a string tool
        name)."""
        flt = self._filter
        return flt is _EVERY or flt.matches(data)  # no filter: no call

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
        pure: bool = False,
        handler_set: Iterable[str] | None = None,
    ) -> Route:
        """A route with its tool filter compiled (`ToolFilter.of`; the other options are
        the caller's to check: `HandlerOptions`, `check_declaration`).

        Raises:
            BadRequestError: the tool filter is out of its bounds.
        """
        flt = ToolFilter.of(tool_filter)
        order: tuple[int, int, int | str] = (priority, 0, seq) if local else (priority, 1, name)
        return cls(
            event=event,
            name=name,
            priority=priority,
            timeout_s=timeout_s,
            failure_policy=failure_policy,
            parallel=parallel,
            tool_filter=flt.patterns,
            local=local,
            subject=subject,
            retry_safe=retry_safe or pure,
            pure=pure,
            chain=chain_subject(event, handler_set_id(handler_set)) if handler_set else "",
            handler_set=frozenset(handler_set or ()),
            order=order,
            _filter=flt,
        )

    @classmethod
    def _of(
        cls,
        event: str,
        name: str,
        options: HandlerOptions,
        *,
        local: LocalHandler | None = None,
        subject: str = "",
        seq: int = 0,
        handler_set: Iterable[str] | None = None,
    ) -> Route:
        """The route of a handler with checked `options` (every option of `OPTIONS`)."""
        return cls.make(
            event=event,
            name=name,
            **{o: getattr(options, o) for o in OPTIONS},
            local=local,
            subject=subject,
            seq=seq,
            handler_set=handler_set,
        )

    @classmethod
    def from_declaration(cls, decl: HandlerDeclaration) -> Route:
        """The route of a declaration: subject derived from (event, name), whatever the
        declaration says; options checked (`HandlerOptions.remote`, as on every path: the
        timeout clamped to `MAX_HANDLER_TIMEOUT_S` seconds).

        Raises:
            BadRequestError: the names are too long for a subject, or an option is out of
                its bounds (never for a declaration `check_declaration` accepted).
        """
        options = HandlerOptions.remote(**{o: getattr(decl, o) for o in OPTIONS})
        subject = handler_subject(decl.event, decl.name)
        return cls._of(
            decl.event, decl.name, options, subject=subject, handler_set=decl.handler_set
        )

    @classmethod
    def from_required(cls, req: RequiredHandler) -> Route:
        """The stand-in route of a required handler that has no declaration; its options
        checked as a declaration's (`HandlerOptions.remote`; the others default).

        Raises:
            BadRequestError: the names are too long for a subject, or an option is out of
                its bounds (never for a record `check_required` accepted).
        """
        options = HandlerOptions.remote(
            priority=req.priority,
            timeout_s=req.timeout_s,
            failure_policy=req.failure_policy,
            tool_filter=req.tool_filter,
        )
        return cls._of(req.event, req.name, options, subject=handler_subject(req.event, req.name))


class RoutingTable:
    """In-process and remote routes per event, with copy-on-write snapshots."""

    def __init__(self) -> None:
        self._local: dict[str, list[Route]] = {}
        self._remote: dict[str, dict[str, Route]] = {}
        self._required: dict[str, dict[str, Route]] = {}
        self._snapshots: dict[str, tuple[Route, ...]] = {}
        self._seen: dict[str, None] = {}
        self._seq = itertools.count()

    def routes(self, event: str) -> tuple[Route, ...]:
        """The routes of `event` in call order (an immutable snapshot)."""
        return self._snapshots.get(event, ())

    def events(self) -> list[str]:
        """Events that have had a route, in first-registration order (an event whose
        routes were all removed stays, with none: amplifier-core lists it as ``[]``)."""
        return list(self._seen)

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

    def remove_local_named(self, name: str) -> int:
        """Remove every in-process route named `name`, on every event; returns how many."""
        removed = 0
        for event, routes in self._local.items():
            kept = [r for r in routes if r.name != name]
            if len(kept) != len(routes):
                removed += len(routes) - len(kept)
                self._local[event] = kept
                self._rebuild(event)
        return removed

    def put_remote(self, decl: HandlerDeclaration) -> None:
        """Add or replace the remote route of a (validated) declaration."""
        self.put_route(Route.from_declaration(decl))

    def put_route(self, route: Route, *, required: bool = False) -> None:
        """Add or replace a remote route (`Route.from_declaration`), or with `required`
        a required handler's stand-in (`Route.from_required`)."""
        routes = self._required if required else self._remote
        routes.setdefault(route.event, {})[route.name] = route
        self._rebuild(route.event)

    def delete_remote(self, event: str, name: str) -> None:
        if self._remote.get(event, {}).pop(name, None) is not None:
            self._rebuild(event)

    def put_required(self, req: RequiredHandler) -> None:
        """Add or replace a required handler of `req.event`."""
        self.put_route(Route.from_required(req), required=True)

    def delete_required(self, event: str, name: str) -> None:
        if self._required.get(event, {}).pop(name, None) is not None:
            self._rebuild(event)

    def replace_remote(
        self,
        decls: Iterable[HandlerDeclaration],
        required: Iterable[RequiredHandler] | None = None,
    ) -> None:
        """Replace every remote route (and, if given, every requirement) at once: a full
        resync of the registry."""
        old_events = set(self._remote) | set(self._required)
        self._remote = {}
        for decl in decls:
            self._remote.setdefault(decl.event, {})[decl.name] = Route.from_declaration(decl)
        if required is not None:
            self._required = {}
            for req in required:
                self._required.setdefault(req.event, {})[req.name] = Route.from_required(req)
        for event in old_events | set(self._remote) | set(self._required):
            self._rebuild(event)

    def required(self, event: str) -> list[str]:
        """Names of the handlers required for `event`."""
        return sorted(self._required.get(event, {}))

    def _rebuild(self, event: str) -> None:
        """The snapshot of `event`: in-process and remote routes, each required one with
        the stricter failure policy of its requirement and its own (`_as_required`), and
        a stand-in for each required handler that has neither."""
        local = self._local.get(event, ())
        remote = self._remote.get(event, {})
        required = self._required.get(event, {})
        present = {r.name for r in local} | set(remote)
        standins = [r for n, r in required.items() if n not in present]
        routes = [*local, *remote.values()]
        if required:
            routes = [_as_required(r, required.get(r.name)) for r in routes]
        routes += standins
        if routes:
            self._snapshots[event] = tuple(sorted(routes, key=lambda r: r.order))
            self._seen[event] = None
        else:
            self._snapshots.pop(event, None)


def _as_required(route: Route, requirement: Route | None) -> Route:
    """`route` with the stricter failure policy of its own and its requirement's
    (`stricter_policy`); `route` itself when that changes nothing."""
    if requirement is None:
        return route
    policy = stricter_policy(route.failure_policy, requirement.failure_policy)
    if policy == route.failure_policy:
        return route
    return dataclasses.replace(route, failure_policy=policy)
