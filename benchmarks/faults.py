"""hookbus fault benchmark: decisions, suspensions and registrations through real outages.

    .venv/bin/python benchmarks/faults.py               # every run (2,000 differential cases)
    .venv/bin/python benchmarks/faults.py --quick       # fewer emits, suspensions and cases
    .venv/bin/python benchmarks/faults.py --json out.json
    .venv/bin/python benchmarks/faults.py --only differential --findings findings.md
    .venv/bin/python benchmarks/faults.py --only differential --cases 5000 --json out.json

Runs (each on servers and processes of its own, as the fault tests do, with the helpers
in tests/_cluster.py and tests/_fleet.py):

- ``cluster``: a 3-node JetStream cluster, buckets with 3 replicas; steady emit load
  against a fail-closed guard (``deny`` policy) and a fail-open audit handler; a few
  hundred suspensions created, resolved from another connection and woken; the JetStream
  meta leader, then the handlers bucket's stream leader, then the suspensions bucket's
  stream leader are SIGKILLed and brought back, one after the other; a probe keeps writing
  new handler declarations to time how long none could be written.
- ``worker-kill``: 2 worker replicas (``hookbus worker`` processes), one SIGKILLed under load.
- ``replica-stall``: 2 replicas of a ``retry_safe`` guard, one SIGSTOPped for 5 s under load.
- ``drain``: ``hookbus dispatcher`` and ``hookbus worker`` SIGTERMed together with requests
  (approval waits included) in flight; every request must be answered.
- ``leaf-link``: a hub (JetStream, domain ``hub``) and a leaf without JetStream; a worker
  at the hub serves a fail-closed guard, an agent at the leaf (``js_domain="hub"``) emits
  all along; the leaf link alone is cut for 3 s (the TCP relay of
  tests/test_sites_faults.py) and restored.
- ``supercluster-stall``: a supercluster (tests/_supercluster.py: clusters east and west
  of three nodes, gateways, one JetStream); one worker process per cluster, each serving a
  ``retry_safe`` handler and a non-retry_safe fail-closed guard; the agent in west; the
  west worker SIGSTOPped for 5 s.
- ``supercluster-outage``: the same supercluster; a fail-closed guard served only in east,
  the agent in west; every east node SIGKILLed for 3 s, then restarted.
- ``differential``: the differential judge of tests/_differential.py (what
  tests/test_differential.py runs) over 2,000 hypothesis cases (200 with ``--quick``;
  ``--seed`` for another set): each case's decision with every fast path on, against the
  one-by-one reference, under kills, drains, pauses (mid-step, and before a read),
  deadlines, redeclarations and a rogue peer, and with no fault at all: handlers that
  await only on some inputs or compute without awaiting, results holding objects JSON
  cannot carry, workers behind a link that delays every message 0.1-0.5 s each way, worker
  clocks an hour off (``--cases N`` for another count); a handler that is not retry_safe
  run twice for one emit counts as a divergence. Its figure is the number of divergent
  cases (target 0), with how many
  cases had each fault, pace, kind, delay and skew (``mix`` in the JSON); ``--findings
  FILE`` appends each divergent one, with its replay line.

Figures per run: emits without a decision by their deadline (target 0), decisions that
contradict the policy (target 0; e.g. a fail-closed guard failing open), suspensions lost
or resolved twice (target 0), emit p50 / p99 / max during the outage, seconds during which
no new declaration could be written; for the topology runs (leaf-link, supercluster-*), the
seconds from the first emit failed closed to the end of the last one, and the seconds from
the fault's end (link restored, replica resumed, cluster restarted) to the end of the last
emit the guard did not decide itself (0: none after the fault ended). Not a test: nothing
asserts, the exit status is 0 unless a run itself failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
from nats.aio.client import Client as NATS
from rich.console import Console
from rich.table import Table

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HANDLERS_BUCKET,
    SUSPENSIONS_BUCKET,
    AlreadySettledError,
    EmitReply,
    EmitRequest,
    HandlerDeclaration,
    HookResult,
    decode,
    emit_service_subject,
    encode,
    handler_key,
)
from hookbus.workers import HookWorker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from _cluster import Cluster, wait_for  # noqa: E402  (the fault tests' helpers)
from _differential import Harness, drawn_cases, format_report, record_findings  # noqa: E402
from _fleet import Fleet, HandlerConf, Load, check_decision, run_cli, steady_load  # noqa: E402
from _supercluster import (  # noqa: E402
    HANDLER_TIMEOUT_S,
    Supercluster,
    Tally,
    emit_lanes,
    outage_run,
    stall_run,
)


@dataclass(frozen=True)
class Settings:
    suspensions: int
    """Suspensions created, resolved from another connection and woken during the outage."""
    settle_emits: int
    """Emits decided after each fault before the next one (the load keeps running)."""
    drain_requests: int
    """Requests in flight when the drain run sends SIGTERM."""
    differential_cases: int
    """Cases the differential run judges."""
    recovery_window_s: float
    """Topology runs: seconds the load goes on after the fault ended."""


DEFAULT = Settings(
    suspensions=300,
    settle_emits=400,
    drain_requests=120,
    differential_cases=2000,
    recovery_window_s=12.0,
)
QUICK = Settings(
    suspensions=100,
    settle_emits=150,
    drain_requests=60,
    differential_cases=200,
    recovery_window_s=8.0,
)


@dataclass
class RunResult:
    name: str
    emits: int = 0
    undecided_emits: int = 0
    wrong_decisions: int = 0
    failed_closed: int = 0
    suspensions: int = 0
    suspensions_lost_or_doubled: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    declarations_unwritable_s: float | None = None
    cases: int = 0
    """Differential cases judged."""
    divergences: int = 0
    """Differential cases whose fast-path decision differs from the one-by-one reference."""
    mix: dict[str, int] = field(default_factory=dict)
    """Differential: cases with each fault, handler pace, result kind, link delay and clock
    skew (``fault:kill``, ``pace:cpu``, ``kind:opaque``, ``delay:0.3``, ``skew:3600``)."""
    fail_closed_s: float | None = None
    """Topology runs: from the first emit failed closed to the end of the last one."""
    recovery_s: float | None = None
    """Topology runs: from the fault's end to the end of the last emit the guard did not
    decide itself (0: none after the fault ended)."""
    duration_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _window_stats(load: Load, start: float, end: float, out: RunResult) -> None:
    """Emit latency figures for emits started inside [start, end] (the outage)."""
    inside = sorted(lat for t, lat in load.samples if start <= t <= end)
    if not inside:
        return
    out.p50_ms = 1000 * statistics.median(inside)
    out.p99_ms = 1000 * inside[min(len(inside) - 1, int(0.99 * len(inside)))]
    out.max_ms = 1000 * inside[-1]


def _judge(load: Load, out: RunResult) -> None:
    out.emits = load.decided + len(load.undecided)
    out.undecided_emits = len(load.undecided)
    out.wrong_decisions = len(load.wrong)
    out.failed_closed = load.failed_closed
    out.notes += sorted(set(load.undecided))[:3] + sorted(set(load.wrong))[:3]


async def _guard(event: str, data: dict[str, Any]) -> HookResult:
    if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
        return HookResult(action="deny", reason="destructive")
    return HookResult(action="continue")


async def _audit(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="continue")


async def _progress(load: Load, n: int) -> None:
    target = load.decided + len(load.undecided) + n

    async def reached() -> bool:
        return load.decided + len(load.undecided) >= target

    await wait_for(reached, timeout_s=120, interval_s=0.05)


class Answer(msgspec.Struct):
    n: int


def _leaf(exc: BaseException) -> str:
    """The first innermost exception of a (nested) exception group, as text."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"


class SuspensionLoad:
    """Suspensions through the outage: each created by a waiter on the agent's connection,
    resolved once from another connection (a second resolve must be refused), woken."""

    def __init__(self, agent: HookDispatcher, resolver: HookDispatcher) -> None:
        self.agent, self.resolver = agent, resolver
        self.lost: list[str] = []
        self.doubled: list[str] = []
        self.done = 0
        self.finished = anyio.Event()

    async def one(self, i: int) -> None:
        label = f"faults {uuid.uuid4().hex} {i}"
        got: list[Answer] = []
        try:
            async with anyio.create_task_group() as tg:

                async def wait() -> None:
                    got.append(await self.agent.hook(label, Answer, timeout_s=60))

                tg.start_soon(wait)
                with anyio.fail_after(60):
                    while True:  # resolve once the pending record is visible
                        with contextlib.suppress(Exception):
                            record = await self.resolver.suspensions.get(label)
                            if record is not None and record[0].status == "pending":
                                break
                        await anyio.sleep(0.05)
                    await self._resolve(label, Answer(i))
                    try:
                        await self.resolver.resolve_hook(label, Answer(-1))
                        self.doubled.append(f"{label}: a second resolve was accepted")
                    except AlreadySettledError:
                        pass
        except Exception as exc:
            self.lost.append(f"{label}: {_leaf(exc)}"[:300])
            return
        if got != [Answer(i)]:
            self.lost.append(f"{label}: woke with {got}")
        self.done += 1

    async def _resolve(self, label: str, value: Answer) -> None:
        """Resolve, retrying only what may be retried: an error that says nothing was
        written. `AlreadySettledError` on the first resolve means the write was lost."""
        with anyio.fail_after(45):
            while True:
                try:
                    await self.resolver.resolve_hook(label, value)
                    return
                except AlreadySettledError:
                    raise
                except Exception:
                    await anyio.sleep(0.2)

    async def run(self, n: int, rate_per_s: float) -> None:
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(self.one, i)
                await anyio.sleep(1 / rate_per_s)  # spread over the outage
        self.finished.set()


class DeclarationProbe:
    """Writes a new handler declaration every 100 ms; sums the time none could be written
    (from the first failed write to the next successful one)."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.unwritable_s = 0.0
        self.failures = 0
        self.keys: list[str] = []

    async def run(self, stop: anyio.Event) -> None:
        js = self.nc.jetstream(timeout=1.0)
        kv = None
        failing_since: float | None = None
        event = f"probe:{uuid.uuid4().hex[:6]}"
        i = 0
        while not stop.is_set():
            i += 1
            name = f"probe_{i}"
            ok = False
            with contextlib.suppress(Exception):
                with anyio.fail_after(1.0):
                    if kv is None:
                        kv = await js.key_value(HANDLERS_BUCKET)
                    decl = HandlerDeclaration(event=event, name=name)
                    key = handler_key(event, name)
                    await kv.put(key, encode(decl))
                    self.keys.append(key)
                    ok = True
            now = time.monotonic()
            if ok and failing_since is not None:
                self.unwritable_s += now - failing_since
                failing_since = None
            elif not ok:
                self.failures += 1
                failing_since = failing_since or now
            await anyio.sleep(0.1)
        if failing_since is not None:
            self.unwritable_s += time.monotonic() - failing_since

    async def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            kv = await self.nc.jetstream().key_value(HANDLERS_BUCKET)
            for key in self.keys:
                await kv.purge(key)


# -- runs ---------------------------------------------------------------------------------
async def run_cluster(s: Settings) -> RunResult:
    out = RunResult("cluster leader loss")
    started = time.monotonic()
    event, guard, audit = f"faults:{uuid.uuid4().hex[:8]}", "guard", "audit"
    with Cluster() as cluster:
        await cluster.wait_ready()
        conns = [await cluster.connect() for _ in range(4)]
        nc_w, nc_d, nc_r, nc_p = conns
        try:
            worker = HookWorker(nc_w, bucket_replicas=3)
            worker.add_handler(
                event, _guard, name=guard, priority=10, timeout_s=2.0, failure_policy="deny"
            )
            worker.add_handler(event, _audit, name=audit, priority=20, timeout_s=2.0)
            async with (
                worker,
                HookDispatcher(nc_d, bucket_replicas=3) as d,
                HookDispatcher(nc_r, bucket_replicas=3, approvals=False) as resolver,
            ):
                load, stop = Load(), anyio.Event()
                susp = SuspensionLoad(d, resolver)
                probe = DeclarationProbe(nc_p)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(steady_load, d, event, guard, load, stop, 6)
                    tg.start_soon(probe.run, stop)
                    await _progress(load, 100)
                    outage_start = time.monotonic()
                    tg.start_soon(susp.run, s.suspensions, s.suspensions / 25)
                    streams = [None, f"KV_{HANDLERS_BUCKET}", f"KV_{SUSPENSIONS_BUCKET}"]
                    for stream in streams:
                        if stream is None:
                            victim = await wait_for(cluster.meta_leader)
                        else:
                            victim = await cluster.stream_leader(nc_d, stream, timeout_s=30)
                        cluster.node(victim).kill()
                        out.notes.append(f"killed {victim} ({stream or 'meta leader'})")
                        await _progress(load, s.settle_emits // 2)
                        cluster.node(victim).start()
                        await cluster.wait_ready(60)
                        await _progress(load, s.settle_emits // 2)
                    outage_end = time.monotonic()
                    await susp.finished.wait()  # the suspensions started in the outage end
                    stop.set()
                await probe.cleanup()
            _judge(load, out)
            _window_stats(load, outage_start, outage_end, out)
            out.suspensions = s.suspensions
            out.suspensions_lost_or_doubled = len(susp.lost) + len(susp.doubled)
            out.notes += (susp.lost + susp.doubled)[:3]
            out.declarations_unwritable_s = probe.unwritable_s
        finally:
            for conn in conns:
                with contextlib.suppress(Exception):
                    await conn.close()
    out.duration_s = time.monotonic() - started
    return out


async def _fleet_run(name: str, s: Settings, fault: str) -> RunResult:
    out = RunResult(name)
    started = time.monotonic()
    event, guard = f"faults:{uuid.uuid4().hex[:8]}", "guard"
    conf = [
        HandlerConf(
            event,
            guard,
            priority=10,
            failure_policy="deny",
            timeout_s=2.0,
            retry_safe=fault == "stall",
        )
    ]
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory() as tmp:
        async with Fleet(server.url, Path(tmp)) as fleet:
            victim = await fleet.worker(conf)
            await fleet.worker(conf)
            nc = await nats.connect(server.url)
            try:
                async with HookDispatcher(nc) as d:
                    with anyio.fail_after(10):
                        while guard not in {r.name for r in d.routes(event)}:
                            await d.refresh()
                    load, stop = Load(), anyio.Event()
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(steady_load, d, event, guard, load, stop, 8)
                        await _progress(load, 200)
                        outage_start = time.monotonic()
                        if fault == "kill":
                            victim.kill()
                            await _progress(load, s.settle_emits)
                        else:
                            victim.pause()
                            await anyio.sleep(5.0)  # the stall itself
                            victim.resume()
                        outage_end = time.monotonic()
                        await _progress(load, 100)
                        stop.set()
                _judge(load, out)
                _window_stats(load, outage_start, outage_end, out)
            finally:
                await nc.close()
    out.duration_s = time.monotonic() - started
    return out


async def run_drain(s: Settings) -> RunResult:
    out = RunResult("SIGTERM drain")
    started = time.monotonic()
    event, guard = f"faults:{uuid.uuid4().hex[:8]}", "guard"
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory() as tmp:
        async with Fleet(server.url, Path(tmp)) as fleet:
            worker = await fleet.worker(
                [
                    HandlerConf(event, guard, priority=10, failure_policy="deny"),
                    HandlerConf(event, "slow", priority=20, sleep_s=0.5),
                    HandlerConf(event, "asker", priority=5, tool_filter=["approve"], ask=True),
                ]
            )
            service = await fleet.dispatcher()
            nc = await nats.connect(server.url)
            answers: list[str] = []
            latencies: list[float] = []

            async def call(i: int) -> None:
                tool = "approve" if i % 20 == 0 else "bash"
                command = "rm -rf /x" if i % 2 else "ls"
                req = EmitRequest(
                    data={"tool_name": tool, "tool_input": {"command": command}},
                    session_id=f"s{i}",
                )
                t0 = time.monotonic()
                try:
                    msg = await nc.request(emit_service_subject(event), encode(req), timeout=40)
                    reply = decode(msg.data, EmitReply)
                except Exception as exc:
                    answers.append(f"unanswered: {type(exc).__name__}")
                    return
                latencies.append(time.monotonic() - t0)
                if reply.result is not None:
                    why = check_decision(reply.result, "rm -rf" in command, guard)
                    answers.append(f"wrong: {why}" if why and tool == "bash" else "result")
                elif reply.error is not None and reply.error.retryable:
                    answers.append("retryable")
                else:
                    answers.append(f"unanswered: {reply.error}")

            try:
                async with anyio.create_task_group() as tg:
                    for i in range(s.drain_requests):
                        tg.start_soon(call, i)
                    await nc.flush()
                    await anyio.sleep(0.3)  # the requests are in flight
                    t_term = time.monotonic()
                    service.terminate()
                    worker.terminate()
                    codes = [await service.wait_exit(60), await worker.wait_exit(60)]
                    out.notes.append(
                        f"exit {codes} after {time.monotonic() - t_term:.1f}s;"
                        f" left running: {len(fleet.left_running())}"
                    )
            finally:
                await nc.close()
    out.emits = len(answers)
    out.undecided_emits = sum(a.startswith("unanswered") for a in answers)
    out.wrong_decisions = sum(a.startswith("wrong") for a in answers)
    out.notes.append(f"{answers.count('retryable')} answered retryable unavailable")
    if latencies:
        latencies.sort()
        out.p50_ms = 1000 * statistics.median(latencies)
        out.p99_ms = 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        out.max_ms = 1000 * latencies[-1]
    out.duration_s = time.monotonic() - started
    return out


# -- topology runs (leaf link, supercluster) ----------------------------------------------
def _tally_result(
    out: RunResult, tallies: list[Tally], guard: Tally, fault: tuple[float, float]
) -> None:
    """`out`'s figures from judged emits: undecided, wrong and harmless calls failed closed
    over every tally; latency inside `fault` (start, end) over every tally; the fail-closed
    span and the recovery of `guard`."""
    start, end = fault
    for t in tallies:
        out.emits += t.emits
        out.undecided_emits += len(t.undecided)
        out.wrong_decisions += len(t.wrong)
        out.failed_closed += t.harmless_failed_closed
        out.notes += sorted(set(t.undecided))[:3] + sorted(set(t.wrong))[:3]
        out.notes.append(t.summary())
    inside = sorted(b - a for t in tallies for a, b, _ in t.log if start <= a <= end)
    if inside:
        out.p50_ms = 1000 * statistics.median(inside)
        out.p99_ms = 1000 * inside[min(len(inside) - 1, int(0.99 * len(inside)))]
        out.max_ms = 1000 * inside[-1]
    failed = [b for _, b, ok in guard.log if not ok]
    out.fail_closed_s = (max(failed) - min(failed)) if failed else 0.0
    out.recovery_s = max(0.0, max(failed, default=end) - end)


async def run_leaf_link(s: Settings) -> RunResult:
    """A hub and a leaf without JetStream; the link cut for 3 s (test_sites_faults' relay)."""
    from _sites import hub_and_leaf
    from test_sites_faults import relayed

    out = RunResult("leaf link cut 3 s")
    started = time.monotonic()
    event = f"faults:{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp, hub_and_leaf(Path(tmp), relay=True) as ports:
        relay, hub_nc, leaf_nc, worker = await relayed(ports)
        worker.add_handler(
            event, _guard, name="guard", timeout_s=HANDLER_TIMEOUT_S, failure_policy="deny"
        )
        guard = Tally("guard")
        try:
            async with worker, HookDispatcher(leaf_nc, js_domain="hub") as d:
                stop = anyio.Event()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_lanes, d, event, guard, stop)
                    await anyio.sleep(1.0)
                    await relay.cut()
                    cut_at = time.monotonic()
                    await anyio.sleep(3.0)
                    await relay.restore()
                    restored_at = time.monotonic()
                    await anyio.sleep(s.recovery_window_s)
                    stop.set()
        finally:
            await leaf_nc.close()
            await hub_nc.close()
            await relay.cut()
        _tally_result(out, [guard], guard, (cut_at, restored_at))
    out.duration_s = time.monotonic() - started
    return out


async def _lanes(d: HookDispatcher, event: str, tally: Tally, stop: anyio.Event) -> None:
    await emit_lanes(d, event, tally, stop, lanes=4, rate_per_s=50.0)


async def run_supercluster_stall(s: Settings) -> RunResult:
    out = RunResult("supercluster: west replica SIGSTOP 5 s")
    started = time.monotonic()
    with Supercluster() as sc, tempfile.TemporaryDirectory() as tmp:
        await sc.wait_ready()
        status, _, err = await run_cli(
            sc.url("west"), "auth", "provision", "--replicas", "3", "--placement-cluster", "east"
        )
        if status != 0:
            raise RuntimeError(f"provision failed: {err}")
        stall = await stall_run(sc, Path(tmp), stall_s=5.0)
    _tally_result(
        out, [stall.hedged, stall.guard], stall.guard, (stall.stall_start, stall.stall_end)
    )
    out.notes.append(
        f"retry_safe answered by the handler: {stall.hedged.answered} of {stall.hedged.emits};"
        f" guard failed closed (rm and ls): {stall.guard.failed_closed}"
    )
    out.duration_s = time.monotonic() - started
    return out


async def run_supercluster_outage(s: Settings) -> RunResult:
    out = RunResult("supercluster: east lost 3 s")
    started = time.monotonic()
    with Supercluster() as sc, tempfile.TemporaryDirectory() as tmp:
        await sc.wait_ready()
        outage = await outage_run(
            sc, Path(tmp), outage_s=3.0, recovery_window_s=s.recovery_window_s
        )
    _tally_result(out, [outage.guard], outage.guard, (outage.killed_at, outage.restarted_at))
    out.duration_s = time.monotonic() - started
    return out


PROGRESS_EVERY = 100
"""A differential run prints a progress line to stderr every this many cases."""


async def run_differential(s: Settings, findings: str | None, seed: int | None) -> RunResult:
    """The differential judge over `s.differential_cases` hypothesis cases."""
    out = RunResult("differential")
    started = time.monotonic()
    todo = drawn_cases(s.differential_cases, seed)
    by_fault: dict[str, list[int]] = {}
    with EmbeddedNatsServer() as server:
        harness = Harness(server.url)
        await harness.start()
        try:
            for i, case in enumerate(todo):
                report = await harness.run_case(case, i)
                for key in _case_mix(case):
                    out.mix[key] = out.mix.get(key, 0) + 1
                tally = by_fault.setdefault(case.fault.kind, [0, 0])
                tally[0] += 1
                out.cases += 1
                if report.divergences:
                    tally[1] += 1
                    out.divergences += 1
                    label = f"seed {seed}, case {i}" if seed is not None else f"case {i}"
                    record_findings(findings, report, seed=label)
                    if out.divergences <= 3:
                        out.notes.append(format_report(report, label).splitlines()[0])
                if out.cases % PROGRESS_EVERY == 0:
                    print(
                        f"differential: {out.cases}/{len(todo)} cases, {out.divergences} "
                        f"divergent, {time.monotonic() - started:.0f} s",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
        finally:
            await harness.close()
    out.notes.append(
        "divergent / cases per fault: "
        + ", ".join(f"{k} {d}/{n}" for k, (n, d) in sorted(by_fault.items()))
    )
    out.duration_s = time.monotonic() - started
    return out


def _case_mix(case: Any) -> set[str]:
    """What a differential case exercises (`RunResult.mix`)."""
    return {
        f"fault:{case.fault.kind}", f"delay:{case.delay_s:g}", f"skew:{case.skew_s:g}",
        *(f"pace:{h.pace}" for h in case.handlers), *(f"kind:{h.kind}" for h in case.handlers),
    }  # fmt: skip


# -- report -------------------------------------------------------------------------------
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def print_table(results: list[RunResult], console: Console) -> None:
    table = Table(title="hookbus under faults", show_lines=False)
    table.add_column("figure")
    for r in results:
        table.add_column(r.name, justify="right")
    table.add_column("target", justify="right")

    def row(label: str, values: list[str], target: str = "") -> None:
        table.add_row(label, *values, target)

    row("emits (or requests)", [f"{r.emits:,}" for r in results])
    row(
        "emits without a decision by their deadline", [str(r.undecided_emits) for r in results], "0"
    )
    row("decisions contradicting the policy", [str(r.wrong_decisions) for r in results], "0")
    row(
        "suspensions lost or resolved twice",
        [f"{r.suspensions_lost_or_doubled} of {r.suspensions}" if r.suspensions else "-"
         for r in results],
        "0",
    )  # fmt: skip
    row("harmless calls denied by a failure (by policy)", [str(r.failed_closed) for r in results])
    row("emit p50 during the outage, ms", [_ms(r.p50_ms) for r in results])
    row("emit p99 during the outage, ms", [_ms(r.p99_ms) for r in results])
    row("emit max during the outage, ms", [_ms(r.max_ms) for r in results])
    row(
        "new declarations unwritable, s",
        [
            "-" if r.declarations_unwritable_s is None else f"{r.declarations_unwritable_s:.1f}"
            for r in results
        ],
    )
    row(
        "topology runs: fail-closed, s",
        ["-" if r.fail_closed_s is None else f"{r.fail_closed_s:.2f}" for r in results],
    )
    row(
        "topology runs: deciding again after the fault, s",
        ["-" if r.recovery_s is None else f"{r.recovery_s:.2f}" for r in results],
    )
    row("differential cases", [f"{r.cases:,}" if r.cases else "-" for r in results])
    row(
        "cases deciding unlike one by one",
        [str(r.divergences) if r.cases else "-" for r in results],
        "0",
    )
    row("run time, s", [f"{r.duration_s:.0f}" for r in results])
    console.print(table)
    for r in results:
        for note in r.notes:
            console.print(f"[dim]{r.name}: {note}[/dim]")


async def main_async(args: argparse.Namespace) -> int:
    s = QUICK if args.quick else DEFAULT
    if args.cases is not None:
        s = dataclasses.replace(s, differential_cases=args.cases)
    console = Console(width=max(120, Console().width))
    runs = {
        "cluster": lambda: run_cluster(s),
        "worker-kill": lambda: _fleet_run("worker SIGKILL", s, "kill"),
        "replica-stall": lambda: _fleet_run("replica SIGSTOP 5 s", s, "stall"),
        "drain": lambda: run_drain(s),
        "differential": lambda: run_differential(s, args.findings, args.seed),
        "leaf-link": lambda: run_leaf_link(s),
        "supercluster-stall": lambda: run_supercluster_stall(s),
        "supercluster-outage": lambda: run_supercluster_outage(s),
    }
    chosen = args.only or list(runs)
    results: list[RunResult] = []
    status = 0
    for name in chosen:
        console.print(f"[bold]run {name}[/bold] ...")
        try:
            results.append(await runs[name]())
        except Exception as exc:
            console.print(f"[red]run {name} failed: {type(exc).__name__}: {exc}[/red]")
            results.append(RunResult(name, notes=[f"run failed: {type(exc).__name__}: {exc}"]))
            status = 1
    print_table(results, console)
    if args.json:
        figures = {
            "undecided_emits": sum(r.undecided_emits for r in results),
            "wrong_decisions": sum(r.wrong_decisions for r in results),
            "suspensions_lost_or_doubled": sum(r.suspensions_lost_or_doubled for r in results),
            "cases": sum(r.cases for r in results),
            "divergences": sum(r.divergences for r in results),
            "mix": {k: v for r in results for k, v in sorted(r.mix.items())},
            "quick": bool(args.quick),
            "runs": [asdict(r) for r in results],
        }
        await anyio.Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer emits and suspensions")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument(
        "--only",
        action="append",
        choices=[
            "cluster",
            "worker-kill",
            "replica-stall",
            "drain",
            "differential",
            "leaf-link",
            "supercluster-stall",
            "supercluster-outage",
        ],
        help="run only this (repeatable)",
    )
    parser.add_argument(
        "--findings", metavar="FILE", help="append each divergent differential case to FILE"
    )
    parser.add_argument(
        "--seed", type=int, help="draw the differential cases from this seed (default: fixed)"
    )
    parser.add_argument("--cases", type=int, help="differential cases to judge")
    parser.add_argument("--verbose", action="store_true", help="show the library's warnings")
    args = parser.parse_args()
    # the outages make nats-py and hookbus log every reconnect and failed call: keep the
    # table readable unless asked
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL)
    sys.exit(anyio.run(main_async, args, backend="asyncio"))


if __name__ == "__main__":
    main()
