"""The benchmark's measurement shapes, one place each: sequential latency in rotating rounds
(`latency_rounds`), calls per second with a fixed number in flight (`throughput`), the CPU
used during a window (`cpu_window`), and the count of failed calls (`Failures`).

Times are seconds (``time.perf_counter``) unless a name says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_FAILURES",
    "REFUSED",
    "BenchAborted",
    "Call",
    "CpuWindow",
    "Failures",
    "Rate",
    "Rounds",
    "Side",
    "cpu_note",
    "cpu_window",
    "emit_outcome",
    "latency_rounds",
    "median",
    "pct",
    "throughput",
    "timed",
]


@dataclass(frozen=True)
class Rounds:
    """How much a latency benchmark samples: `rounds` interleaved rounds of `per_round`
    sequential calls per side, after `warmup` calls per side that are not measured."""

    rounds: int
    per_round: int
    warmup: int


Call = Callable[[], Awaitable[Any]]
"""One call of a side: returns True (ok), `REFUSED`, or False or a message (failed)."""
Sampler = Callable[[int], Awaitable[list[float]]]
"""``await sample(n)``: n latency samples, seconds."""

REFUSED = "refused"
"""What a call returns when every replica it was sent to refused it (``busy``): the handler
did not run. Counted apart from failures: a refusal is the concurrency bound at work."""
MAX_FAILURES = 5
"""Failed calls (handler timeout, no responders, ...) after which the run stops: each one
may cost a 5 s timeout, and a row with failures measures something else."""
WARMUP_S = 0.3
"""Unmeasured seconds before each throughput measurement."""


class BenchAborted(RuntimeError):
    """Too many failed calls: the run is stopped with the workers' last log lines."""


class Failures:
    """Counts the failed and the refused calls of one row; raises `BenchAborted` past
    `MAX_FAILURES` failed calls."""

    def __init__(self, row: str) -> None:
        self.row = row
        self.count = 0
        self.refused = 0
        self.first = ""
        """The first failed call's message, if it gave one."""

    def record(self, ok: object) -> None:
        """Count one call's outcome (see `Call`)."""
        if ok is True:
            return
        if ok == REFUSED:
            self.refused += 1
            return
        self.count += 1
        if isinstance(ok, str) and not self.first:
            self.first = ok
        if self.count > MAX_FAILURES:
            detail = f" (first: {self.first})" if self.first else ""
            raise BenchAborted(f"{self.row}: more than {MAX_FAILURES} failed calls{detail}")


def emit_outcome(result: Any) -> bool | str:
    """A hookbus emit's `HookResult` as a `Call` outcome: True with no handler failure,
    `REFUSED` when every failure is a refusal (``busy: ...``: the handler did not run), else
    the first failure's ``handler: kind: message``."""
    failures = result.failures
    if not failures:
        return True
    if all(f.message.startswith("busy:") for f in failures):
        return REFUSED
    f = failures[0]
    return f"{f.handler}: {f.kind}: {f.message}"


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# -- latency ---------------------------------------------------------------------------------
def timed(call: Call, failures: Failures | None = None) -> Sampler:
    """A sampler timing each awaited `call` alone (``perf_counter`` around the await)."""

    async def sample(n: int) -> list[float]:
        out: list[float] = []
        clock = time.perf_counter
        for _ in range(n):
            t0 = clock()
            ok = await call()
            out.append(clock() - t0)
            if failures is not None:
                failures.record(ok)
        return out

    return sample


@dataclass
class Side:
    """One side of a latency row: what is sampled, how many samples per round, and the
    samples taken (seconds)."""

    name: str
    sample: Sampler
    per_round: int
    warmup: int
    samples: list[float] = field(default_factory=list)

    def p(self, q: float) -> float:
        return pct(self.samples, q)


async def latency_rounds(sides: list[Side], rounds: int) -> None:
    """Warm every side up, then sample each in `rounds` rounds; the order rotates each
    round (A/B/C, B/C/A, ...) so drift and noise hit every side alike."""
    for side in sides:
        await side.sample(side.warmup)
    k = len(sides)
    for r in range(rounds):
        for j in range(k):
            side = sides[(j + r) % k]
            side.samples += await side.sample(side.per_round)


# -- CPU accounting (Linux /proc; absent elsewhere) -------------------------------------------
def _cpu_jiffies() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far; 0.0 if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


@dataclass
class CpuWindow:
    machine_busy: float | None = None
    """Fraction of all cores busy (0..1) during the window, every process on the machine."""
    ours_busy: float | None = None
    """Fraction of all cores used by this process and the watched children (0..1)."""
    client_cpu_s: float = 0.0
    """CPU seconds used by this (client) process during the window."""
    elapsed_s: float = 0.0
    """Wall-clock seconds of the window."""


@contextlib.contextmanager
def cpu_window(pids: list[int] | None = None) -> Iterator[CpuWindow]:
    """Measure CPU use over the ``with`` body: the machine's, ours (this process and
    `pids`), and this process's alone."""
    pids = pids or []
    out = CpuWindow()
    j0, p0, t0 = _cpu_jiffies(), time.process_time(), time.perf_counter()
    c0 = sum(_proc_cpu_s(pid) for pid in pids)
    yield out
    j1, p1, t1 = _cpu_jiffies(), time.process_time(), time.perf_counter()
    c1 = sum(_proc_cpu_s(pid) for pid in pids)
    out.client_cpu_s = p1 - p0
    out.elapsed_s = t1 - t0
    if j0 and j1 and j1[1] > j0[1]:
        out.machine_busy = (j1[0] - j0[0]) / (j1[1] - j0[1])
        out.ours_busy = (out.client_cpu_s + c1 - c0) / ((t1 - t0) * (os.cpu_count() or 1))


def cpu_note(label: str, cpu: CpuWindow) -> str | None:
    """One line on CPU use during a throughput window; flags a CPU-bound figure."""
    if cpu.machine_busy is None or cpu.ours_busy is None:
        return None
    cores = os.cpu_count() or 1
    client = cpu.client_cpu_s / cpu.elapsed_s if cpu.elapsed_s else 0.0
    text = (
        f"{label}: our processes used {cpu.ours_busy:.0%} of {cores} cores"
        f" (the client {client:.0%} of one), the machine was {cpu.machine_busy:.0%} busy"
    )
    if client >= 0.9:
        text += " -> the client's one event loop is CPU-bound"
    elif cpu.ours_busy >= 0.85:
        text += f" -> CPU-bound: the {cores} cores, not the bus, set this figure"
    elif cpu.machine_busy >= 0.85:
        text += " -> the machine was saturated by other work too: a noisy figure"
    return text


# -- throughput ------------------------------------------------------------------------------
@dataclass
class Rate:
    per_s: float
    """Calls completed without failure or refusal, per second."""
    calls: int
    errors: int
    refused: int
    cpu: CpuWindow


async def throughput(
    call: Call, in_flight: int, seconds: float, failures: Failures, pids: list[int] | None = None
) -> Rate:
    """Calls per second with `in_flight` calls outstanding for `seconds` (after `WARMUP_S`).

    A failed call (see `Call`; or one that raises) and a refused one are counted in
    `failures`, not retried, and not in the rate.
    """
    calls = 0
    before, refused_before = failures.count, failures.refused

    async def drive(until: float, count: bool) -> None:
        nonlocal calls
        clock = time.perf_counter
        while clock() < until:
            try:
                ok = await call()
            except BenchAborted:
                raise
            except Exception as exc:
                ok = f"{type(exc).__name__}: {exc}"
            failures.record(ok)
            calls += count and ok is True

    async def run(duration: float, count: bool) -> float:
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(in_flight):
                    tg.create_task(drive(t0 + duration, count))
        except* BenchAborted as group:
            raise group.exceptions[0] from None
        return time.perf_counter() - t0

    await run(WARMUP_S, False)
    with cpu_window(pids) as cpu:
        elapsed = await run(seconds, True)
    return Rate(
        calls / elapsed, calls, failures.count - before, failures.refused - refused_before, cpu
    )
