"""Tracing benchmark: emit p50 with tracing on vs off, in the same run.

    .venv/bin/python benchmarks/tracing.py                  # embedded nats-server, n=2000
    .venv/bin/python benchmarks/tracing.py --n 4000 --url nats://127.0.0.1:4222

Two figures, each a ratio or a difference measured in one run:

- ``bench_tracing``: an agent-side `HookDispatcher.emit` of a chain of 3 remote handlers
  (sequential, each answers continue). "off": no provider set anywhere (the API's defaults).
  "on": what ``--otlp-endpoint`` installs, with an exporter that drops everything instead
  of sending: an SDK `TracerProvider` with a `BatchSpanProcessor` and an SDK `MeterProvider`,
  in the agent and in the worker process. "unsampled": the same SDK whose sampler drops
  every root (``parentbased_always_off``): what tracing costs when the sampler says no;
  "ratio": a sampler that keeps one emit in ten (``parentbased_traceidratio``, 0.1), the
  SDK's sampled mode.
  Each variant has worker processes of its own (this file served by ``hookbus worker``;
  the SDK ones configure it at import), so the handler spans are paid for too. Rounds
  rotate the variants' order so machine noise hits all alike; the agent's providers are
  swapped between rounds the way opentelemetry-test-utils resets them. Besides latency,
  the CPU time per emit of the agent and of the worker process (Linux: ``/proc``), which
  neighbours on a shared machine disturb less. Target: ``on_p50 / off_p50 <= 1.3``.
- ``bench_noop_overhead``: with no provider set, an in-process emit to 3 local handlers,
  instrumented (the library as shipped) vs the same methods without their telemetry checks:
  the cost of the instrumentation when tracing is off. Target: < 5 us per emit.

Not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.metrics import _internal as _metrics_internal
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.util._once import Once

from hookbus.dispatcher import HookDispatcher
from hookbus.workers import HookWorker

__all__ = ["bench_noop_overhead", "bench_span_floor", "bench_tracing"]

TARGET_RATIO = 1.3
RATIO = 0.1
"""The "ratio" variant's sampler: ``parentbased_traceidratio`` with this ratio, what
``OTEL_TRACES_SAMPLER=parentbased_traceidratio OTEL_TRACES_SAMPLER_ARG=0.1`` installs."""
TARGET_NOOP_US = 5.0
DATA: dict[str, Any] = {
    "tool_name": "bash",
    "tool_input": {"command": "ls -la /tmp"},
    "agent_id": "agent-1",
    "session_id": "session-1",
}
ENV_TRACING = "HOOKBUS_BENCH_TRACING"
"""In a worker process: ``traces``, ``all`` (traces and metrics) or ``unsampled`` (traces
whose sampler drops every root) makes this module install the SDK at import; anything else
leaves the API's defaults."""
EVENTS = {
    "off": "bench:tracing-off",
    "traces": "bench:tracing-on",
    "all": "bench:tracing-all",
    "unsampled": "bench:tracing-unsampled",
    "ratio": "bench:tracing-ratio",
}
"""Per variant, the event of its chain of 3 (each served by worker processes of its own)."""
VARIANTS = tuple(EVENTS)


class DropExporter(SpanExporter):
    """An exporter that accepts and drops spans (counts them): the SDK's cost, no I/O."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


def sdk_providers(
    sampler: Sampler | None = None,
) -> tuple[TracerProvider, MeterProvider, DropExporter]:
    """What `hookbus.cli.configure_otel` installs, with a dropping exporter (and `sampler`,
    None: the SDK's default, parent-based always-on)."""
    exporter = DropExporter()
    tracer_provider = TracerProvider(sampler=sampler, meter_provider=NoOpMeterProvider())
    tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    return tracer_provider, meter_provider, exporter


def _reset_globals() -> None:
    """Forget the global providers (as opentelemetry-test-utils' reset_*_globals do)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    _metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    _metrics_internal._METER_PROVIDER = None


# -- the worker processes (``hookbus worker benchmarks/tracing.py:worker_on``) ----------------
if os.environ.get(ENV_TRACING) in ("traces", "all", "unsampled", "ratio"):
    _unsampled = os.environ[ENV_TRACING] == "unsampled"
    _tp, _mp, _ = sdk_providers(ParentBased(ALWAYS_OFF) if _unsampled else None)
    trace.set_tracer_provider(_tp)
    if os.environ[ENV_TRACING] == "all":
        metrics.set_meter_provider(_mp)


def _chain(worker: HookWorker, event: str) -> HookWorker:
    for priority in (1, 2, 3):

        async def passthrough(ev: str, data: dict[str, Any]) -> None:
            return None

        worker.add_handler(event, passthrough, priority=priority, name=f"chain{priority}")
    return worker


worker_off = _chain(HookWorker(), EVENTS["off"])
worker_traces = _chain(HookWorker(), EVENTS["traces"])
worker_all = _chain(HookWorker(), EVENTS["all"])
worker_unsampled = _chain(HookWorker(), EVENTS["unsampled"])
worker_ratio = _chain(HookWorker(), EVENTS["ratio"])


class _Proc:
    def __init__(self, variant: str, url: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env[ENV_TRACING] = variant
        attr = f"worker_{variant}"
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "hookbus.cli", "--log-level", "info", "worker",
             f"{Path(__file__).resolve()}:{attr}", "--url", url],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def wait_ready(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            if "serving " in line:
                return
        raise RuntimeError(f"worker exited with {self.popen.wait()}")

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the worker process used so far; None off Linux."""
        return _proc_cpu_s(self.popen.pid)

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        if self.popen.stderr is not None:
            self.popen.stderr.close()


def _proc_cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _p(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timed(d: HookDispatcher, event: str, n: int, out: list[float] | None) -> None:
    for _ in range(n):
        t = time.perf_counter()
        await d.emit(event, DATA)
        if out is not None:
            out.append(time.perf_counter() - t)


async def bench_tracing(
    url: str, n: int = 2000, *, rounds: int = 10, warmup: int = 200
) -> dict[str, Any]:
    """Emit p50 of a chain of 3 remote handlers: tracing off, on, on with metrics, on
    with a sampler that drops everything, and on with one that keeps one emit in ten.

    Args:
        url: NATS server URL (JetStream on).
        n: measured emits per variant.
        rounds: rounds the emits are split into; the variants' order rotates each round.
        warmup: unmeasured emits per variant first.
    Returns:
        ``{"n", "<v>_p50_ms", "<v>_p95_ms" for v in off, on, all, unsampled, sampled,
        "ratio", "ratio_with_metrics", "ratio_unsampled", "ratio_sampled", "target", "met",
        "spans_per_emit_agent", "cpu_us"}`` where ``ratio`` is tracing on / off (the
        target's figure), ``ratio_with_metrics`` tracing and metrics on / off,
        ``ratio_unsampled`` sampled-out / off, ``ratio_sampled`` one emit in ten sampled
        / off, and ``cpu_us`` per variant the CPU microseconds per emit of the agent and of
        the worker process (``{"off": {"agent": .., "worker": ..}, ...}``; worker None off
        Linux).
    """
    import nats

    procs = {v: _Proc(v, url) for v in VARIANTS}
    _reset_globals()
    tracer_provider, meter_provider, exporter = sdk_providers()
    unsampled_provider, _, _ = sdk_providers(ParentBased(ALWAYS_OFF))
    ratio_provider, _, _ = sdk_providers(ParentBased(TraceIdRatioBased(RATIO)))
    nc = await nats.connect(url)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu = {v: {"agent": 0.0, "worker": 0.0} for v in VARIANTS}
    spans_per_emit = 0.0
    try:
        for proc in procs.values():
            await asyncio.to_thread(proc.wait_ready)  # subscribed and declared
        d = HookDispatcher(nc, approvals=False)
        await d.start()  # loads the declarations written before this point
        for event in EVENTS.values():
            assert len(d.list_handlers(event)[event]) == 3, d.list_handlers(event)

        def install(variant: str) -> None:
            _reset_globals()
            if variant in ("traces", "all"):
                trace.set_tracer_provider(tracer_provider)
            elif variant == "unsampled":
                trace.set_tracer_provider(unsampled_provider)
            elif variant == "ratio":
                trace.set_tracer_provider(ratio_provider)
            if variant == "all":
                metrics.set_meter_provider(meter_provider)

        for variant in VARIANTS:
            install(variant)
            await _timed(d, EVENTS[variant], warmup, None)
        per_round = max(1, n // rounds)
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for variant in order if r % 2 == 0 else reversed(order):
                install(variant)
                tracer_provider.force_flush()
                before = exporter.spans
                agent0, worker0 = time.process_time(), procs[variant].cpu_s()
                await _timed(d, EVENTS[variant], per_round, samples[variant])
                cpu[variant]["agent"] += time.process_time() - agent0
                worker1 = procs[variant].cpu_s()
                if worker0 is not None and worker1 is not None:
                    cpu[variant]["worker"] += worker1 - worker0
                if variant == "traces":
                    tracer_provider.force_flush()
                    spans_per_emit = (exporter.spans - before) / per_round
        await d.close()
    finally:
        _reset_globals()
        for provider in (tracer_provider, unsampled_provider, ratio_provider, meter_provider):
            provider.shutdown()
        await nc.close()
        for proc in procs.values():
            proc.stop()
    p50 = {v: statistics.median(samples[v]) for v in VARIANTS}
    ratio = p50["traces"] / p50["off"]
    measured = per_round * rounds
    linux = sys.platform.startswith("linux")
    out: dict[str, Any] = {"n": len(samples["off"])}
    for v, key in (("off", "off"), ("traces", "on"), ("all", "all"), ("unsampled", "unsampled"),
                   ("ratio", "sampled")):  # fmt: skip
        out[f"{key}_p50_ms"] = p50[v] * 1e3
        out[f"{key}_p95_ms"] = _p(samples[v], 0.95) * 1e3
    out.update(
        ratio=ratio,
        ratio_with_metrics=p50["all"] / p50["off"],
        ratio_unsampled=p50["unsampled"] / p50["off"],
        ratio_sampled=p50["ratio"] / p50["off"],
        target=TARGET_RATIO,
        met=ratio <= TARGET_RATIO,
        spans_per_emit_agent=spans_per_emit,
        cpu_us={
            {"traces": "on", "ratio": "sampled"}.get(v, v): {
                "agent": cpu[v]["agent"] / measured * 1e6,
                "worker": cpu[v]["worker"] / measured * 1e6 if linux else None,
            }
            for v in VARIANTS
        },
    )
    return out


async def bench_span_floor(
    url: str, n: int = 2000, *, rounds: int = 10, warmup: int = 200
) -> dict[str, Any]:
    """The SDK's own cost for the spans a traced chain of 3 makes, without hookbus: a raw
    NATS request and its reply (responder in this process, on its own connection), bare,
    vs the same round trip making what hookbus records for it: the emit's INTERNAL span
    (7 attributes) and the chain's PRODUCER span (6) around the request, its
    ``traceparent`` formatted into the headers; the responder reads it and makes the
    CONSUMER span (parented and linked, 10 attributes) around its reply. Same SDK setup
    as `bench_tracing` (a `BatchSpanProcessor` and a dropping exporter). Interleaved
    rounds; p50s.

    Returns ``{"n", "bare_p50_us", "spans_p50_us", "spans_us"}``: ``spans_us`` is what
    those 3 spans add to a round trip (the floor of ``bench_tracing``'s on - off).
    """
    import nats
    from opentelemetry import propagate
    from opentelemetry.trace import Link, SpanKind

    _reset_globals()
    tracer_provider, _, _ = sdk_providers()
    tracer = tracer_provider.get_tracer("floor")
    nc, responder = await nats.connect(url), await nats.connect(url)
    subject = "bench.tracing.floor"
    traced = False
    messaging = {
        "messaging.system": "nats",
        "messaging.destination.name": "hookbus.v1.chain.bench=3Atracing-floor.abcdef0123456789",
        "messaging.operation.type": "send",
    }

    async def reply(msg: Any) -> None:
        if not traced:
            await msg.respond(b"{}")
            return
        parent = propagate.extract(msg.headers or {})
        remote = trace.get_current_span(parent).get_span_context()
        span = tracer.start_span(
            "process bench chain1,chain2,chain3",
            parent,
            kind=SpanKind.CONSUMER,
            links=[Link(remote)],
        )
        await msg.respond(b"{}")
        span.set_attributes({
            **messaging, "messaging.operation.type": "process",
            "messaging.message.id": "e" * 32, "gen_ai.agent.id": "agent-1",
            "gen_ai.conversation.id": "session-1", "gen_ai.tool.name": "bash",
            "hookbus.chain.handlers": ["chain1", "chain2", "chain3"],
            "hookbus.chain.outcomes": ["continue", "continue", "continue"],
            "hookbus.chain.durations_s": [1e-05, 1e-05, 1e-05],
        })  # fmt: skip
        span.end()

    await responder.subscribe(subject, cb=reply)
    await responder.flush()

    async def once() -> None:
        if not traced:
            await nc.request(subject, b"{}", timeout=5)
            return
        emit = tracer.start_span("emit bench")
        ctx = trace.set_span_in_context(emit)
        send = tracer.start_span("send bench chain1,chain2,chain3", ctx, kind=SpanKind.PRODUCER)
        sc = send.get_span_context()
        headers = {"traceparent": f"00-{sc.trace_id:032x}-{sc.span_id:016x}-01"}
        await nc.request(subject, b"{}", timeout=5, headers=headers)
        send.set_attributes({
            **messaging, "hookbus.chain.handlers": ["chain1", "chain2", "chain3"],
            "hookbus.chain.failure_policies": ["ignore", "ignore", "ignore"],
            "hookbus.chain.outcomes": ["continue", "continue", "continue"],
        })  # fmt: skip
        send.end()
        emit.set_attributes({
            "hookbus.event": "bench", "gen_ai.agent.id": "agent-1",
            "gen_ai.conversation.id": "session-1", "gen_ai.tool.name": "bash",
            "hookbus.action": "continue", "hookbus.failed_open": False,
            "hookbus.decided_by": "chain3",
        })  # fmt: skip
        emit.end()

    samples: dict[bool, list[float]] = {False: [], True: []}
    try:
        for flag in (False, True):
            traced = flag
            for _ in range(warmup):
                await once()
        per_round = max(1, n // rounds)
        for r in range(rounds):
            for flag in (False, True) if r % 2 == 0 else (True, False):
                traced = flag
                for _ in range(per_round):
                    t = time.perf_counter()
                    await once()
                    samples[flag].append(time.perf_counter() - t)
    finally:
        tracer_provider.shutdown()
        await responder.close()
        await nc.close()
    bare, spans = statistics.median(samples[False]), statistics.median(samples[True])
    return {
        "n": len(samples[False]),
        "bare_p50_us": bare * 1e6,
        "spans_p50_us": spans * 1e6,
        "spans_us": (spans - bare) * 1e6,
    }


async def bench_noop_overhead(n: int = 20000, *, rounds: int = 10) -> dict[str, Any]:
    """Instrumentation cost with no provider set: emit to 3 in-process handlers, as shipped
    vs unwrapped, interleaved. Returns ``{"n", "bare_us", "instrumented_us",
    "overhead_us", "target_us", "met"}`` (medians of the per-round means)."""
    _reset_globals()

    class Bare(HookDispatcher):
        async def emit(self, event: str, data: dict[str, Any], **kwargs: Any) -> Any:
            return await self._emitter.emit(event, data, **kwargs)  # no telemetry check

        _call = HookDispatcher._call.__wrapped__  # type: ignore[attr-defined]

    async def h(event: str, data: dict[str, Any]) -> None:
        return None

    def make(cls: type[HookDispatcher]) -> HookDispatcher:
        d = cls()
        for priority in (1, 2, 3):
            d.register("bench:local", h, priority, f"h{priority}")
        return d

    bare, shipped = make(Bare), make(HookDispatcher)
    per_round = max(1, n // rounds)
    results: dict[str, list[float]] = {"bare": [], "instrumented": []}
    for d in (bare, shipped):
        await _timed(d, "bench:local", per_round // 5, None)
    for r in range(rounds):
        order = (("bare", bare), ("instrumented", shipped))
        for name, d in order if r % 2 == 0 else reversed(order):
            t = time.perf_counter()
            await _timed(d, "bench:local", per_round, None)
            results[name].append((time.perf_counter() - t) / per_round * 1e6)
    bare_us = statistics.median(results["bare"])
    inst_us = statistics.median(results["instrumented"])
    return {
        "n": per_round * rounds,
        "bare_us": bare_us,
        "instrumented_us": inst_us,
        "overhead_us": inst_us - bare_us,
        "target_us": TARGET_NOOP_US,
        "met": inst_us - bare_us < TARGET_NOOP_US,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="NATS URL (default: embedded nats-server)")
    parser.add_argument("--n", type=int, default=2000, help="measured emits per variant")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args()

    async def run(url: str) -> dict[str, Any]:
        return {
            "tracing": await bench_tracing(url, args.n),
            "span_floor": await bench_span_floor(url, args.n),
            "noop_overhead": await bench_noop_overhead(),
        }

    if args.url:
        out = asyncio.run(run(args.url))
    else:
        from hookbus.cli import EmbeddedNatsServer

        with EmbeddedNatsServer() as server:
            out = asyncio.run(run(server.url))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    t, o = out["tracing"], out["noop_overhead"]
    print(f"emit, chain of 3 remote handlers, n={t['n']} per variant")
    cpu = t["cpu_us"]

    def line(label: str, key: str, extra: str = "") -> None:
        worker = cpu[key]["worker"]
        print(
            f"  {label:<12} p50 {t[f'{key}_p50_ms']:.3f} ms   p95 {t[f'{key}_p95_ms']:.3f} ms"
            f"   cpu/emit agent {cpu[key]['agent']:.0f} us"
            + (f", worker {worker:.0f} us" if worker is not None else "")
            + extra
        )

    line("tracing off", "off")
    line("tracing on", "on", f"   ({t['spans_per_emit_agent']:.1f} agent-side spans per emit)")
    line("+ metrics", "all")
    line("sampled out", "unsampled")
    line(f"{RATIO:.0%} sampled", "sampled")
    print(
        f"  ratio on/off {t['ratio']:.3f}  (target <= {t['target']})  "
        f"{'MET' if t['met'] else 'MISSED'};  with metrics {t['ratio_with_metrics']:.3f};"
        f"  sampled out {t['ratio_unsampled']:.3f};  {RATIO:.0%} sampled {t['ratio_sampled']:.3f}"
    )
    f = out["span_floor"]
    floor_ratio = (t["off_p50_ms"] * 1e3 + f["spans_us"]) / (t["off_p50_ms"] * 1e3)
    print(f"the SDK's floor: a raw NATS round trip with the 3 spans, n={f['n']} per variant")
    print(
        f"  bare p50 {f['bare_p50_us']:.0f} us   with the spans {f['spans_p50_us']:.0f} us"
        f"   the spans add {f['spans_us']:.0f} us: tracing off + that = {floor_ratio:.3f}x"
    )
    print(f"no-op overhead, in-process emit to 3 handlers, no provider, n={o['n']}")
    print(
        f"  unwrapped {o['bare_us']:.2f} us   instrumented {o['instrumented_us']:.2f} us   "
        f"overhead {o['overhead_us']:+.2f} us  (target < {o['target_us']} us)  "
        f"{'MET' if o['met'] else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
