"""hookbus fleet-scale benchmark: how many agents one nats-server (default limits) takes.

    python benchmarks/fleet_scale.py --agents 1000,5000,10000 --shapes embedded,thin \\
        --modes open,secured --procs 10 [--json FILE]

For each mode (``open``: no auth; ``secured``: ``hookbus auth init`` identities with TLS,
every agent of a shape one identity) a fresh nats-server runs with its default limits and
a monitoring port; one worker serves ``fleet:guard`` (deny ``rm -rf``, else continue), and
for thin agents one ``hookbus dispatcher`` service decides. For each shape and size N,
N agents start in ``--procs`` processes (`_fleet_scale_host.py`, one NATS connection per
agent) and then:

1. every agent emits ``rm -rf /`` (must be denied) and ``ls`` (must continue);
2. a registry change: a fail-closed handler is declared for a fresh event (nobody serves
   it, so every emit of that event must be denied); the time until every embedded agent
   routes it (thin agents: until the service denies it) is measured from just before the
   write; then every agent emits that event once (must be denied).

Printed per row: agents started (and failed, with the first error), server memory (RSS
from ``/varz``) and subscriptions per agent (after start, and after the first emits: a
thin agent's reply subscription comes with its first request), JetStream API calls per
agent start (``/jsz``), fleet start seconds, emit p50 / p99 (ms; every agent emitting at
once, at most 100 in flight per process), the change's reach (p50 / max, ms; and "first
reach": the latest of each agent process's first agent to route it, i.e. the server's
fan-out without the queue of a process's other agents on the same cores), emits
refused by the service (its per-agent rate limit, or a replica at its concurrency bound:
the agent is told to send it again; on an open server every thin agent has an agent id
of its own, secured all act as the one ``thin`` identity's), and wrong decisions (must
be 0). Ratios compare each embedded row with the thin row of the same size taken in the
same run (these machines are noisy; the thin shape is the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from _procs import JsonChild, Proc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _ports import free_port

from hookbus.cli import EmbeddedNatsServer
from hookbus.schemas import (
    HandlerDeclaration,
    collect_subject,
    encode,
    encode_token,
    handler_key,
    handler_subject,
)

HERE = Path(__file__).resolve().parent
GUARD_EVENT = "fleet:guard"
WORKER_SOURCE = f"""
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler({GUARD_EVENT!r}, name="guard", failure_policy="deny", timeout_s=10.0)
async def guard(event, data):
    command = str((data.get("tool_input") or {{}}).get("command", ""))
    if "rm -rf" in command:
        return HookResult(action="deny", reason="destructive")
    return HookResult(action="continue")
"""


def monitor(http: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/{path}", timeout=30) as r:
        return json.loads(r.read())


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Site:
    """One nats-server (open or secured) with a monitoring port, the guard worker and a
    dispatcher service."""

    def __init__(self, mode: str, root: Path) -> None:
        self.mode = mode
        self.root = root
        self.http = free_port()
        self.server: EmbeddedNatsServer | None = None
        self.procs: list[Proc] = []
        self.url = ""

    def identity(self, stem: str) -> list[str]:
        """CLI connection options for identity `stem` (``role-name``); none when open."""
        if self.mode == "open":
            return []
        return ["--context", str(self.root / "auth" / f"{stem}.json")]

    def host_options(self, stem: str) -> list[str]:
        if self.mode == "open":
            return []
        ctx = json.loads((self.root / "auth" / f"{stem}.json").read_text())
        return ["--nkey", ctx["nkey"], "--inbox-prefix", ctx["inbox_prefix"], "--ca", ctx["ca"]]

    def _cli(self, *args: str) -> None:
        subprocess.run([sys.executable, "-m", "hookbus.cli", *args], check=True,
                       capture_output=True, text=True)  # fmt: skip

    async def start(self) -> None:
        port = free_port()
        config = self.root / "bench.conf"
        if self.mode == "open":
            config.write_text(
                f"listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{self.http}\n"
                f'jetstream {{ store_dir: "{self.root / "js"}" }}\n'
            )
        else:
            self._cli("auth", "init", "--out", str(self.root / "auth"), "--port", str(port),
                      "--embedded-agent", "fleet", "--agent", "thin",
                      "--worker", f"guardw:{GUARD_EVENT}/guard")  # fmt: skip
            config = self.root / "auth" / "bench.conf"
            config.write_text(f'include "server.conf"\nhttp: 127.0.0.1:{self.http}\n')
        self.server = EmbeddedNatsServer(self.root / "srv", config=config)
        self.url = self.server.start()
        if self.mode == "secured":
            self._cli("auth", "provision", "--dir", str(self.root / "auth"))
        worker_file = self.root / "fleet_worker.py"
        worker_file.write_text(WORKER_SOURCE)
        cli = [sys.executable, "-m", "hookbus.cli", "--log-level", "info"]
        worker = Proc("guard worker", [*cli, "worker", f"{worker_file}:worker", "--url",
                      self.url, *self.identity("worker-guardw")], "serving ")  # fmt: skip
        service = Proc("dispatcher service", [*cli, "dispatcher", "--url", self.url,
                       *self.identity("dispatcher-dispatcher")], "dispatcher serving")  # fmt: skip
        for proc in (worker, service):
            await proc.start(timeout_s=120)
            self.procs.append(proc)

    async def declare(self, event: str) -> float:
        """Declare a fail-closed handler nobody serves for `event`, as the admin; returns
        the wall-clock time just before the write."""
        import nats

        from hookbus.dispatcher._registry_watch import open_handlers_bucket

        options: dict[str, Any] = {}
        if self.mode == "secured":
            import ssl

            ctx = json.loads((self.root / "auth" / "admin-admin.json").read_text())
            options = {"nkeys_seed": ctx["nkey"], "inbox_prefix": ctx["inbox_prefix"],
                       "tls": ssl.create_default_context(cafile=ctx["ca"])}  # fmt: skip
        nc = await nats.connect(self.url, **options)
        try:
            kv = await open_handlers_bucket(nc)
            decl = HandlerDeclaration(
                event=event, name="killswitch", subject=handler_subject(event, "killswitch"),
                collect_subject=collect_subject(event), queue_group=encode_token("killswitch"),
                failure_policy="deny", timeout_s=2.0,
            )  # fmt: skip
            began = time.time()
            await kv.put(handler_key(event, "killswitch"), encode(decl))
            return began
        finally:
            await nc.close()

    async def stop(self) -> None:
        for proc in self.procs:
            await proc.stop()
        if self.server is not None:
            self.server.stop()


async def one_row(
    site: Site, shape: str, n: int, procs: int, loop: str = "asyncio"
) -> dict[str, Any]:
    stem = "agent-fleet" if shape == "embedded" else "agent-thin"
    agent_id = "fleet" if shape == "embedded" else "thin"
    per = [n // procs + (1 if i < n % procs else 0) for i in range(procs)]
    hosts = [
        JsonChild(
            f"{shape} host {i}",
            [
                sys.executable,
                str(HERE / "_fleet_scale_host.py"),
                "--url",
                site.url,
                "--count",
                str(count),
                "--shape",
                shape,
                "--agent-id",
                agent_id,
                "--first",
                str(i),
                "--loop",
                loop,
                *(["--distinct-ids"] if site.mode == "open" else []),
                *site.host_options(stem),
            ],
        )
        for i, count in enumerate(per)
        if count
    ]
    row: dict[str, Any] = {"mode": site.mode, "shape": shape, "agents": n, "loop": loop}
    try:
        await asyncio.gather(*(h.start(timeout_s=60) for h in hosts))
        before, js_before = monitor(site.http, "varz"), monitor(site.http, "jsz")
        began = time.monotonic()
        started = await asyncio.gather(*(h.ask({"op": "start"}) for h in hosts))
        row["start_s"] = time.monotonic() - began
        await asyncio.sleep(1.0)
        after, js_after = monitor(site.http, "varz"), monitor(site.http, "jsz")
        ok = sum(s["ok"] for s in started)
        row["started"] = ok
        row["failed"] = sum(s["failed"] for s in started)
        row["first_error"] = next((s["first_error"] for s in started if s["first_error"]), "")
        row["client_rss_mb_per_agent"] = sum(s["rss_mb"] for s in started) / max(ok, 1)
        row["server_rss_mb"] = after["mem"] / 2**20
        row["server_kb_per_agent"] = (after["mem"] - before["mem"]) / 1024 / max(ok, 1)
        row["subs_per_agent"] = (after["subscriptions"] - before["subscriptions"]) / max(ok, 1)
        row["connections"] = after["connections"]
        calls = js_after["api"]["total"] - js_before["api"]["total"]
        row["js_api_per_start"] = calls / max(ok, 1)
        row["consumers"] = js_after.get("consumers", 0)
        cases = [["rm -rf /", "deny"], ["ls", "continue"]]
        emits = await asyncio.gather(
            *(h.ask({"op": "emit", "event": GUARD_EVENT, "cases": cases}) for h in hosts)
        )
        row["subs_per_agent_after_emit"] = (
            monitor(site.http, "varz")["subscriptions"] - before["subscriptions"]
        ) / max(ok, 1)
        row["refused"] = sum(e["refused"] for e in emits)
        latencies = [x for e in emits for x in e["latencies_ms"]]
        row["p50_ms"], row["p99_ms"] = pct(latencies, 0.5), pct(latencies, 0.99)
        wrong = sum(e["wrong"] + e["errors"] for e in emits)
        first = next((e["first"] for e in emits if e["first"]), "")
        # the registry change
        change = f"fleet:change-{uuid.uuid4().hex[:8]}"
        no_handler = "continue" if shape == "embedded" else "unknown_event"  # service: strict
        before_change = await asyncio.gather(
            *(h.ask({"op": "emit", "event": change, "cases": [["x", no_handler]]}) for h in hosts)
        )
        wrong += sum(e["wrong"] + e["errors"] for e in before_change)
        first = first or next((e["first"] for e in before_change if e["first"]), "")
        if shape == "embedded":
            watches = [asyncio.ensure_future(h.ask({"op": "watch", "event": change,
                       "timeout_s": 30.0})) for h in hosts]  # fmt: skip
            await asyncio.sleep(0.2)  # the watches are polling
            t0 = await site.declare(change)
            seen = await asyncio.gather(*watches)
            reach = [(t - t0) * 1000 for s in seen for t in s["times"]]
            # the latest of each process's first agent: the server's fan-out and a wake-up,
            # without the queue of a process's other agents on the same cores
            firsts = [(min(s["times"]) - t0) * 1000 for s in seen if s["times"]]
            row["reach_first_max_ms"] = max(firsts or [float("nan")])
            row["missing"] = sum(s["missing"] for s in seen)
        else:
            t0 = await site.declare(change)
            reach = [await _service_reach(hosts[0], change, t0)]
            row["reach_first_max_ms"] = reach[0]
            row["missing"] = 0
        row["reach_p50_ms"], row["reach_max_ms"] = pct(reach, 0.5), max(reach or [float("nan")])
        after_change = await asyncio.gather(
            *(h.ask({"op": "emit", "event": change, "cases": [["x", "deny"]]}) for h in hosts)
        )
        wrong += sum(e["wrong"] + e["errors"] for e in after_change)
        row["refused"] += sum(e["refused"] for e in [*before_change, *after_change])
        first = first or next((e["first"] for e in after_change if e["first"]), "")
        row["wrong"] = wrong + row["missing"] + row["failed"]
        row["first_wrong"] = first
    finally:
        for h in hosts:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(h.ask({"op": "stop"}), 120)
            await h.stop()
    return row


async def _service_reach(host: JsonChild, event: str, t0: float) -> float:
    """Milliseconds from `t0` until the dispatcher service denies `event` (thin agents)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = await host.ask(
            {"op": "emit", "event": event, "cases": [["x", "deny"]], "limit": 1}
        )
        decided = answer["latencies_ms"]  # refused emits decided nothing
        if decided and answer["wrong"] == 0 and answer["errors"] == 0:
            return (time.time() - t0) * 1000
        await asyncio.sleep(0.01)
    return float("nan")


def table(rows: list[dict[str, Any]]) -> str:
    head = ("mode", "shape", "loop", "agents", "started", "server MB", "KB/agent", "subs/agent",
            "JS API/start", "consumers", "start s", "p50 ms", "p99 ms", "reach p50 ms",
            "reach max ms", "first reach ms", "refused", "wrong")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            where = f"| {r['mode']} | {r['shape']} | {r.get('loop', '')} | {r['agents']}"
            lines.append(f"{where} | {r['error']} |")
            continue
        cells = (r["mode"], r["shape"], r.get("loop", "asyncio"), r["agents"],
                 f"{r['started']} ({r['failed']} failed)",
                 f"{r['server_rss_mb']:.0f}", f"{r['server_kb_per_agent']:.1f}",
                 f"{r['subs_per_agent']:.1f} ({r['subs_per_agent_after_emit']:.1f})",
                 f"{r['js_api_per_start']:.1f}", r["consumers"],
                 f"{r['start_s']:.1f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                 f"{r['reach_p50_ms']:.0f}", f"{r['reach_max_ms']:.0f}",
                 f"{r.get('reach_first_max_ms', float('nan')):.0f}", r["refused"],
                 r["wrong"])  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["shape"] != "embedded" or "error" in r:
            continue
        base = next((t for t in rows if t["shape"] == "thin" and t["mode"] == r["mode"]
                     and t["agents"] == r["agents"] and "error" not in t), None)  # fmt: skip
        if base is None:
            continue
        memory = (
            f"{r['server_rss_mb'] / base['server_rss_mb']:.2f}"
            if base["server_rss_mb"] > 0
            else "n/a"
        )
        out.append(
            f"{r['mode']} {r['agents']}: embedded / thin (same run): server memory {memory},"
            f" p99 {r['p99_ms'] / base['p99_ms']:.2f}, start {r['start_s'] / base['start_s']:.2f}"
        )
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", default="1000,5000,10000")
    p.add_argument("--shapes", default="embedded,thin")
    p.add_argument("--modes", default="open,secured")
    p.add_argument("--procs", type=int, default=10, help="agent processes per row")
    p.add_argument("--json", help="also write the rows as JSON")
    p.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="the agents' event loop (an embedded agent runs on its host application's)",
    )
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="hookbus-fleet-") as tmp:
            site = Site(mode, Path(tmp))
            try:
                await site.start()
                for n in (int(x) for x in args.agents.split(",")):
                    for shape in args.shapes.split(","):
                        print(f"{mode} {shape} {n} ...", file=sys.stderr, flush=True)
                        try:
                            row = await one_row(site, shape, n, args.procs, args.loop)
                        except Exception as exc:
                            row = {"mode": mode, "shape": shape, "agents": n,
                                   "error": f"{type(exc).__name__}: {exc}"[:300]}  # fmt: skip
                        print(json.dumps(row), file=sys.stderr, flush=True)
                        rows.append(row)
            finally:
                await site.stop()
    print(table(rows))
    for line in ratios(rows):
        print(line)
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(rows, indent=2))
    if any(r.get("wrong") or "error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    asyncio.run(main())
