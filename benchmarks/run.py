"""hookbus benchmark: every row of the performance table in one run, each figure against a
baseline measured in the same run.

    .venv/bin/python benchmarks/run.py            # about 2 minutes
    .venv/bin/python benchmarks/run.py --quick    # under a minute, fewer samples
    .venv/bin/python benchmarks/run.py --url nats://127.0.0.1:4222   # an existing server
    .venv/bin/python benchmarks/run.py --json out.json               # also every figure
    .venv/bin/python benchmarks/run.py --runs 3   # the whole table 3 times: medians, ranges

Starts its own nats-server (`hookbus.cli.EmbeddedNatsServer`) unless ``--url`` is given,
runs every handler, the raw responders and the fleet's agents in processes of their own,
and amplifier-core 2.0.2's in-process emit in a process of its own venv (made once under
``~/.cache/hookbus/bench-amplifier``). Prints one table: each figure, its baseline (raw
NATS, amplifier-core, a KV put, tracing off), the ratio, the target and MET / MISSED; with
``--runs N``, each run's table, then the median and range of each row. See
benchmarks/README.md for the method and for what "raw" means exactly. Not a test: nothing
here asserts; the exit status is 0 unless the run itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from rich.console import Console

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _workers as W  # noqa: E402  (siblings: the constants shared with the processes)
from _amplifier import (  # noqa: E402
    AMPLIFIER_VERSION,
    DEFAULT_VENV,
    Unavailable,
    amplifier_child,
    amplifier_python,
    amplifier_sampler,
)
from _fleet import FLEET_SIZES, bench_fleet  # noqa: E402
from _inprocess import register_three, sample_emits  # noqa: E402
from _measure import (  # noqa: E402
    BenchAborted,
    Call,
    Failures,
    Rate,
    Side,
    cpu_note,
    emit_outcome,
    latency_rounds,
    median,
    throughput,
    timed,
)
from _procs import JsonChild, Proc, raw_proc, running, worker_proc  # noqa: E402
from _raw import RawRequester  # noqa: E402
from _rows import Row, as_json, ms, render, render_summary, rps, us  # noqa: E402

from hookbus.cli import EmbeddedNatsServer  # noqa: E402
from hookbus.dispatcher import HookDispatcher  # noqa: E402
from hookbus.schemas import HookResult  # noqa: E402


@dataclass(frozen=True)
class Settings:
    latency_n: int
    """Measured sequential calls per side per latency row."""
    rounds: int
    """Rounds the latency calls are split into (the order of the sides rotates each round)."""
    warmup: int
    """Unmeasured calls per side before each latency row."""
    inproc_per_round: int
    """hookbus in-process emits per round of the chain row (microseconds each)."""
    in_flight: int
    """Requests kept in flight by the throughput rows."""
    tput_s: float
    """Seconds per throughput round."""
    tput_rounds: int
    """Throughput rounds per side (A/B interleaved); the median is reported."""
    io_s: float
    """Seconds of the 5 ms I/O row and of each replica row."""
    replica_bound: int
    """``--max-concurrency`` of each replica in the replica rows."""
    fleet_s: float
    """Seconds per fleet window."""
    fleet_rounds: int
    """Fleet windows per side and size (raw / emit alternating); the median is reported."""
    fleet_in_flight: int
    """Calls each fleet agent keeps in flight."""
    suspension_n: int
    """Measured resolve -> wake rounds."""
    tracing_n: int
    """Measured emits per tracing variant."""
    noop_n: int
    """In-process emits per side of the instrumentation note."""
    big_n: int
    """Measured calls per side of the 512 KB row (the 64 KB row: 4 times as many)."""


DEFAULT = Settings(
    latency_n=4000, rounds=10, warmup=300, inproc_per_round=2000, in_flight=256, tput_s=2.5,
    tput_rounds=3, io_s=3.0, replica_bound=8, fleet_s=1.5, fleet_rounds=2, fleet_in_flight=4,
    suspension_n=300, tracing_n=2000, noop_n=10000, big_n=400,
)  # fmt: skip
QUICK = Settings(
    latency_n=1000, rounds=4, warmup=100, inproc_per_round=1000, in_flight=256, tput_s=0.8,
    tput_rounds=2, io_s=1.0, replica_bound=8, fleet_s=0.6, fleet_rounds=1, fleet_in_flight=4,
    suspension_n=100, tracing_n=500, noop_n=4000, big_n=120,
)  # fmt: skip

ISSUE_ORDER = [
    "chain_vs_amplifier", "chain_vs_amplifier_none", "chain_one", "tracing", "collect",
    "big_512k", "big_64k", "throughput", "replicas_2", "replicas_4", "suspension", "one",
]  # fmt: skip
"""The rows of the issue's table ("Fast where users feel it"), in its order."""
MORE_ORDER = [
    "chain_three", "parallel", "fleet_8", "inprocess", "fleet_1", "fleet_2", "fleet_4", "io",
    "replicas_1",
]  # fmt: skip
"""The other rows: kept from earlier tables, and the references of the issue's rows."""
ORDER = ISSUE_ORDER + MORE_ORDER
SECTIONS = {ISSUE_ORDER[0]: "the issue's table", MORE_ORDER[0]: "more rows"}


@dataclass
class Run:
    """What the phases share: the client connection, the settings, the rows so far."""

    url: str
    nc: NATS
    s: Settings
    say: Callable[[str], None]
    amplifier: Path | Unavailable
    rows: dict[str, Row]
    notes: list[str]
    procs: list[Proc]
    raw: RawRequester
    raw_tput: float = 0.0
    """Raw nc.request req/s at `in_flight` (the 5 ms row's reference)."""


# -- the calls -------------------------------------------------------------------------------
def raw_call(raw: RawRequester, payload: bytes = W.RAW_PAYLOAD) -> Call:
    """One raw request (`_raw.RawRequester`: plain nats-py, leaner than ``nc.request``)."""
    request = raw.request

    async def call() -> bool:
        await request(W.RAW_SUBJECT, payload)
        return True

    return call


def scatter_call(raw: RawRequester, k: int) -> Call:
    """The raw shape of emit_and_collect of k: one publish, k replies on one inbox."""

    async def call() -> bool:
        await raw.scatter(W.RAW_SCATTER_SUBJECT, W.RAW_PAYLOAD, k)
        return True

    return call


def emit_call(d: HookDispatcher, event: str, data: dict[str, Any] = W.DATA) -> Call:
    async def call() -> bool | str:
        return emit_outcome(await d.emit(event, data))

    return call


def collect_call(d: HookDispatcher) -> Call:
    async def call() -> bool | str:
        got = len(await d.emit_and_collect(W.EVENT_COLLECT, W.DATA, timeout=2.0))
        return got == 3 or f"emit_and_collect: {got} answers, expected 3"

    return call


def sequential(call: Call, k: int) -> Call:
    async def calls() -> bool:
        for _ in range(k):
            await call()
        return True

    return calls


def concurrent(call: Call, k: int) -> Call:
    async def calls() -> bool:
        await asyncio.gather(*(call() for _ in range(k)))
        return True

    return calls


# -- rows ------------------------------------------------------------------------------------
def ratio_row(
    measure: str, subject: Side, base: Side, target: float, failures: Failures,
    floor: Side | None = None,
) -> Row:  # fmt: skip
    """A latency row: `subject` p50 / `base` p50 (raw nc.request), with p99s and the raw
    same-shape floor."""
    b50, b99, a50, a99 = subject.p(0.5), subject.p(0.99), base.p(0.5), base.p(0.99)
    figures = {"p50_s": b50, "p99_s": b99, "raw_p50_s": a50, "raw_p99_s": a99,
               "ratio_p50": b50 / a50}  # fmt: skip
    text = ""
    if floor is not None:
        c50 = floor.p(0.5)
        figures |= {"raw_shape_p50_s": c50, "raw_shape_ratio_p50": c50 / a50}
        text = f"{floor.name}: {ms(c50)} = {c50 / a50:.2f}x"
    return Row(
        measure=f"{measure}, p50",
        hookbus=f"{ms(b50)} (p99 {b99 * 1000:.2f})",
        baseline=f"raw {ms(a50)} (p99 {a99 * 1000:.2f})",
        ratio=f"{b50 / a50:.2f}x (p99 {b99 / a99:.2f}x)",
        target=f"<= {target:.2f}x",
        met=b50 / a50 <= target,
        figures=figures,
        errors=failures.count,
        floor=text,
        value=b50 / a50,
        limit=target,
    )


AMP_TARGETS = {"result": 0.5, "none": 0.6}
"""chain of 3 in one worker process / amplifier-core in process, per handler shape."""


def amplifier_rows(
    run: Run, chains: dict[str, Side], inproc: Side, amps: dict[str, Side] | None
) -> None:
    """The rows against amplifier-core's in-process emit of 3 async handlers, one per
    handler shape (``HookResult`` / None; hookbus's remote handlers return the same shape),
    and hookbus's own in-process emit."""
    h50 = inproc.p(0.5)
    inproc_measure = "in-process emit of 3 local handlers (HookDispatcher(), no connection), p50"
    for shape, key in (("result", "chain_vs_amplifier"), ("none", "chain_vs_amplifier_none")):
        chain, limit = chains[shape], AMP_TARGETS[shape]
        c50 = chain.p(0.5)
        returning = "HookResult" if shape == "result" else "None"
        measure = (
            f"chain of 3, one worker process / amplifier-core {AMPLIFIER_VERSION} in process"
            f" (3 async handlers); handlers return {returning}, p50"
        )
        if amps is None:
            run.rows[key] = Row(
                measure, ms(c50), "-", "-", f"<= {limit:.2f}x", None, {"p50_s": c50},
                unavailable=str(run.amplifier), limit=limit,
            )  # fmt: skip
            continue
        amp = amps[shape]
        a50 = amp.p(0.5)
        run.rows[key] = Row(
            measure=measure,
            hookbus=f"{ms(c50)} (p99 {chain.p(0.99) * 1000:.2f})",
            baseline=f"amplifier-core {ms(a50)} (p99 {amp.p(0.99) * 1000:.2f})",
            ratio=f"{c50 / a50:.2f}x",
            target=f"<= {limit:.2f}x",
            met=c50 / a50 <= limit,
            figures={
                "p50_s": c50,
                "p99_s": chain.p(0.99),
                "amplifier_p50_s": a50,
                "amplifier_p99_s": amp.p(0.99),
                "ratio_p50": c50 / a50,
            },
            value=c50 / a50,
            limit=limit,
        )
    if amps is None:
        run.rows["inprocess"] = Row(
            inproc_measure, us(h50), "amplifier-core: unavailable", "-", "<= 5 us",
            h50 <= 5e-6, {"p50_s": h50, "amplifier_unavailable": str(run.amplifier)},
            value=h50, limit=5e-6, unit="us",
        )  # fmt: skip
        return
    a50 = amps["result"].p(0.5)
    run.rows["inprocess"] = Row(
        measure=inproc_measure,
        hookbus=f"{us(h50)} (p99 {inproc.p(0.99) * 1e6:.1f})",
        baseline=f"amplifier-core {us(a50)} (p99 {amps['result'].p(0.99) * 1e6:.1f})",
        ratio=f"{h50 / a50:.2f}x of amplifier-core",
        target="<= 5 us",
        met=h50 <= 5e-6,
        figures={
            "p50_s": h50,
            "p99_s": inproc.p(0.99),
            "amplifier_p50_s": a50,
            "ratio_to_amplifier_p50": h50 / a50,
        },
        value=h50,
        limit=5e-6,
        unit="us",
    )


# -- phase 1: latency and throughput (raw responder, 5 worker processes, amplifier-core) ---
async def start_amplifier(run: Run) -> JsonChild | None:
    """The amplifier-core process, started; None (the reason kept in ``run.amplifier``)
    if it cannot be had."""
    if isinstance(run.amplifier, Unavailable):
        return None
    child = amplifier_child(run.amplifier, W.DATA)
    run.procs.append(child)
    try:
        await child.start()
    except RuntimeError as exc:
        await child.stop()
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        run.amplifier = Unavailable(lines[-1] if lines else "its process did not start")
        return None
    return child


async def check_routes(d: HookDispatcher) -> None:
    """Every event routes to its remote handlers and answers with no failure: a handler that
    fails quickly would otherwise make the figures look good."""
    expected = {W.EVENT_ONE: 1, W.EVENT_CHAIN: 3, W.EVENT_CHAIN_RESULT: 3,
                W.EVENT_CHAIN_SPREAD: 3, W.EVENT_PARALLEL: 3, W.EVENT_BIG: 1}  # fmt: skip
    for event, n in expected.items():
        if (got := len(d.routes(event))) != n:
            raise RuntimeError(f"{event}: {got} handler(s) in the registry, expected {n}")
        if (outcome := await emit_call(d, event)()) is not True:
            raise RuntimeError(f"{event}: emit failed: {outcome}")
    if (outcome := await collect_call(d)()) is not True:
        raise RuntimeError(str(outcome))


def _side(
    run: Run, name: str, call: Call, failures: Failures | None = None, n: int | None = None
) -> Side:
    """A side of sequential calls, each timed alone, `n` (default `latency_n`) in all."""
    n = run.s.latency_n if n is None else n
    warmup = min(run.s.warmup, max(10, n // 4))
    return Side(name, timed(call, failures), max(1, n // run.s.rounds), warmup)


async def one_handler_row(run: Run, d: HookDispatcher) -> None:
    s, raw = run.s, raw_call(run.raw)
    failures = Failures("one-handler emit")
    sides = [_side(run, "raw", raw), _side(run, "emit", emit_call(d, W.EVENT_ONE), failures)]
    run.say(f"latency: one-handler emit ({s.latency_n} calls per side, {s.rounds} rounds) ...")
    await latency_rounds(sides, s.rounds)
    run.rows["one"] = ratio_row("one-handler emit", sides[1], sides[0], 1.10, failures)


async def big_rows(run: Run, d: HookDispatcher) -> None:
    """One handler, an event of 64 KB and of 512 KB, against a raw request of the same bytes
    (encoded once; the raw responder answers without reading them)."""
    s = run.s
    for key, size, n in (("big_64k", 64 * 1024, 4 * s.big_n), ("big_512k", 512 * 1024, s.big_n)):
        data = W.big_data(size)
        payload = W.raw_payload(data)
        label = f"{size // 1024} KB"
        failures = Failures(f"one handler, {label}")
        sides = [
            _side(run, f"raw {label}", raw_call(run.raw, payload), n=n),
            _side(run, f"emit {label}", emit_call(d, W.EVENT_BIG, data), failures, n=n),
        ]
        run.say(f"latency: one handler, {label} of data ({n} calls per side) ...")
        await latency_rounds(sides, s.rounds)
        row = ratio_row(
            f"one handler, {label} of event data ({len(payload):,} bytes raw), vs raw request"
            " of the same bytes", sides[1], sides[0], 1.5, failures,
        )  # fmt: skip
        row.figures["raw_bytes"] = len(payload)
        run.rows[key] = row


async def chain_rows(run: Run, d: HookDispatcher) -> None:
    """One set of rotating rounds for the chain of 3 in one worker process (handlers
    returning None, and returning HookResult), in three processes, its raw floor, hookbus
    in-process and amplifier-core in-process, both handler shapes (in its own process)."""
    s, raw = run.s, raw_call(run.raw)
    f1, fr = Failures("chain of 3, one process"), Failures("chain of 3 (HookResult)")
    f3 = Failures("chain of 3, three processes")
    local = register_three(HookDispatcher(), lambda: HookResult(action="continue"))

    async def inproc_sample(n: int) -> list[float]:
        return await sample_emits(local, W.DATA, n)

    base, chain1, chain_r, chain3, floor = (
        _side(run, "raw", raw), _side(run, "chain", emit_call(d, W.EVENT_CHAIN), f1),
        _side(run, "chain, HookResult", emit_call(d, W.EVENT_CHAIN_RESULT), fr),
        _side(run, "spread", emit_call(d, W.EVENT_CHAIN_SPREAD), f3),
        _side(run, "3 sequential requests", sequential(raw, 3)),
    )  # fmt: skip
    inproc = Side("hookbus in-process", inproc_sample, s.inproc_per_round, s.warmup)
    sides = [base, chain1, chain_r, chain3, floor, inproc]
    amp_child = await start_amplifier(run)
    amps: dict[str, Side] | None = None
    if amp_child is not None:
        amps = {
            shape: Side(
                f"amplifier-core ({shape})",
                amplifier_sampler(amp_child, shape),
                base.per_round,
                s.warmup,
            )
            for shape in ("result", "none")
        }
        sides += amps.values()
    run.say(f"latency: chain of 3, one and three worker processes, in-process"
            f"{', amplifier-core' if amps else ''} ({s.rounds} rounds) ...")  # fmt: skip
    await latency_rounds(sides, s.rounds)
    if amp_child is not None:
        await amp_child.stop()
    run.rows["chain_one"] = ratio_row(
        "chain of 3 sequential handlers, one worker process", chain1, base, 1.2, f1, floor
    )
    run.rows["chain_three"] = ratio_row(
        "chain of 3 sequential handlers, three worker processes", chain3, base, 3.2, f3, floor
    )
    amplifier_rows(run, {"none": chain1, "result": chain_r}, inproc, amps)
    if fr.count:
        run.rows["chain_vs_amplifier"].errors = fr.count


async def group_rows(run: Run, d: HookDispatcher) -> None:
    """The parallel group and emit_and_collect, each with its raw same-shape floor."""
    s, raw = run.s, raw_call(run.raw)
    for key, name, call, shape, shape_name, target in (
        ("parallel", "parallel group of 3", emit_call(d, W.EVENT_PARALLEL),
         concurrent(raw, 3), "3 concurrent requests", 1.3),
        ("collect", "emit_and_collect of 3", collect_call(d), scatter_call(run.raw, 3),
         "1 publish, 3 replies", 1.25),
    ):  # fmt: skip
        failures = Failures(name)
        sides = [
            _side(run, "raw", raw), _side(run, name, call, failures), _side(run, shape_name, shape)
        ]  # fmt: skip
        run.say(f"latency: {name} ({s.latency_n} calls per side, {s.rounds} rounds) ...")
        await latency_rounds(sides, s.rounds)
        run.rows[key] = ratio_row(name, sides[1], sides[0], target, failures, sides[2])


async def throughput_phase(run: Run, d: HookDispatcher, pids: list[int]) -> None:
    """Raw vs one-handler emit at `in_flight`, A/B interleaved, the median of each."""
    s = run.s
    run.say(
        f"throughput: {s.in_flight} in flight, {s.tput_rounds} rounds x {s.tput_s}s per side ..."
    )
    raw_rates: list[Rate] = []
    hb_rates: list[Rate] = []
    failures = Failures("throughput")
    order = ((raw_call(run.raw), raw_rates), (emit_call(d, W.EVENT_ONE), hb_rates))
    for r in range(s.tput_rounds):
        for call, out in order if r % 2 == 0 else order[::-1]:
            out.append(await throughput(call, s.in_flight, s.tput_s, failures, pids))
    raw_tput = median([x.per_s for x in raw_rates])
    hb_tput = median([x.per_s for x in hb_rates])
    ratio = hb_tput / raw_tput
    run.rows["throughput"] = Row(
        measure=f"throughput at {s.in_flight} in flight (one-handler emit)",
        hookbus=rps(hb_tput),
        baseline=f"raw {rps(raw_tput)} (responder replies inline)",
        ratio=f"{ratio:.0%}",
        target=">= 80%",
        met=ratio >= 0.8,
        figures={
            "req_per_s": hb_tput,
            "raw_req_per_s": raw_tput,
            "ratio": ratio,
            "rounds_req_per_s": [x.per_s for x in hb_rates],
            "rounds_raw_req_per_s": [x.per_s for x in raw_rates],
        },
        errors=failures.count,
        value=ratio,
        limit=0.8,
        at_least=True,
        unit="%",
    )
    run.raw_tput = raw_tput
    for label, rates in (("raw throughput", raw_rates), ("emit throughput", hb_rates)):
        if note := cpu_note(label, rates[-1].cpu):
            run.notes.append(note)
    raw_cpu = sum(x.cpu.client_cpu_s for x in raw_rates) / sum(x.calls for x in raw_rates)
    hb_cpu = sum(x.cpu.client_cpu_s for x in hb_rates) / sum(x.calls for x in hb_rates)
    run.notes.append(
        f"client-process CPU per call at {s.in_flight} in flight: raw request"
        f" {raw_cpu * 1e6:.0f} us, hookbus emit {hb_cpu * 1e6:.0f} us"
        f" (+{(hb_cpu - raw_cpu) * 1e6:.0f} us in the dispatcher)"
    )


async def phase_one(run: Run) -> None:
    url = run.url
    servers = [raw_proc(url), worker_proc("latency_worker", url), worker_proc("groups_worker", url)]
    servers += [worker_proc(f"chain_worker_{i}", url) for i in (1, 2, 3)]
    run.procs += servers
    run.say(f"starting the raw responder and {len(servers) - 1} worker processes ...")
    async with running(servers):
        d = HookDispatcher(run.nc)
        await d.start()
        await d.refresh()
        await check_routes(d)
        ready = next((ln for ln in servers[0].lines if W.RAW_READY in ln), "")
        loop = ready.partition("(")[2].partition(" event loop")[0] or "?"
        run.notes.append(
            f"raw: responder replies inline in its subscription callback (one publish, no"
            f" task, no decode) on {loop} (the event loop `hookbus worker` picks); client:"
            " _raw.RawRequester (one wildcard inbox, a counter token, a future; leaner than"
            " nc.request)"
        )
        await one_handler_row(run, d)
        await chain_rows(run, d)
        await group_rows(run, d)
        await big_rows(run, d)
        await throughput_phase(run, d, [p.pid for p in servers[:2]])
        await d.close()


# -- phase 2: a 5 ms handler, then 1 / 2 / 4 bounded replicas ---------------------------------
async def io_phase(run: Run, d: HookDispatcher) -> None:
    s = run.s
    run.say("5 ms I/O handler, one worker process ...")
    io = worker_proc("io_worker", run.url)
    run.procs.append(io)
    async with running([io]):
        await d.refresh()
        failures = Failures("5 ms I/O")
        rate = await throughput(emit_call(d, W.EVENT_IO), s.in_flight, s.io_s, failures, [io.pid])
    raw_tput = run.raw_tput
    run.rows["io"] = Row(
        measure=f"one worker with a 5 ms I/O handler ({s.in_flight} in flight)",
        hookbus=rps(rate.per_s),
        baseline=f"{rps(raw_tput)} (raw, no I/O)",
        ratio=f"{rate.per_s / raw_tput:.0%}" if raw_tput else "-",
        target=">= 5,000 req/s",
        met=rate.per_s >= 5000,
        figures={"req_per_s": rate.per_s, "handler_bound_req_per_s": s.in_flight / W.IO_SECONDS},
        errors=rate.errors,
        value=rate.per_s,
        limit=5000,
        at_least=True,
        unit="rps",
    )
    if note := cpu_note("5 ms I/O row", rate.cpu):
        run.notes.append(note)


async def replica_phase(run: Run, d: HookDispatcher) -> None:
    """N replicas bound to `replica_bound` each, offered N x bound calls in flight (the load
    they can take: more would only be refused); refusals are counted apart."""
    s, bound = run.s, run.s.replica_bound
    ceiling = bound / W.IO_SECONDS
    replicas: list[Proc] = []
    one = 0.0
    try:
        for n in (1, 2, 4):
            run.say(f"replicas: {n} x --max-concurrency {bound}, {n * bound} in flight ...")
            new = [
                worker_proc("replica_worker", run.url, max_concurrency=bound, label=f"replica {i}")
                for i in range(len(replicas) + 1, n + 1)
            ]
            run.procs += new
            replicas += new
            await asyncio.gather(*(p.start() for p in new))
            await d.refresh()
            failures = Failures(f"{n} replicas")
            rate = await throughput(emit_call(d, W.EVENT_REPLICAS), n * bound, s.io_s, failures,
                                    [p.pid for p in replicas])  # fmt: skip
            one = one or rate.per_s
            ratio = rate.per_s / (n * one)
            run.rows[f"replicas_{n}"] = Row(
                measure=f"{n} replica(s) bounded to {bound} each (5 ms handler), {n * bound}"
                " in flight",
                hookbus=rps(rate.per_s),
                baseline=f"bound {rps(n * ceiling)}" if n == 1 else f"{n} x 1 replica",
                ratio=f"{rate.per_s / ceiling:.2f}x of {bound}/5ms" if n == 1 else f"{ratio:.2f}x",
                target="reference" if n == 1 else ">= 0.90x",
                met=None if n == 1 else ratio >= 0.9,
                figures={
                    "req_per_s": rate.per_s,
                    "in_flight": n * bound,
                    "bound_req_per_s": n * ceiling,
                    "ratio_to_n_x_one": ratio,
                },
                errors=rate.errors,
                refused=rate.refused,
                value=rate.per_s if n == 1 else ratio,
                limit=None if n == 1 else 0.9,
                at_least=True,
                unit="rps" if n == 1 else "x",
            )
    finally:
        await asyncio.gather(*(p.stop() for p in replicas), return_exceptions=True)


async def phase_two(run: Run) -> None:
    d = HookDispatcher(run.nc)
    await d.start()
    await io_phase(run, d)
    await replica_phase(run, d)
    await d.close()


# -- phase 3: the fleet; phase 4: suspensions and tracing --------------------------------------
async def phase_fleet(run: Run) -> None:
    s = run.s
    rows, notes = await bench_fleet(
        run.url, seconds=s.fleet_s, rounds=s.fleet_rounds, in_flight=s.fleet_in_flight,
        say=run.say, procs=run.procs,
    )  # fmt: skip
    for size, row in zip(FLEET_SIZES, rows, strict=True):
        if "ratio" in row.figures:
            row.value, row.unit, row.at_least = row.figures["ratio"], "%", True
            if row.met is not None:
                row.limit = float(row.target.removeprefix(">= ").rstrip("%")) / 100
        run.rows[f"fleet_{size}"] = row
    run.notes += notes


MORE_TIMEOUT_S = 120.0
"""Seconds the suspension and the tracing measurement may take each before its row is
given up (a hung wait must not hang the whole run)."""


async def _bounded(what: str, coro: Any) -> dict[str, Any] | str:
    """`coro`'s figures, or why there are none (it raised, or did not finish in time)."""
    try:
        return dict(await asyncio.wait_for(coro, MORE_TIMEOUT_S))
    except TimeoutError:
        return f"{what} did not finish within {MORE_TIMEOUT_S:.0f} s"
    except Exception as exc:
        return f"{what} failed: {type(exc).__name__}: {exc}"


def _unmeasured(measure: str, target: str, reason: str) -> Row:
    return Row(measure, "-", "-", "-", target, None, unavailable=reason)


def _built(measure: str, target: str, got: dict[str, Any] | str, build: Any) -> Row:
    """``build(measure, target, figures)``, or an unmeasured row saying why (no figures, or
    a figure missing from what the measurement returned)."""
    if isinstance(got, str):
        return _unmeasured(measure, target, got)
    try:
        row: Row = build(measure, target, got)
    except KeyError as exc:
        return _unmeasured(measure, target, f"the measurement returned no {exc}")
    return row


SUSPENSION_TARGET = 1.8
"""resolve -> waiter wakes / a KV put, p50."""
TRACING_TARGET = 1.3
"""chain of 3, tracing on / off, p50."""


def _suspension_row(measure: str, target: str, sus: dict[str, Any]) -> Row:
    return Row(
        measure=measure,
        hookbus=f"{sus['wake_p50_ms']:.3f} ms",
        baseline=f"KV put {sus['put_p50_ms']:.3f} ms",
        ratio=f"{sus['ratio']:.2f}x",
        target=target,
        met=sus["ratio"] <= SUSPENSION_TARGET,
        figures=sus,
        floor=f"raw put -> raw watch: {sus['floor_ratio']:.2f}x",
        value=sus["ratio"],
        limit=SUSPENSION_TARGET,
    )


def _tracing_row(measure: str, target: str, tr: dict[str, Any]) -> Row:
    floor = ""
    if isinstance(tr.get("spans_us"), float | int) and tr["off_p50_ms"] > 0:
        off_us = tr["off_p50_ms"] * 1e3
        floor = f"SDK's 3 spans on a raw round trip: {(off_us + tr['spans_us']) / off_us:.2f}x"
    return Row(
        measure=measure,
        hookbus=f"{tr['on_p50_ms']:.3f} ms",
        baseline=f"tracing off {tr['off_p50_ms']:.3f} ms",
        ratio=f"{tr['ratio']:.2f}x",
        target=target,
        met=tr["ratio"] <= TRACING_TARGET,
        figures=tr,
        floor=floor,
        value=tr["ratio"],
        limit=TRACING_TARGET,
    )


async def phase_more(run: Run) -> None:
    """The suspension and tracing rows, each with its own baseline from the same run: a KV
    put, and emit with tracing off (`suspensions.py`, `tracing.py`)."""
    import tracing
    from tracing import bench_noop_overhead, bench_tracing

    s = run.s
    run.say(f"suspensions: resolve -> wake vs a KV put, {s.suspension_n} rounds ...")
    sus = await _bounded("the suspension benchmark", _suspensions(run.url, s.suspension_n))
    run.say(f"tracing: chain of 3, on vs off, {s.tracing_n} emits per variant ...")
    tr = await _bounded("the tracing benchmark", bench_tracing(run.url, s.tracing_n))
    if isinstance(tr, dict) and hasattr(tracing, "bench_span_floor"):
        # the floor of on - off: the SDK's 3 spans on a raw round trip (no hookbus code)
        floor = await _bounded("the span floor", tracing.bench_span_floor(run.url, s.tracing_n))
        if isinstance(floor, dict) and "spans_us" in floor:
            tr["spans_us"] = floor["spans_us"]
    noop = await _bounded("the no-provider benchmark", bench_noop_overhead(s.noop_n))
    run.rows["suspension"] = _built(
        "suspension: resolve -> waiter wakes, p50",
        f"<= {SUSPENSION_TARGET:.2f}x",
        sus,
        _suspension_row,
    )
    run.rows["tracing"] = _built(
        "chain of 3 remote, tracing on (OTel SDK, BatchSpanProcessor, dropping exporter), p50",
        f"<= {TRACING_TARGET:.2f}x", tr, _tracing_row,
    )  # fmt: skip
    if isinstance(tr, dict) and "ratio_with_metrics" in tr:
        run.notes.append(f"tracing on with metrics too: {tr['ratio_with_metrics']:.2f}x of off")
    if isinstance(noop, dict) and {"bare_us", "instrumented_us"} <= noop.keys():
        run.notes.append(
            "instrumentation with no OTel provider set (in-process emit, 3 handlers): "
            f"unwrapped {noop['bare_us']:.1f} us, as shipped {noop['instrumented_us']:.1f} us"
        )


async def _suspensions(url: str, rounds: int) -> dict[str, Any]:
    """`suspensions.bench_suspensions`, imported here: a code tree that cannot run it (an
    older checkout first on ``PYTHONPATH``) leaves its row unmeasured, not the run failed."""
    from suspensions import bench_suspensions

    return await bench_suspensions(url, rounds)


async def bench(url: str, s: Settings, amplifier: Path | Unavailable) -> Run:
    progress = Console(stderr=True)

    def say(text: str) -> None:
        progress.print(f"[dim]{time.strftime('%H:%M:%S')} {text}[/dim]", highlight=False)

    nc = await nats.connect(url, name="hookbus-bench-client")
    raw = await RawRequester(nc).start()
    run = Run(url, nc, s, say, amplifier, {}, [], [], raw)
    try:
        await phase_one(run)
        await phase_two(run)
        await phase_fleet(run)
        await phase_more(run)
    except BenchAborted as exc:
        tails = "".join(f"--- {p.label} (last lines) ---\n{p.tail(10)}" for p in run.procs)
        raise BenchAborted(f"{exc}\n{tails}") from None
    finally:
        await asyncio.gather(*(p.stop() for p in run.procs), return_exceptions=True)
        await nc.close()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (< 1 min), fewer samples")
    parser.add_argument(
        "--url",
        default=None,
        help="NATS URL of an existing server (JetStream on); default: embedded",
    )
    parser.add_argument(
        "--in-flight", type=int, default=None,
        help="requests in flight in the throughput rows (default 256)",
    )  # fmt: skip
    parser.add_argument(
        "--amplifier-venv", type=Path, default=DEFAULT_VENV, metavar="DIR",
        help=f"the venv holding amplifier-core {AMPLIFIER_VERSION}, made if missing"
        f" (default {DEFAULT_VENV})",
    )  # fmt: skip
    parser.add_argument(
        "--json", dest="json_out", default=None, metavar="PATH",
        help="also write the rows, every figure and the notes as JSON to PATH",
    )  # fmt: skip
    parser.add_argument(
        "--runs", type=int, default=1, metavar="N",
        help="run the whole table N times (a server and processes of its own each), then"
        " print each row's median and range over the N runs (the issue asks for 3)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    # SIGTERM behaves like Ctrl-C: stop the processes and the embedded server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # failed calls are counted and shown in the table; one log line each would flood it
    logging.getLogger("hookbus").setLevel(logging.ERROR)
    s = QUICK if args.quick else DEFAULT
    if args.in_flight:
        s = Settings(**{**asdict(s), "in_flight": args.in_flight})
    console = Console(width=max(Console().width, 200))
    amplifier: Path | Unavailable
    try:
        amplifier = amplifier_python(args.amplifier_venv, say=lambda t: print(t, file=sys.stderr))
    except Unavailable as exc:
        amplifier = exc
    runs: list[Run] = []
    jsons: list[dict[str, Any]] = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"run {i + 1} of {args.runs}", file=sys.stderr)
        t0 = time.perf_counter()
        # a server of its own per run (unless --url): no run inherits another's state
        with contextlib.ExitStack() as stack:
            url = args.url or stack.enter_context(EmbeddedNatsServer()).url
            try:
                run = asyncio.run(bench(url, s, amplifier))
            except (BenchAborted, RuntimeError) as exc:
                console.print(f"[red]benchmark aborted:[/red] {exc}", highlight=False)
                sys.exit(1)
            except KeyboardInterrupt:
                console.print("[red]interrupted[/red]: processes and server stopped")
                sys.exit(130)
        elapsed = time.perf_counter() - t0
        header = (
            f"{'quick' if args.quick else 'default'} run"
            f"{f' {i + 1} of {args.runs}' if args.runs > 1 else ''}, {elapsed:.0f} s;"
            f" {os.cpu_count()} cores, Python {platform.python_version()},"
            f" {args.url or 'embedded nats-server'}; handlers, raw responders, agents and"
            " amplifier-core each in processes of their own"
        )
        keys = [k for k in ORDER if k in run.rows]
        headings = {keys.index(k): title for k, title in SECTIONS.items() if k in keys}
        render([run.rows[k] for k in keys], run.notes, header, console, headings)
        runs.append(run)
        jsons.append(as_json({k: run.rows[k] for k in keys}, run.notes, header, asdict(s)))
    out: dict[str, Any] = jsons[0] if len(jsons) == 1 else {"runs": jsons}
    if args.runs > 1:
        console.print()
        out["summary"] = render_summary([r.rows for r in runs], ORDER, SECTIONS, console)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
