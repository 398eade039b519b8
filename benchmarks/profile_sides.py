"""The CPU of one decision, per side: the agent, the dispatcher service, the worker.

    .venv/bin/python benchmarks/profile_sides.py                       # about 1 minute
    .venv/bin/python benchmarks/profile_sides.py --tree old=/path/to/an/older/checkout
    .venv/bin/python benchmarks/profile_sides.py --profile DIR         # py-spy per side
    .venv/bin/python benchmarks/profile_sides.py --kb 512 --in-flight 1 --sides raw,emit \\
        --worker benchmarks/_workers.py:large_worker --event bench:big-chain  # large events

Wall-clock figures are noisy on a shared machine; the CPU time a process spends is much
less so. This runs, per code tree, one embedded nats-server, the raw responder
(``benchmarks/_workers.py``, replies inline), a ``hookbus worker`` process serving
``bench:one`` (``_workers.py:latency_worker``, uvloop as the CLI picks), a ``hookbus
dispatcher`` process (the thin agents' door) and one agent process (this file with
``--agent``). Each window keeps `--in-flight` calls outstanding from the agent for
`--seconds`, after a 0.3 s warm-up, of one side:

- ``raw``: a raw request (`_raw.RawRequester`) to the inline responder (the floor);
- ``emit``: `HookDispatcher.emit("bench:one")` in the agent (the embedded dispatcher);
- ``service``: a raw request with an `EmitRequest` body to the dispatcher service
  (``hookbus.v1.emit.<agent>.bench:one``), which emits to the same worker.

`--kb N` makes the event's data about N KB (`_workers.big_data`: a file's text; the raw
request sends an envelope of the same data, encoded once); `--event` and `--worker` pick
another event and the worker serving it (e.g. ``_workers.py:large_worker``, whose
``bench:big-chain`` and ``bench:big-modify`` are chains of 3).

Per window it reads each process's CPU (``/proc/<pid>/stat``: user + system; the agent
its own ``time.process_time``) and divides by the calls completed: microseconds of CPU
per decision, per process. Windows rotate over the trees and sides every round (so
drift hits every side alike); the table gives each figure's median over the rounds.

`--tree LABEL=DIR` (repeatable) adds a checkout of another commit: its processes run with
its package folders first on ``PYTHONPATH`` (the folders of this checkout's editable
install stay behind them), each tree on a server of its own. Without one, this checkout
alone (``new``). The benchmark's own scripts are this checkout's in every tree.

`--profile DIR`: after the rounds, one more window per side and tree with ``py-spy record
--format raw`` (``pip install py-spy``) attached to the agent, the worker and the
service; the collapsed stacks are written to DIR and each process's self time is
summed into layers (`LAYERS`; ``--gil``: samples of the thread running Python, so the
agent's idle stdin reader is not counted), printed as microseconds per decision (its share of the
samples times its CPU per decision in that window). A command, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EVENT = "bench:one"
WORKER = "benchmarks/_workers.py:latency_worker"
AGENT_ID = "agent-1"
"""The agent of `_workers.DATA` (the service checks the data names the subject's agent)."""
PORTIONS = ("core", "schemas", "workers", "dispatcher", "cli", "integrations", "testing")
"""Package folders put on ``PYTHONPATH`` for a tree (those it has)."""
WARMUP_S = 0.3
SIDES = ("raw", "emit", "service")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "socket writes (the transport's write: the syscall)",
        ("StreamWriter.write", "Transport.write"),
    ),
    ("uvloop's C loop (seen as Runner.run)", ("Runner.run ",)),
    ("telemetry", ("opentelemetry", "_telemetry", "otel_providers", "contextvars_context")),
    ("deadlines (hookbus._core.clock)", ("clock.py",)),
    ("envelope encode/decode (msgspec, codec)", ("msgspec", "_codec.py", "copies.py", "_jsonsafe")),
    ("nats-py parse/publish", ("nats/protocol", "nats/aio/client.py", "nats/aio/msg.py")),
    ("nats-py subscription", ("nats/aio/subscription.py",)),
    ("hookbus guards", ("nats_guard.py",)),
    (
        "dispatcher: calls and requester",
        ("_calls.py", "_call_router.py", "_chain_calls.py", "_registry_follow"),
    ),
    ("dispatcher: emit and fold", ("_emitter.py", "_fold", "_dispatcher.py", "fold_rules")),
    ("dispatcher service", ("_service.py", "_pending_quota", "_grants", "_audit")),
    ("worker serving", ("_worker.py", "serving.py", "_stalls", "_chain_progress")),
    ("tasks/event loop (asyncio, uvloop)", ("asyncio/", "uvloop", "selectors.py")),
    ("benchmark loop", ("profile_sides.py", "_raw.py")),
)
"""Layers of the self time: the first whose pattern is in a frame's file (or name) wins."""


# -- the agent process (this file with --agent) ------------------------------------------
async def agent(url: str, event: str, kb: int) -> None:
    """Run windows on commands read from stdin (``SIDE IN_FLIGHT SECONDS``); each writes
    ``go`` once its warm-up is over and then one JSON line: calls, failures, cpu_s, wall_s."""
    import nats

    sys.path.insert(0, str(HERE))
    import _workers as W
    from _raw import RawRequester

    from hookbus.dispatcher import HookDispatcher
    from hookbus.schemas import emit_service_subject

    nc = await nats.connect(url, name="bench-agent")
    d = HookDispatcher(nc)
    await d.start()
    await d.refresh()
    raw = await RawRequester(nc).start()
    data = W.big_data(kb * 1024) if kb else W.DATA
    raw_payload = W.raw_payload(data) if kb else W.RAW_PAYLOAD
    body = json.dumps({"data": data, "agent_id": AGENT_ID}).encode()
    service_subject = emit_service_subject(event, AGENT_ID)

    async def call_raw() -> bool:
        await raw.request(W.RAW_SUBJECT, raw_payload)
        return True

    async def call_emit() -> bool:
        result = await d.emit(event, data)
        return not result.failures

    async def call_service() -> bool:
        msg = await raw.request(service_subject, body)
        return b'"error"' not in msg.data

    calls = {"raw": call_raw, "emit": call_emit, "service": call_service}
    for call in calls.values():  # the routes, the service's first emit, the inboxes
        for _ in range(50):
            await call()
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        side, in_flight, seconds = line.split()
        out = await window(calls[side], int(in_flight), float(seconds))
        print(json.dumps(out), flush=True)
    await d.close()
    await nc.close()


async def window(call: Any, in_flight: int, seconds: float) -> dict[str, float]:
    counts = [0, 0]  # ok, failed

    async def drive(until: float, count: bool) -> None:
        clock = time.perf_counter
        while clock() < until:
            try:
                ok = await call()
            except Exception:
                ok = False
            if count:
                counts[0 if ok else 1] += 1

    async def run(duration: float, count: bool) -> None:
        until = time.perf_counter() + duration
        async with asyncio.TaskGroup() as tg:
            for _ in range(in_flight):
                tg.create_task(drive(until, count))

    await run(WARMUP_S, False)
    print("go", flush=True)
    cpu0, t0 = time.process_time(), time.perf_counter()
    await run(seconds, True)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return {"calls": counts[0], "failed": counts[1], "cpu_s": cpu, "wall_s": wall}


# -- the driver ------------------------------------------------------------------------
def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Tree:
    """One code tree's server and processes."""

    def __init__(
        self, label: str, root: Path, *, event: str = EVENT, kb: int = 0, worker: str = WORKER
    ) -> None:
        self.label, self.root = label, root
        self.event, self.kb, self.worker = event, kb, worker
        paths = [str(root / p) for p in PORTIONS if (root / p / "hookbus").is_dir()]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.server: Any = None

    def start(self, logs: Path, sides: Collection[str] = SIDES) -> None:
        """Start the tree's server, the raw responder, its worker, and the dispatcher service
        when `sides` measures it (an older tree's service may not take today's options)."""
        from hookbus.cli import EmbeddedNatsServer

        self.server = EmbeddedNatsServer()
        self.server.start()
        url = self.server.url
        py = sys.executable
        worker = self.worker
        cli = [py, "-m", "hookbus.cli", "--log-level", "info"]
        service = [*cli, "dispatcher", "--url", url, "--agent-max-in-flight", "0"]
        service += ["--agent-rate", "0", "--max-concurrency", "4096"]
        started = {
            "raw": ([py, str(HERE / "_workers.py"), "--url", url], "raw responder ready"),
            "worker": ([*cli, "worker", worker, "--url", url], "serving "),
            "service": (service, "serving "),
        }
        if "service" not in sides:
            del started["service"]
        for name, (argv, _) in started.items():
            self._spawn(name, argv, logs)
        for name, (_, ready) in started.items():
            self._wait(name, ready, logs)
        agent = [py, __file__, "--agent", url, "--event", self.event, "--kb", str(self.kb)]
        self._spawn("agent", agent, logs)
        agent = self.procs["agent"]
        assert agent.stdout is not None
        if agent.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{self.label}: the agent did not start (see {logs})")

    def _spawn(self, name: str, argv: list[str], logs: Path) -> None:
        pipe = subprocess.PIPE if name == "agent" else subprocess.DEVNULL
        with open(logs / f"{self.label}-{name}.log", "w") as log:
            self.procs[name] = subprocess.Popen(
                argv, cwd=ROOT, env=self.env, stdin=pipe, stdout=pipe, stderr=log, text=True
            )

    def _wait(self, name: str, ready: str, logs: Path, timeout_s: float = 60.0) -> None:
        path = logs / f"{self.label}-{name}.log"
        until = time.monotonic() + timeout_s
        while ready not in path.read_text():
            if self.procs[name].poll() is not None or time.monotonic() > until:
                raise RuntimeError(f"{self.label}: {name} did not start (see {path})")
            time.sleep(0.05)

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.procs.items()}
        out["nats-server"] = self.server._proc.pid
        return out

    def run(self, side: str, in_flight: int, seconds: float) -> dict[str, float]:
        agent = self.procs["agent"]
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write(f"{side} {in_flight} {seconds}\n")
        agent.stdin.flush()
        if agent.stdout.readline().strip() != "go":
            raise RuntimeError(f"{self.label}: the agent failed")
        pids = {k: v for k, v in self.pids().items() if k != "agent"}
        before = {k: proc_cpu_s(v) for k, v in pids.items()}
        got = json.loads(agent.stdout.readline())
        after = {k: proc_cpu_s(v) for k, v in pids.items()}
        calls = max(got["calls"], 1)
        out = {"rate": got["calls"] / got["wall_s"], "failed": got["failed"]}
        out["agent"] = got["cpu_s"] / calls * 1e6
        for k in pids:
            out[k] = (after[k] - before[k]) / calls * 1e6
        return out

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.server is not None:
            self.server.stop()


_LINE = re.compile(r":\d+\)$")


def layer_of(frame: str) -> str:
    for name, patterns in LAYERS:
        if any(p in frame for p in patterns):
            return name
    return "other"


def self_time(path: Path) -> tuple[collections.Counter[str], collections.Counter[str], int]:
    """Self samples of a py-spy ``--format raw`` file: per frame, per layer, and in all."""
    frames: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = _LINE.sub(")", stack.rpartition(";")[2])  # a function, not its lines
        n = int(count)
        frames[leaf] += n
        layers[layer_of(leaf)] += n
        total += n
    return frames, layers, total


def profile(trees: list[Tree], args: argparse.Namespace) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir = Path(args.profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    who = {"raw": ("agent",), "emit": ("agent", "worker"), "service": ("service", "worker")}
    for tree in trees:
        for side in args.sides.split(","):
            agent = tree.procs["agent"]
            assert agent.stdin is not None and agent.stdout is not None
            agent.stdin.write(f"{side} {args.in_flight} {args.seconds + 1.0}\n")
            agent.stdin.flush()
            if agent.stdout.readline().strip() != "go":
                raise RuntimeError("the agent failed")
            spies = []
            for proc in who[side]:
                path = out_dir / f"{tree.label}-{side}-{proc}.txt"
                argv = [spy, "record", "--pid", str(tree.pids()[proc]), "--format", "raw", "--gil"]
                argv += ["--rate", "500", "--duration", f"{args.seconds:.0f}", "-o", str(path)]
                spies.append((proc, path, subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                                           stderr=subprocess.DEVNULL)))  # fmt: skip
            pids = tree.pids()
            before = {p: proc_cpu_s(pids[p]) for p, _, _ in spies if p != "agent"}
            got = json.loads(agent.stdout.readline())
            after = {p: proc_cpu_s(pids[p]) for p in before}
            for _, _, sp in spies:
                sp.wait()
            calls = max(got["calls"], 1)
            print(f"\n[{tree.label}] side {side}: {got['calls'] / got['wall_s']:,.0f} calls/s")
            for proc, path, _ in spies:
                cpu_us = got["cpu_s"] if proc == "agent" else after[proc] - before[proc]
                cpu_us = cpu_us / calls * 1e6
                if not path.exists():
                    print(f"  {proc}: no profile (py-spy failed)")
                    continue
                frames, layers, total = self_time(path)
                print(f"  {proc}: {cpu_us:.1f} us CPU per decision; {total} samples -> {path}")
                for name, n in layers.most_common():
                    print(f"    {name:44} {n / total * cpu_us:6.1f} us  {n / total:5.1%}")
                print("    top self time:")
                for frame, n in frames.most_common(args.top):
                    print(f"      {n / total:5.1%}  {frame[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agent", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=2.0, help="per window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated")
    parser.add_argument("--profile", metavar="DIR", help="py-spy each side into DIR")
    parser.add_argument("--top", type=int, default=12, help="frames listed per profile")
    parser.add_argument("--kb", type=int, default=0, help="KB of event data (0: a tool:pre)")
    parser.add_argument("--event", help=f"the event emitted (default {EVENT}; --kb: bench:big)")
    parser.add_argument("--worker", default=WORKER, help=f"the worker (default {WORKER})")
    args = parser.parse_args()
    event = args.event or ("bench:big" if args.kb else EVENT)
    if args.agent:
        asyncio.run(agent(args.agent, event, args.kb))
        return
    options = {"event": event, "kb": args.kb, "worker": args.worker}
    trees = [Tree("new", ROOT, **options)] if not args.tree else []
    for spec in args.tree:
        label, _, path = spec.partition("=")
        trees.append(Tree(label, Path(path).resolve(), **options))
    sides = args.sides.split(",")
    results: dict[tuple[str, str], list[dict[str, float]]] = collections.defaultdict(list)
    try:
        logs = Path(tempfile.mkdtemp(prefix="hookbus-sides-"))
        print(f"process logs: {logs}", file=sys.stderr)
        for tree in trees:
            tree.start(logs, sides)
        for r in range(args.rounds):
            order = [(t, s) for t in trees for s in sides]
            k = r % len(order)
            for tree, side in order[k:] + order[:k]:
                results[(tree.label, side)].append(tree.run(side, args.in_flight, args.seconds))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        print(f"CPU per decision (us), {args.in_flight} in flight, median of {args.rounds}"
              f" rounds of {args.seconds} s per side and tree")  # fmt: skip
        cols = ["rate", "agent", "worker", "service", "raw", "nats-server", "failed"]
        print(f"{'tree':8} {'side':8} " + " ".join(f"{c:>11}" for c in cols))
        for (label, side), rows in results.items():
            med = {c: statistics.median(x[c] for x in rows) for c in cols if c in rows[0]}
            figures = (f"{med[c]:11.1f}" if c in med else f"{'-':>11}" for c in cols)
            print(f"{label:8} {side:8} " + " ".join(figures))
        if args.profile:
            profile(trees, args)
    finally:
        for tree in trees:
            tree.stop()


if __name__ == "__main__":
    main()
