"""Stepping a coroutine by hand: its first step now, the rest awaited later."""

from __future__ import annotations

from typing import Any

__all__ = ["Resumed"]


class Resumed:
    """Awaitable: the rest of a coroutine whose first step was taken with ``send(None)``
    and suspended on `first`; awaiting it continues the coroutine as ``await coro`` would
    have (values, exceptions, cancellation and close passed through)."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Any, first: Any) -> None:
        self._coro = coro
        self._first = first

    def __await__(self) -> Any:
        coro, value = self._coro, self._first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
