"""Free loopback ports for servers whose port is written into a config (or a context)
before they start.

A port found free is not reserved: between `free_port` and the server's bind another
process (the other Python's suite in `.ci/run`, a client's outgoing connection, which the
kernel gives a port from the same range) may take it. `on_free_port` starts again on
another port when the start failed because of that ("address already in use").
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TypeVar

__all__ = ["free_port", "on_free_port"]

T = TypeVar("T")

TRIES = 5
"""Starts tried, each on a newly found port."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def on_free_port(start: Callable[[int], T], tries: int = TRIES) -> T:
    """`start(port)` on a free port; again on another while it fails with "address
    already in use" in its error (the port was taken meanwhile), at most `tries` times.

    Raises:
        whatever `start` raised last, or at once for any other failure.
    """
    for attempt in range(tries):
        try:
            return start(free_port())
        except Exception as exc:
            if "address already in use" not in str(exc) or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover
