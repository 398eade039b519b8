"""The fleet rows: 1, 2, 4 and 8 agent processes emitting at once to a 2-replica worker,
against the same agents doing raw ``nc.request`` to a 2-replica raw responder.

Eight agent processes (`_fleet_agent.py`) start once; for each fleet size the first N of
them run a window of the same length together (start and end on ``time.monotonic``, the
clock every process on the machine shares), raw and emit alternating in rounds (the order
flips each round). The aggregate rate is the sum of the agents' calls completed in the
window, divided by its length; the median over the rounds is reported.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from _measure import WARMUP_S, BenchAborted, cpu_window, median
from _procs import JsonChild, Proc, agent_proc, raw_proc, running, worker_proc
from _rows import Row, rps

__all__ = ["FLEET_SIZES", "TARGET", "bench_fleet"]

FLEET_SIZES = (1, 2, 4, 8)
TARGET = 0.80
"""At 8 agents: aggregate emits/s >= 80 % of raw requests/s in the same shape."""
START_MARGIN_S = 0.05
"""Seconds for the request to reach every agent before the warm-up counts."""


@dataclass
class Tally:
    rates: list[float] = field(default_factory=list)
    failures: int = 0
    refused: int = 0
    first: str = ""


async def _window(agents: list[JsonChild], mode: str, seconds: float, in_flight: int) -> Any:
    start = time.monotonic() + START_MARGIN_S + WARMUP_S
    ask = {"mode": mode, "start": start, "end": start + seconds, "in_flight": in_flight}
    return await asyncio.gather(*(a.ask(ask) for a in agents))


async def bench_fleet(
    url: str, *, seconds: float, rounds: int, in_flight: int,
    say: Callable[[str], None], procs: list[Proc],
) -> tuple[list[Row], list[str]]:  # fmt: skip
    """The fleet rows, one per size in `FLEET_SIZES` (the target applies at 8), and notes.

    `in_flight`: calls each agent keeps outstanding. Started processes are appended to
    `procs` (their last log lines are shown if the run aborts). Raises `BenchAborted` if
    an agent's window had failed calls past the allowance.
    """
    servers = [worker_proc("fleet_worker", url, label=f"fleet worker {i}") for i in (1, 2)]
    servers += [raw_proc(url, fleet=True, label=f"fleet raw responder {i}") for i in (1, 2)]
    agents = [agent_proc(url, f"agent-{i}") for i in range(1, max(FLEET_SIZES) + 1)]
    procs += [*servers, *agents]
    rows: list[Row] = []
    notes: list[str] = []
    say(f"fleet: 2 worker replicas, 2 raw responders, {len(agents)} agent processes ...")
    async with running(servers), running(agents):
        pids = [p.pid for p in [*servers, *agents]]
        for size in FLEET_SIZES:
            say(f"fleet: {size} agent(s), {rounds} rounds x {seconds}s per side ...")
            tallies = {"raw": Tally(), "emit": Tally()}
            for r in range(rounds):
                for mode in ("raw", "emit") if r % 2 == 0 else ("emit", "raw"):
                    with cpu_window(pids) as cpu:
                        answers = await _window(agents[:size], mode, seconds, in_flight)
                    t = tallies[mode]
                    t.rates.append(sum(a["calls"] for a in answers) / seconds)
                    t.failures += sum(a["failures"] for a in answers)
                    t.refused += sum(a["refused"] for a in answers)
                    t.first = t.first or next((a["first"] for a in answers if a["first"]), "")
                    if t.failures > 5:
                        raise BenchAborted(f"fleet of {size}, {mode}: failed calls ({t.first})")
            if size == max(FLEET_SIZES) and cpu.ours_busy is not None:
                notes.append(
                    f"fleet of {size}, last window: the agents, workers and responders used"
                    f" {cpu.ours_busy:.0%} of the cores, the machine was"
                    f" {cpu.machine_busy or 0:.0%} busy (the nats-server is in that figure only)"
                )
            rows.append(_row(size, in_flight, tallies))
    return rows, notes


def _row(size: int, in_flight: int, tallies: dict[str, Tally]) -> Row:
    raw, emit = median(tallies["raw"].rates), median(tallies["emit"].rates)
    ratio = emit / raw
    judged = size == max(FLEET_SIZES)
    return Row(
        measure=f"fleet of {size} agent process(es), {in_flight} in flight each,"
        " one-handler emit to 2 worker replicas",
        hookbus=rps(emit),
        baseline=f"{rps(raw)} (raw, 2 responders)",
        ratio=f"{ratio:.0%}",
        target=f">= {TARGET:.0%}" if judged else "reference",
        met=ratio >= TARGET if judged else None,
        figures={
            "agents": size,
            "in_flight_per_agent": in_flight,
            "req_per_s": emit,
            "raw_req_per_s": raw,
            "ratio": ratio,
            "rounds_req_per_s": tallies["emit"].rates,
            "rounds_raw_req_per_s": tallies["raw"].rates,
        },
        errors=tallies["emit"].failures + tallies["raw"].failures,
        refused=tallies["emit"].refused,
    )
