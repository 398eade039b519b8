"""CPU per in-process emit of a parallel group of 3 handlers, against 3 sequential ones.

    .venv/bin/python benchmarks/parallel_inprocess.py                # 5 rounds x 20,000 emits
    .venv/bin/python benchmarks/parallel_inprocess.py --n 5000 --rounds 3

A `HookDispatcher()` (no connection) with 3 async handlers that return None at once,
registered ``parallel=True`` for one event and sequentially for another; the rounds
alternate between the two. Prints the median CPU time per emit (`time.process_time`) of
each and their ratio: a parallel group costs its tasks (on Python 3.12+ started eagerly,
see docs/performance.md, "Parallel groups"), the sequential handlers are called inline.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

from hookbus.dispatcher import HookDispatcher

DATA = {"tool_name": "bash", "tool_input": {"command": "ls"}}


def dispatcher() -> HookDispatcher:
    d = HookDispatcher()
    for i in (1, 2, 3):

        async def handler(event: str, data: dict[str, Any]) -> None:
            return None

        d.register("bench:parallel", handler, priority=i, name=f"p{i}", parallel=True)
        d.register("bench:sequential", handler, priority=i, name=f"s{i}")
    return d


async def cpu_per_emit(d: HookDispatcher, event: str, n: int) -> float:
    """µs of CPU per emit over `n` sequential emits of `event`.

    Raises RuntimeError if an emit does not continue (a failed handler is no figure)."""
    started = time.process_time()
    for _ in range(n):
        r = await d.emit(event, DATA)
        if r.action != "continue" or r.failures:
            raise RuntimeError(f"{event}: {r.action} {r.failures}")
    return (time.process_time() - started) / n * 1e6


async def main(n: int, rounds: int) -> None:
    d = dispatcher()
    for event in ("bench:parallel", "bench:sequential"):
        await cpu_per_emit(d, event, 2000)  # warm-up
    out: dict[str, list[float]] = {"bench:parallel": [], "bench:sequential": []}
    for _ in range(rounds):
        for event, figures in out.items():
            figures.append(await cpu_per_emit(d, event, n))
    par, seq = (statistics.median(v) for v in out.values())
    print(f"Python {sys.version.split()[0]}, median of {rounds} rounds x {n} emits")
    print(f"sequential 3: {seq:.1f} us CPU per emit")
    print(f"parallel 3:   {par:.1f} us CPU per emit ({par / seq:.2f}x the sequential)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="emits per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.rounds))
