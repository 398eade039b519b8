"""The remote calls of one emit in flight at once, per worker process (`Neighbours`)."""

from __future__ import annotations

__all__ = ["Neighbours"]


class Neighbours:
    """The remote calls of one emit in flight at once, per worker process's handler set
    (`Route.handler_set`; an unknown set, empty, counts as one): how long another call of
    the same process may wait behind them.

    A call's overlap is the sum of the timeouts (seconds) of the calls of its set that were
    in flight when it opened or opened after it (a neighbour that computes holds the
    process's event loop for up to its timeout, and past it for as long as it computes).
    Counters only: `open` and `overlap` cost the same whatever the number of calls.
    """

    __slots__ = ("_in_flight", "_opened")

    def __init__(self) -> None:
        self._in_flight: dict[frozenset[str], float] = {}
        self._opened: dict[frozenset[str], float] = {}

    def open(self, key: frozenset[str], timeout_s: float) -> tuple[float, float]:
        """Count a call of `key` with `timeout_s` in flight; the mark `overlap` takes."""
        before = self._in_flight.get(key, 0.0)
        opened = self._opened.get(key, 0.0) + timeout_s
        self._in_flight[key] = before + timeout_s
        self._opened[key] = opened
        return before, opened

    def close(self, key: frozenset[str], timeout_s: float) -> None:
        """The call of `key` opened with `timeout_s` is over."""
        self._in_flight[key] = max(self._in_flight.get(key, 0.0) - timeout_s, 0.0)

    def overlap(self, key: frozenset[str], mark: tuple[float, float]) -> float:
        """Seconds: the timeouts of the other calls of `key` in flight with the call that
        `open` gave `mark`, summed."""
        before, opened = mark
        return before + self._opened.get(key, 0.0) - opened
