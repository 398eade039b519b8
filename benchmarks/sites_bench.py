"""Sites benchmark: what a leaf hop costs, a client at a leaf against one at the hub, in the
same run.

    .venv/bin/python benchmarks/sites_bench.py            # about 12 s
    .venv/bin/python benchmarks/sites_bench.py --quick    # about 3 s, fewer samples

Starts, on 127.0.0.1, a hub nats-server (JetStream, domain ``hub``) and a leaf nats-server
(no JetStream) linked to it (the layout of docs/sites.md and tests/test_sites.py), and one
worker process at the hub (this file run with ``--serve``): a `HookWorker` with one
``tool:pre`` handler (deny for ``rm -rf``, else continue, failure policy deny) and a raw
nats-py responder with a HookReply-shaped answer.

Four sides, sequential calls, sampled in rotating rounds (A/B/C/D, B/C/D/A, ...) so drift
and noise hit each alike:

- (a) raw ``nc.request`` to the raw responder, from a client at the hub;
- (b) the same from a client at the leaf: the raw leaf hop;
- (c) ``HookDispatcher.emit("tool:pre")`` from the hub;
- (d) ``HookDispatcher(js_domain="hub").emit("tool:pre")`` from the leaf.

Prints p50 / p95 of each, the ratios (b)/(a) and (d)/(c), and what the hop adds (b - a,
d - c, at p50 and p95). A command, not a test: it asserts nothing and exits 0 (1 only if
the run itself failed: a server or the worker not ready, failed calls).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from _allow_worker import RAW_REPLY, serve_worker
from _measure import BenchAborted, Failures, Side, emit_outcome, latency_rounds, timed
from _procs import Proc
from nats.aio.client import Client as NATS

from hookbus.cli import find_nats_server
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import TOOL_PRE, HookResult
from hookbus.workers import HookWorker

SELF = Path(__file__).resolve()
DOMAIN = "hub"
HANDLER = "sites_guard"
RAW_SUBJECT = "bench.sites.raw"
READY = "sites bench worker ready"
LS = {"tool_name": "bash", "tool_input": {"command": "ls"}}
RM = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}


@dataclass(frozen=True)
class Settings:
    rounds: int
    per_round: int
    """Sequential calls per side per round."""
    warmup: int


DEFAULT = Settings(rounds=20, per_round=250, warmup=300)
QUICK = Settings(rounds=6, per_round=150, warmup=100)


# -- the worker process at the hub (this file run with --serve) --------------------------------
async def serve(url: str) -> None:
    nc = await nats.connect(url, name="sites-bench-worker")
    worker = HookWorker(nc, js_domain=DOMAIN, replace=True)

    @worker.handler(TOOL_PRE, name=HANDLER, failure_policy="deny", timeout_s=5.0)
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
            return HookResult(action="deny", reason="rm -rf is not allowed")
        return HookResult(action="continue")

    await serve_worker(nc, worker, raw_subject=RAW_SUBJECT, ready=READY)


# -- the servers --------------------------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait(check: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited: {log.read_text()[-2000:]}")
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what}: {log.read_text()[-2000:] if log.exists() else ''}")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def sites() -> Iterator[tuple[str, str]]:
    """A hub (JetStream, domain hub) and a leaf without JetStream: (hub url, leaf url)."""
    base = Path(tempfile.mkdtemp(prefix="hookbus-sites-bench-"))
    hub_port, leaf_port, link_port = _free_ports(3)
    configs = {
        "hub": f"""
server_name: hub
listen: 127.0.0.1:{hub_port}
jetstream {{ store_dir: "{base / "hub"}", domain: {DOMAIN} }}
leafnodes {{ listen: 127.0.0.1:{link_port} }}
""",
        "leaf": f"""
server_name: leaf
listen: 127.0.0.1:{leaf_port}
ping_interval: "1s"
ping_max: 2
leafnodes {{ remotes: [ {{ url: "nats-leaf://127.0.0.1:{link_port}" }} ] }}
""",
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, port in (("hub", hub_port), ("leaf", leaf_port)):
            conf, log = base / f"{name}.conf", base / f"{name}.log"
            conf.write_text(configs[name])
            proc = subprocess.Popen(
                [find_nats_server(), "-c", str(conf), "-l", str(log)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            procs.append(proc)
            _wait(lambda p=port: _listening(p), f"{name} did not listen", proc, log)
            if name == "leaf":
                _wait(
                    lambda log=log: log.exists() and "JetStream using domains" in log.read_text(),
                    "no leaf link",
                    proc,
                    log,
                )
        yield f"nats://127.0.0.1:{hub_port}", f"nats://127.0.0.1:{leaf_port}"
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


# -- the measurement ----------------------------------------------------------------------------
def raw_call(nc: NATS, failures: Failures) -> Any:
    payload = b"x" * 200

    async def call() -> bool | str:
        reply = await nc.request(RAW_SUBJECT, payload, timeout=5)
        return reply.data == RAW_REPLY or f"raw reply {reply.data[:80]!r}"

    return timed(call, failures)


def emit_call(d: HookDispatcher, failures: Failures) -> Any:
    async def call() -> bool | str:
        result = await d.emit(TOOL_PRE, LS)
        if result.action != "continue":
            return f"ls got {result.action} ({result.reason})"
        return emit_outcome(result)

    return timed(call, failures)


async def sanity(d: HookDispatcher, where: str) -> None:
    """The dispatcher at `where` sees the hub's handler, and it decides both ways."""
    if d.list_handlers(TOOL_PRE) != {TOOL_PRE: [HANDLER]}:
        raise RuntimeError(f"{where}: tool:pre handlers {d.list_handlers(TOOL_PRE)}")
    denied, allowed = await d.emit(TOOL_PRE, RM), await d.emit(TOOL_PRE, LS)
    if denied.action != "deny" or denied.decided_by != HANDLER or allowed.action != "continue":
        raise RuntimeError(f"{where}: rm -rf got {denied.action}, ls got {allowed.action}")


async def measure(settings: Settings) -> int:
    with sites() as (hub_url, leaf_url):
        worker = Proc(
            "worker at the hub",
            [sys.executable, str(SELF), "--serve", "--url", hub_url],
            READY,
        )
        await worker.start(timeout_s=30)
        try:
            hub_nc = await nats.connect(hub_url, name="sites-bench-hub-client")
            leaf_nc = await nats.connect(leaf_url, name="sites-bench-leaf-client")
            try:
                at_hub = HookDispatcher(hub_nc, agent_id="bench-hub", js_domain=DOMAIN)
                at_leaf = HookDispatcher(leaf_nc, agent_id="bench-leaf", js_domain=DOMAIN)
                async with at_hub, at_leaf:
                    await at_hub.refresh()
                    await at_leaf.refresh()
                    await sanity(at_hub, "hub")
                    await sanity(at_leaf, "leaf")
                    failures = Failures("sites")
                    n, w = settings.per_round, settings.warmup
                    sides = [
                        Side("(a) raw nc.request, client at the hub",
                             raw_call(hub_nc, failures), n, w),
                        Side("(b) raw nc.request, client at the leaf",
                             raw_call(leaf_nc, failures), n, w),
                        Side("(c) emit, dispatcher at the hub",
                             emit_call(at_hub, failures), n, w),
                        Side("(d) emit, dispatcher at the leaf (js_domain hub)",
                             emit_call(at_leaf, failures), n, w),
                    ]  # fmt: skip
                    await latency_rounds(sides, settings.rounds)
                    await sanity(at_leaf, "leaf")
            finally:
                await hub_nc.drain()
                await leaf_nc.drain()
        except BenchAborted as exc:
            raise RuntimeError(f"{exc}\n{worker.tail()}") from None
        finally:
            await worker.stop()
    report(sides, settings, failures)
    return 0


def report(sides: list[Side], settings: Settings, failures: Failures) -> None:
    a, b, c, d = sides
    print(
        f"hub (JetStream, domain {DOMAIN}) and leaf (no JetStream) on 127.0.0.1; worker at the"
        f" hub; {settings.rounds} rounds x {settings.per_round} sequential calls per side"
        f" ({settings.rounds * settings.per_round} each); failed calls: {failures.count}"
    )
    print(f"{'':52}{'p50':>10}{'p95':>10}")
    for side in sides:
        print(f"{side.name:52}{side.p(0.5) * 1e3:>7.3f} ms{side.p(0.95) * 1e3:>7.3f} ms")
    for label, hop, base in (("raw", b, a), ("emit", d, c)):
        print(
            f"{label + ' leaf hop':12} ratio p50 {hop.p(0.5) / base.p(0.5):.2f}x"
            f" p95 {hop.p(0.95) / base.p(0.95):.2f}x;"
            f" added p50 {(hop.p(0.5) - base.p(0.5)) * 1e3:+.3f} ms"
            f" p95 {(hop.p(0.95) - base.p(0.95)) * 1e3:+.3f} ms"
        )
    print(
        f"{'emit / raw':12} at the hub p50 {c.p(0.5) / a.p(0.5):.2f}x,"
        f" at the leaf p50 {d.p(0.5) / b.p(0.5):.2f}x"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.url))
        return 0
    try:
        return asyncio.run(measure(QUICK if args.quick else DEFAULT))
    except (RuntimeError, TimeoutError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
