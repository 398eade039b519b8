"""A dispatcher routed over a connection of the caller's, without the handler registry
(`route_over`): what a test kit runs a worker's handlers through in one process."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from hookbus._core.declarations import check_declaration
from hookbus.schemas import HandlerDeclaration, encode, handler_key

from ._dispatcher import HookDispatcher

__all__ = ["route_over"]


async def route_over(
    dispatcher: HookDispatcher, connection: Any, declarations: Iterable[HandlerDeclaration]
) -> list[HandlerDeclaration]:
    """Start `dispatcher` (made with no connection: ``HookDispatcher(None, ...)``, not
    started) routing `declarations` over `connection`, an object with nats-py's
    ``new_inbox``, ``subscribe`` and ``publish`` (a test kit's in-process loopback), instead
    of following the handlers bucket: the same inboxes and requests as `HookDispatcher.start`
    makes, and one remote route per declaration, checked as every dispatcher checks the
    registry's records (`check_declaration`: bounds clamped, subjects derived).

    Returns:
        The declarations as routed (their subjects are where the requests go).
    Raises:
        BadRequestError: a declaration every dispatcher would refuse.
        RuntimeError: `dispatcher` has a connection of its own or was started.
    """
    router = dispatcher._router
    await router.start_over(connection)
    routed = []
    for sent in declarations:
        decl = check_declaration(handler_key(sent.event, sent.name), encode(sent))
        router.table.put_remote(decl)
        routed.append(decl)
    return routed
