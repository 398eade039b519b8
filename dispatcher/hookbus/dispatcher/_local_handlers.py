"""In-process handlers of a routing table: amplifier-core's ``register`` / ``unregister``,
checked as a worker's options are (`HandlerOptions.local`); a sync one is marked
(`SyncHandler`) so that a time limit can cut it, as on a worker (`call_local`)."""

from __future__ import annotations

from collections.abc import Callable

from hookbus._core.handler_options import (
    DEFAULT_FAILURE_POLICY,
    DEFAULT_PRIORITY,
    HandlerOptions,
)
from hookbus.schemas import FailurePolicy, validate_name

from ._calls import SyncHandler
from ._route_table import LocalHandler, Route, RoutingTable

__all__ = ["LocalHandlers"]


class LocalHandlers:
    """Registers in-process handlers in `table`; `HookDispatcher.register` says how."""

    def __init__(self, table: RoutingTable) -> None:
        self._table = table

    def register(
        self,
        event: str,
        handler: LocalHandler | None = None,
        priority: int = DEFAULT_PRIORITY,
        name: str | None = None,
        *,
        timeout_s: float | None = None,
        failure_policy: FailurePolicy = DEFAULT_FAILURE_POLICY,
        tool_filter: list[str] | None = None,
        parallel: bool = False,
        pure: bool = False,
    ) -> Callable[[], None] | Callable[[LocalHandler], LocalHandler]:
        """`HookDispatcher.register`: see there for the arguments, result and errors. The
        options (`LOCAL_OPTIONS`) are checked here, when called, also in decorator form."""
        validate_name("event", event)
        options = HandlerOptions.local(
            priority=priority,
            timeout_s=timeout_s,
            failure_policy=failure_policy,
            tool_filter=tool_filter,
            parallel=parallel,
            pure=pure,
        )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"handler name must be a str, not {type(name).__name__}")
        if handler is None:

            def decorator(fn: LocalHandler) -> LocalHandler:
                self._add(event, fn, name, options)
                return fn

            return decorator
        return self._add(event, handler, name, options)

    def _add(
        self, event: str, handler: LocalHandler, name: str | None, options: HandlerOptions
    ) -> Callable[[], None]:
        name = name or str(getattr(handler, "__name__", "handler"))
        local = SyncHandler.wrap(handler)  # a sync one runs in a thread when time-limited
        route = Route._of(event, name, options, local=local, seq=self._table.next_seq())
        return self._table.add_local(route)
