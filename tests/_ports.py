"""Free loopback ports for servers whose port is written into a config (or a context)
before they start.

A port found free is not reserved: between `free_ports` and the server's bind another
process may take it. The ports are therefore drawn below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel gives every outgoing
connection its local port from: a port the kernel picked (bind to port 0) was taken so by
another test's client before its server bound it, and a 3-node cluster never formed (seen
in CI). What is left is two drawers picking the same port at once (the other Python's
suite in `.ci/run`), rare among 12,000; `on_free_port` starts again on another port when a
start failed with "address already in use".
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import TypeVar

__all__ = ["free_port", "free_ports", "on_free_port"]

T = TypeVar("T")

TRIES = 5
"""Starts tried, each on a newly found port."""

LOWEST = 20000
"""The lowest port drawn (below: ports other software on the machine may listen on)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default: 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1, free a moment ago (bound together, then
    released), from below the kernel's ephemeral range (see the module)."""
    high = _ephemeral_low()
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            port = random.randrange(LOWEST, high) if high - LOWEST > 1000 else 0
            if port in ports:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(s.getsockname()[1])
        return ports
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (see `free_ports`)."""
    return free_ports(1)[0]


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
