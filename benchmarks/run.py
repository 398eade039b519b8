"""hookbus benchmark: the bus's cost measured against raw ``nc.request`` in the same run.

    .venv/bin/python benchmarks/run.py            # ~1-2 minutes
    .venv/bin/python benchmarks/run.py --quick    # ~30 s, fewer samples
    .venv/bin/python benchmarks/run.py --url nats://127.0.0.1:4222   # an existing server

Starts its own nats-server (`hookbus.cli.EmbeddedNatsServer`) unless ``--url`` is given,
runs every handler and the raw responder in processes of their own, and prints one table:
each figure as a ratio against the raw baseline measured in the same run, next to the
absolute figure, the target and MET / MISSED. See benchmarks/README.md for the method.
Not a test: nothing here asserts; the exit status is 0 unless the run itself failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from rich.console import Console
from rich.table import Table

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _workers as W  # noqa: E402  (the constants shared with the worker processes)

WORKERS_FILE = str(HERE / "_workers.py")

DATA: dict[str, Any] = {
    "tool_name": "bash",
    "tool_input": {"command": "ls -la /tmp"},
    "agent_id": "agent-1",
    "session_id": "session-1",
}
"""The event data of every emit (a typical small tool:pre payload)."""
RAW_PAYLOAD = json.dumps(
    {"id": "0" * 32, "event": "bench:one", "data": DATA, "emitted_at": 0.0}
).encode()
"""The raw baseline sends bytes of an envelope's size, encoded once (no per-call work)."""


@dataclass(frozen=True)
class Settings:
    latency_n: int
    """Measured sequential calls per side (baseline, subject, raw shape) per latency row."""
    rounds: int
    """Rounds the latency calls are split into (the order of the sides rotates each round)."""
    warmup: int
    """Unmeasured calls per side before each latency row."""
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


DEFAULT = Settings(
    latency_n=6000,
    rounds=12,
    warmup=300,
    in_flight=256,
    tput_s=2.5,
    tput_rounds=3,
    io_s=4.0,
    replica_bound=8,
)
QUICK = Settings(
    latency_n=1000,
    rounds=4,
    warmup=100,
    in_flight=256,
    tput_s=1.0,
    tput_rounds=2,
    io_s=1.5,
    replica_bound=8,
)
WARMUP_S = 0.3
"""Unmeasured seconds before each throughput measurement."""
MAX_FAILURES = 5
"""Failed calls (handler timeout, no responders, ...) after which the run stops: each one
may cost a 5 s timeout, and a row with failures measures something else."""


class BenchAborted(RuntimeError):
    """Too many failed calls: the run is stopped with the workers' last log lines."""


class Failures:
    """Counts failed calls of one row; raises `BenchAborted` past `MAX_FAILURES`."""

    def __init__(self, row: str) -> None:
        self.row = row
        self.count = 0

    def record(self, ok: object) -> None:
        if ok is False:
            self.count += 1
            if self.count > MAX_FAILURES:
                raise BenchAborted(f"{self.row}: more than {MAX_FAILURES} failed calls")


# -- results ---------------------------------------------------------------------------------
@dataclass
class Row:
    measure: str
    hookbus: str
    baseline: str
    ratio: str
    target: str
    met: bool | None  # None: a reference row, nothing to meet
    figures: dict[str, float] = field(default_factory=dict)
    errors: int = 0
    floor: str = ""
    """The same message pattern with raw nc.request (what no bus can beat), if any."""

    @property
    def status(self) -> str:
        if self.errors:
            return f"INVALID ({self.errors} failed calls)"
        if self.met is None:
            return "-"
        return "MET" if self.met else "MISSED"


# -- processes -------------------------------------------------------------------------------
class Proc:
    """A child process that writes `ready` to stderr once it serves; stderr is kept drained."""

    def __init__(self, label: str, argv: list[str], ready: str) -> None:
        self.label = label
        self.argv = argv
        self.ready = ready
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 30.0) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        assert self.proc.stderr is not None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await self.proc.stderr.readline()
                    if not line:
                        raise RuntimeError(
                            f"{self.label} exited before it was ready:\n"
                            + "".join(self.lines[-20:])
                        )
                    text = line.decode(errors="replace")
                    self.lines.append(text)
                    if self.ready in text:
                        break
        except TimeoutError:
            await self.stop()
            raise RuntimeError(
                f"{self.label} not ready within {timeout_s}s:\n" + "".join(self.lines[-20:])
            ) from None
        self._drain = asyncio.create_task(self._drain_stderr())

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode(errors="replace"))
            del self.lines[:-50]

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain, 2)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the benchmark dies (Linux), so no worker
    is left reconnecting forever to a server that is gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def worker_proc(
    attr: str, url: str, *, max_concurrency: int | None = None, label: str = ""
) -> Proc:
    argv = [
        sys.executable,
        "-m",
        "hookbus.cli",
        "--log-level",
        "info",
        "worker",
        f"{WORKERS_FILE}:{attr}",
        "--url",
        url,
    ]
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    return Proc(label or attr, argv, W.WORKER_READY)


def raw_proc(url: str) -> Proc:
    return Proc("raw responder", [sys.executable, WORKERS_FILE, "--url", url], W.RAW_READY)


# -- CPU accounting (Linux /proc/stat; absent elsewhere) ---------------------------------------
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
def cpu_window(pids: list[int] | None = None):  # type: ignore[no-untyped-def]
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


# -- measurements ----------------------------------------------------------------------------
Call = Callable[[], Awaitable[Any]]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def latency_rounds(calls: list[Call], s: Settings) -> list[list[float]]:
    """Sequential latency samples (seconds) of each call, interleaved in rounds; the order
    rotates each round (A/B/C, B/C/A, ...) so drift and noise hit every side alike."""
    for _ in range(s.warmup):
        for call in calls:
            await call()
    out: list[list[float]] = [[] for _ in calls]
    per = max(1, s.latency_n // s.rounds)
    clock = time.perf_counter
    k = len(calls)
    for r in range(s.rounds):
        for j in range(k):
            i = (j + r) % k
            call, samples = calls[i], out[i]
            for _ in range(per):
                t0 = clock()
                await call()
                samples.append(clock() - t0)
    return out


class RawScatter:
    """The raw shape of emit_and_collect: one publish with a reply subject on one long-lived
    wildcard inbox, done when `expected` replies have come (plain nats-py)."""

    def __init__(self, nc: NATS, subject: str, expected: int) -> None:
        self.nc, self.subject, self.expected = nc, subject, expected
        self.prefix = nc.new_inbox()
        self.waiting: dict[str, tuple[asyncio.Future[None], list[int]]] = {}
        self.n = 0

    async def start(self) -> None:
        async def on_reply(msg: Any) -> None:
            entry = self.waiting.get(msg.subject.rpartition(".")[2])
            if entry is not None:
                entry[1][0] += 1
                if entry[1][0] == self.expected and not entry[0].done():
                    entry[0].set_result(None)

        await self.nc.subscribe(f"{self.prefix}.*", cb=on_reply)
        await self.nc.flush()

    async def __call__(self) -> bool:
        self.n += 1
        token = f"{self.n:x}"
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting[token] = (fut, [0])
        try:
            await self.nc.publish(self.subject, RAW_PAYLOAD, reply=f"{self.prefix}.{token}")
            await asyncio.wait_for(fut, 5)
        finally:
            del self.waiting[token]
        return True


@dataclass
class Rate:
    per_s: float
    calls: int
    errors: int
    cpu: CpuWindow


async def throughput(
    call: Call, in_flight: int, seconds: float, failures: Failures, pids: list[int] | None = None
) -> Rate:
    """Calls per second with `in_flight` calls outstanding for `seconds` (after a warm-up).

    `call` returns False (or raises) for a failed call; failures are counted, not retried.
    """
    calls = 0
    before = failures.count

    async def drive(until: float, count: bool) -> None:
        nonlocal calls
        clock = time.perf_counter
        while clock() < until:
            try:
                ok = await call()
            except BenchAborted:
                raise
            except Exception:
                ok = False
            failures.record(ok)
            calls += count

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
    return Rate(calls / elapsed, calls, failures.count - before, cpu)


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# -- the run ---------------------------------------------------------------------------------
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


def ms(x: float) -> str:
    return f"{x * 1000:.3f} ms"


def rps(x: float) -> str:
    return f"{x:,.0f} req/s"


async def bench(
    url: str, s: Settings, console: Console, *, spread: bool = False
) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []

    progress = Console(stderr=True)

    def say(text: str) -> None:
        progress.print(f"[dim]{time.strftime('%H:%M:%S')} {text}[/dim]", highlight=False)

    nc: NATS = await nats.connect(url, name="hookbus-bench-client")
    procs: list[Proc] = []
    try:
        attrs = [f"group_worker_{i}" for i in (1, 2, 3)] if spread else ["groups_worker"]
        say(f"starting the raw responder and {1 + len(attrs)} worker processes ...")
        raw, lat = raw_proc(url), worker_proc("latency_worker", url)
        groups = [worker_proc(attr, url) for attr in attrs]
        procs += [raw, lat, *groups]
        await asyncio.gather(*(p.start() for p in (raw, lat, *groups)))
        d = HookDispatcher(nc)
        await d.start()
        await d.refresh()

        async def raw_call() -> bool:
            await nc.request(W.RAW_SUBJECT, RAW_PAYLOAD, timeout=5)
            return True

        def emit_call(event: str) -> Call:
            async def call() -> bool:
                r = await d.emit(event, DATA)
                return not r.failures

            return call

        async def collect_call() -> bool:
            return len(await d.emit_and_collect(W.EVENT_COLLECT, DATA, timeout=2.0)) == 3

        # sanity: every subject answers, from the remote workers, with no failure
        for event, n in ((W.EVENT_ONE, 1), (W.EVENT_CHAIN, 3), (W.EVENT_PARALLEL, 3)):
            got = len(d.routes(event))
            if got != n:
                raise RuntimeError(f"{event}: {got} handler(s) in the registry, expected {n}")
            if not await emit_call(event)():
                raise RuntimeError(f"{event}: emit reported failures")
        if not await collect_call():
            raise RuntimeError("emit_and_collect did not get 3 answers")

        # -- latency rows (sequential, interleaved rounds, each with its own baseline) -------
        async def raw_chain() -> bool:
            for _ in range(3):
                await raw_call()
            return True

        async def raw_parallel() -> bool:
            await asyncio.gather(raw_call(), raw_call(), raw_call())
            return True

        raw_scatter = RawScatter(nc, W.RAW_SCATTER_SUBJECT, 3)
        await raw_scatter.start()
        latency_rows: list[tuple[str, Call, Call | None, str, float]] = [
            ("one-handler emit", emit_call(W.EVENT_ONE), None, "", 1.10),
            (
                "chain of 3 sequential handlers",
                emit_call(W.EVENT_CHAIN),
                raw_chain,
                "3 sequential requests",
                3.3,
            ),
            (
                "parallel group of 3",
                emit_call(W.EVENT_PARALLEL),
                raw_parallel,
                "3 concurrent requests",
                1.3,
            ),
            ("emit_and_collect of 3", collect_call, raw_scatter, "1 publish, 3 replies", 1.3),
        ]
        for name, call, shape, shape_name, target in latency_rows:
            say(f"latency: {name} ({s.latency_n} calls per side, {s.rounds} rounds) ...")
            failures = Failures(name)

            async def checked(call: Call = call, failures: Failures = failures) -> None:
                failures.record(await call())

            samples = await latency_rounds([raw_call, checked] + ([shape] if shape else []), s)
            a, b = samples[0], samples[1]
            a50, b50, a99, b99 = pct(a, 0.5), pct(b, 0.5), pct(a, 0.99), pct(b, 0.99)
            ratio = b50 / a50
            figures = {
                "p50_s": b50,
                "p99_s": b99,
                "raw_p50_s": a50,
                "raw_p99_s": a99,
                "ratio_p50": ratio,
            }
            floor = ""
            if shape:
                c50 = pct(samples[2], 0.5)
                figures |= {"raw_shape_p50_s": c50, "raw_shape_ratio_p50": c50 / a50}
                floor = f"{shape_name}: {ms(c50)} = {c50 / a50:.2f}x"
            rows.append(
                Row(
                    measure=f"{name}, p50",
                    hookbus=f"{ms(b50)} (p99 {b99 * 1000:.2f})",
                    baseline=f"{ms(a50)} (p99 {a99 * 1000:.2f})",
                    ratio=f"{ratio:.2f}x (p99 {b99 / a99:.2f}x)",
                    target=f"<= {target:.2f}x",
                    met=ratio <= target,
                    figures=figures,
                    errors=failures.count,
                    floor=floor,
                )
            )

        # -- throughput at 256 in flight, raw vs one-handler emit, A/B interleaved -----------
        say(
            f"throughput: {s.in_flight} in flight,"
            f" {s.tput_rounds} rounds x {s.tput_s}s per side ..."
        )
        raw_rates: list[Rate] = []
        hb_rates: list[Rate] = []
        failures = Failures("throughput")
        for r in range(s.tput_rounds):
            order = ((raw_call, raw_rates), (emit_call(W.EVENT_ONE), hb_rates))
            for call, out in order if r % 2 == 0 else order[::-1]:
                out.append(
                    await throughput(call, s.in_flight, s.tput_s, failures, [raw.pid, lat.pid])
                )
        raw_tput = median([x.per_s for x in raw_rates])
        hb_tput = median([x.per_s for x in hb_rates])
        ratio = hb_tput / raw_tput
        rows.append(
            Row(
                measure=f"throughput at {s.in_flight} in flight (one-handler emit)",
                hookbus=rps(hb_tput),
                baseline=rps(raw_tput),
                ratio=f"{ratio:.0%}",
                target=">= 85%",
                met=ratio >= 0.85,
                figures={"req_per_s": hb_tput, "raw_req_per_s": raw_tput, "ratio": ratio},
                errors=sum(x.errors for x in hb_rates) + sum(x.errors for x in raw_rates),
            )
        )
        raw_cpu = sum(x.cpu.client_cpu_s for x in raw_rates) / sum(x.calls for x in raw_rates)
        hb_cpu = sum(x.cpu.client_cpu_s for x in hb_rates) / sum(x.calls for x in hb_rates)
        for label, rates in (("raw throughput", raw_rates), ("emit throughput", hb_rates)):
            if note := cpu_note(label, rates[-1].cpu):
                notes.append(note)
        notes.append(
            f"client-process CPU per call at {s.in_flight} in flight: raw nc.request"
            f" {raw_cpu * 1e6:.0f} us, hookbus emit {hb_cpu * 1e6:.0f} us"
            f" (+{(hb_cpu - raw_cpu) * 1e6:.0f} us in the dispatcher)"
        )
        await asyncio.gather(*(p.stop() for p in (raw, lat, *groups)))

        # -- one worker, 5 ms I/O handler ----------------------------------------------------
        say("5 ms I/O handler, one worker process ...")
        io = worker_proc("io_worker", url)
        procs.append(io)
        await io.start()
        await d.refresh()
        rate = await throughput(
            emit_call(W.EVENT_IO), s.in_flight, s.io_s, Failures("5 ms I/O"), [io.pid]
        )
        await io.stop()
        rows.append(
            Row(
                measure=f"one worker with a 5 ms I/O handler ({s.in_flight} in flight)",
                hookbus=rps(rate.per_s),
                baseline=f"{rps(raw_tput)} (no I/O)",
                ratio=f"{rate.per_s / raw_tput:.0%}",
                target=">= 5,000 req/s",
                met=rate.per_s >= 5000,
                figures={"req_per_s": rate.per_s, "ratio_to_raw": rate.per_s / raw_tput},
                errors=rate.errors,
            )
        )
        notes.append(
            f"5 ms I/O row: the handler alone would allow {s.in_flight}/5 ms ="
            f" {s.in_flight / W.IO_SECONDS:,.0f} req/s"
        )
        if note := cpu_note("5 ms I/O row", rate.cpu):
            notes.append(note)

        # -- 1 / 2 / 4 replicas with a per-replica concurrency bound -------------------------
        bound = s.replica_bound
        ceiling = bound / W.IO_SECONDS
        replicas: list[Proc] = []
        one_replica = 0.0
        for n in (1, 2, 4):
            say(f"replicas: {n} x --max-concurrency {bound} ...")
            new = [
                worker_proc("replica_worker", url, max_concurrency=bound, label=f"replica {i + 1}")
                for i in range(len(replicas), n)
            ]
            procs += new
            replicas += new
            await asyncio.gather(*(p.start() for p in new))
            await d.refresh()
            rate = await throughput(
                emit_call(W.EVENT_REPLICAS),
                s.in_flight,
                s.io_s,
                Failures(f"{n} replicas"),
                [p.pid for p in replicas],
            )
            if n == 1:
                one_replica = rate.per_s
                rows.append(
                    Row(
                        measure=f"1 replica, per-replica concurrency bound {bound}, 5 ms handler",
                        hookbus=rps(rate.per_s),
                        baseline="-",
                        ratio=f"{rate.per_s / ceiling:.2f}x of {bound}/5ms",
                        target="reference",
                        met=None,
                        figures={"req_per_s": rate.per_s, "bound_req_per_s": ceiling},
                        errors=rate.errors,
                    )
                )
            else:
                ratio = rate.per_s / (n * one_replica)
                rows.append(
                    Row(
                        measure=f"{n} replicas, per-replica concurrency bound {bound} each",
                        hookbus=rps(rate.per_s),
                        baseline="-",
                        ratio=f"{ratio:.2f}x of {n} x 1 replica",
                        target=">= 0.90x",
                        met=ratio >= 0.9,
                        figures={"req_per_s": rate.per_s, "ratio_to_n_x_one": ratio},
                        errors=rate.errors,
                    )
                )
            if note := cpu_note(f"{n} replica(s)", rate.cpu):
                notes.append(note)
        await asyncio.gather(*(p.stop() for p in replicas))
        await d.close()
    except BenchAborted as exc:
        tails = "".join(f"--- {p.label} (last lines) ---\n" + "".join(p.lines[-10:]) for p in procs)
        raise BenchAborted(f"{exc}\n{tails}") from None
    finally:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        await nc.close()
    return rows, notes


async def bench_more(url: str, quick: bool) -> tuple[list[Row], list[str]]:
    """The suspension and tracing rows, each with its own baseline
    taken in the same run: a KV put, and emit with tracing off."""
    from suspensions import bench_suspensions  # siblings: benchmarks/ is on sys.path
    from tracing import bench_noop_overhead, bench_tracing

    sus = await bench_suspensions(url, 100 if quick else 300)
    tr = await bench_tracing(url, 500 if quick else 2000)
    noop = await bench_noop_overhead(5000 if quick else 20000)
    rows = [
        Row(
            measure="suspension: resolve -> waiter wakes, p50",
            hookbus=f"{sus['wake_p50_ms']:.3f} ms",
            baseline=f"KV put {sus['put_p50_ms']:.3f} ms",
            ratio=f"{sus['ratio']:.2f}x",
            target="<= 1.50x",
            met=bool(sus["met"]),
            figures=sus,
            floor=f"raw put -> raw watch: {sus['floor_ratio']:.2f}x",
        ),
        Row(
            measure="chain of 3, tracing on (SDK, batch processor), p50",
            hookbus=f"{tr['on_p50_ms']:.3f} ms",
            baseline=f"tracing off {tr['off_p50_ms']:.3f} ms",
            ratio=f"{tr['ratio']:.2f}x",
            target="<= 1.20x",
            met=bool(tr["met"]),
            figures=tr,
        ),
    ]
    notes = [
        f"tracing on with metrics too: {tr['ratio_with_metrics']:.2f}x of off",
        "instrumentation with no OTel provider set (in-process emit, 3 handlers): "
        + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in noop.items()
        ),
    ]
    return rows, notes


def render(rows: list[Row], notes: list[str], header: str, console: Console) -> None:
    table = Table(title="hookbus vs raw nc.request (same run)", caption=header, show_lines=False)
    table.add_column("measure", max_width=44)
    table.add_column("hookbus", justify="right", no_wrap=True)
    table.add_column("raw nc.request", justify="right", no_wrap=True)
    table.add_column("ratio to raw", justify="right", no_wrap=True)
    table.add_column("target", justify="right", no_wrap=True)
    table.add_column("result")
    table.add_column("raw, same shape (floor)", justify="right", no_wrap=True)
    style = {"MET": "green", "MISSED": "red", "-": "dim"}
    for row in rows:
        st = row.status
        table.add_row(
            row.measure,
            row.hookbus,
            row.baseline,
            row.ratio,
            row.target,
            f"[{style.get(st, 'yellow')}]{st}[/]",
            row.floor,
        )
    console.print(table)
    judged = [r for r in rows if r.met is not None]
    met = sum(1 for r in judged if r.met and not r.errors)
    console.print(f"{met} of {len(judged)} targets met.")
    for note in notes:
        console.print(f"  - {note}", highlight=False, soft_wrap=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short run (~30 s), fewer samples")
    parser.add_argument(
        "--url",
        default=None,
        help="NATS URL of an existing server (JetStream on); default: embedded",
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="requests in flight in the throughput rows (default 256)",
    )
    parser.add_argument(
        "--spread",
        action="store_true",
        help="serve the 3 handlers of the chain / parallel / collect rows from"
        " 3 worker processes instead of one",
    )
    parser.add_argument(
        "--json",
        dest="json_out",
        default=None,
        metavar="PATH",
        help="also write the rows and notes as JSON to PATH",
    )
    args = parser.parse_args()
    # SIGTERM behaves like Ctrl-C: stop the worker processes and the embedded server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    s = QUICK if args.quick else DEFAULT
    if args.in_flight:
        s = Settings(**{**asdict(s), "in_flight": args.in_flight})
    console = Console(width=max(Console().width, 180))
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            url = stack.enter_context(EmbeddedNatsServer()).url
        try:
            rows, notes = asyncio.run(bench(url, s, console, spread=args.spread))
            more_rows, more_notes = asyncio.run(bench_more(url, args.quick))
            rows += more_rows
            notes += more_notes
        except (BenchAborted, RuntimeError) as exc:
            console.print(f"[red]benchmark aborted:[/red] {exc}", highlight=False)
            sys.exit(1)
        except KeyboardInterrupt:
            console.print("[red]interrupted[/red]: worker processes and server stopped")
            sys.exit(130)
    elapsed = time.perf_counter() - t0
    header = (
        f"{'quick' if args.quick else 'default'} run, {elapsed:.0f} s; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{'embedded nats-server' if args.url is None else args.url}; "
        f"handlers and raw responder in separate processes"
        f"{' (groups spread over 3)' if args.spread else ''}"
    )
    render(rows, notes, header, console)
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "header": header,
                    "settings": asdict(s),
                    "rows": [{**asdict(r), "status": r.status} for r in rows],
                    "notes": notes,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
