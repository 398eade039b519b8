"""The in-process shape, shared by hookbus and amplifier-core: 3 async handlers on one
registry, each answering what `make_result` makes (``HookResult(action="continue")``, or
None), and sequential ``emit`` calls timed one by one.

Standard library only: the amplifier-core side imports this module from a venv of its own
(see `_amplifier.py`), where hookbus is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["EVENT", "register_three", "sample_emits"]

EVENT = "bench:local"


def register_three(registry: Any, make_result: Callable[[], Any]) -> Any:
    """Register 3 async handlers (priorities 1, 2, 3) for `EVENT` on `registry` (an
    amplifier-core `HookRegistry` or a hookbus `HookDispatcher()`); returns `registry`."""
    for priority in (1, 2, 3):

        async def handler(event: str, data: dict[str, Any]) -> Any:
            return make_result()

        registry.register(EVENT, handler, priority=priority, name=f"local_{priority}")
    return registry


async def sample_emits(registry: Any, data: dict[str, Any], n: int) -> list[float]:
    """`n` sequential ``await registry.emit(EVENT, data)``, each timed alone (seconds).

    Raises RuntimeError if an emit does not answer ``continue`` (a handler that failed
    would make the figure look good).
    """
    out: list[float] = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        result = await registry.emit(EVENT, data)
        out.append(clock() - t0)
        if result.action != "continue":
            raise RuntimeError(f"in-process emit answered {result.action!r}: {result.reason}")
    return out
