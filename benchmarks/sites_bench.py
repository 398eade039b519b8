"""Sites benchmark: what a leaf hop, a route hop and a gateway hop cost, clients on either
side of each in the same run.

    .venv/bin/python benchmarks/sites_bench.py                          # both, about 35 s
    .venv/bin/python benchmarks/sites_bench.py --topology leaf          # about 12 s
    .venv/bin/python benchmarks/sites_bench.py --topology supercluster  # about 25 s
    .venv/bin/python benchmarks/sites_bench.py --quick                  # fewer samples

Each topology runs on 127.0.0.1 with one worker process (this file run with ``--serve``): a
`HookWorker` with one ``tool:pre`` handler (deny for ``rm -rf``, else continue, failure
policy deny) and a raw nats-py responder with a HookReply-shaped answer. Every client has
two sides, a raw ``nc.request`` to the raw responder and ``HookDispatcher.emit("tool:pre")``;
all sides are sequential calls sampled in rotating rounds (A/B/C/D, B/C/D/A, ...) so drift
and noise hit each alike.

``leaf``: a hub nats-server (JetStream, domain ``hub``) and a leaf nats-server (no
JetStream) linked to it (the layout of docs/sites.md and tests/test_sites.py), the worker at
the hub; clients at the hub and at the leaf (its dispatcher with ``js_domain="hub"``):

- (a) raw from the hub, (b) raw from the leaf, (c) emit from the hub, (d) emit from the leaf.

``supercluster``: tests/_supercluster.py's two clusters (east, west) of three nodes joined by
gateways, the buckets placed in east (``HOOKBUS_BUCKET_PLACEMENT_CLUSTER=east`` for the
worker that creates them; the stream's cluster is printed), the worker connected to one east
node only; clients on that node, on another east node (a route hop) and on a west node (the
gateway):

- (a)/(b)/(c) raw from the worker's node / the other east node / the west node, (d)/(e)/(f)
  emit from the same.

A server sends to the other cluster only over its own outbound gateway, which lands on a
node of that cluster it picked. The worker's node and the west node are chosen from
``/gatewayz`` so that each one's outbound gateway lands on the other when such a pair exists
(request and reply then cross the gateway and nothing else); otherwise the reply takes a
route hop in west as well. The run prints the path.

Prints p50 / p95 of each side, for each hop the ratio and what it adds (at p50 and p95) for
raw and for emit, and emit / raw per client. A command, not a test: it asserts nothing and
exits 0 (1 only if the run itself failed: a server or the worker not ready, failed calls).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from _allow_worker import RAW_REPLY, serve_worker
from _measure import BenchAborted, Failures, Rounds, Side, emit_outcome, latency_rounds, timed
from _procs import Proc
from nats.aio.client import Client as NATS

from hookbus._core.buckets import PLACEMENT_CLUSTER_ENV
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import TOOL_PRE, HookResult
from hookbus.workers import HookWorker

# the tests' sites and supercluster (appended: this folder's _procs / _fleet keep their names)
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from _sites import HUB_DOMAIN, hub_and_leaf
from _supercluster import EAST, WEST, Supercluster, stream_cluster

SELF = Path(__file__).resolve()
DOMAIN = HUB_DOMAIN
HANDLER = "sites_guard"
RAW_SUBJECT = "bench.sites.raw"
READY = "sites bench worker ready"
LS = {"tool_name": "bash", "tool_input": {"command": "ls"}}
RM = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}


DEFAULT = Rounds(rounds=20, per_round=250, warmup=300)
QUICK = Rounds(rounds=6, per_round=150, warmup=100)


# -- the worker process (this file run with --serve) --------------------------------
async def serve(url: str, domain: str | None) -> None:
    nc = await nats.connect(url, name="sites-bench-worker")
    worker = HookWorker(nc, js_domain=domain, replace=True)

    @worker.handler(TOOL_PRE, name=HANDLER, failure_policy="deny", timeout_s=5.0)
    async def guard(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
            return HookResult(action="deny", reason="rm -rf is not allowed")
        return HookResult(action="continue")

    await serve_worker(nc, worker, raw_subject=RAW_SUBJECT, ready=READY)


# -- the servers --------------------------------------------------------------------------------
@contextlib.contextmanager
def sites() -> Iterator[tuple[str, str]]:
    """A hub (JetStream, domain hub) and a leaf without JetStream: (hub url, leaf url)."""
    with tempfile.TemporaryDirectory() as tmp, hub_and_leaf(Path(tmp)) as ports:
        yield ports.hub_url, ports.leaf_url


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


@dataclass(frozen=True)
class Client:
    """One client: where it is (its sides' label), its server (one URL: one server), and
    what its emit side's label adds (how its dispatcher is made)."""

    where: str
    url: str
    emit_note: str = ""


async def measure_sides(
    worker_url: str, domain: str | None, clients: list[Client], settings: Rounds
) -> tuple[list[Side], Failures]:
    """The worker process on `worker_url`, then, for each of `clients`, a raw
    ``nc.request`` side and an `emit` side (raws first, then emits, in `clients`' order),
    sampled in rotating rounds."""
    argv = [sys.executable, str(SELF), "--serve", "--url", worker_url]
    worker = Proc("worker", argv + (["--js-domain", domain] if domain else []), READY)
    await worker.start(timeout_s=60)
    conns: list[NATS] = []
    try:
        async with contextlib.AsyncExitStack() as stack:
            dispatchers = []
            for k, c in enumerate(clients):
                nc = await nats.connect(c.url, name=f"sites-bench-client-{k}")
                conns.append(nc)
                d = HookDispatcher(nc, agent_id=f"bench-{k}", js_domain=domain)
                dispatchers.append(await stack.enter_async_context(d))
            for c, d in zip(clients, dispatchers, strict=True):
                await d.refresh()
                await sanity(d, c.where)
            failures = Failures("sites")
            n, w = settings.per_round, settings.warmup
            letters = iter("abcdefghij")
            sides = [
                Side(f"({next(letters)}) raw nc.request, client {c.where}",
                     raw_call(nc, failures), n, w)
                for c, nc in zip(clients, conns, strict=True)
            ] + [
                Side(f"({next(letters)}) emit, dispatcher {c.where}{c.emit_note}",
                     emit_call(d, failures), n, w)
                for c, d in zip(clients, dispatchers, strict=True)
            ]  # fmt: skip
            await latency_rounds(sides, settings.rounds)
            for c, d in zip(clients, dispatchers, strict=True):
                await sanity(d, c.where)
    except BenchAborted as exc:
        raise RuntimeError(f"{exc}\n{worker.tail()}") from None
    finally:
        for nc in conns:
            with contextlib.suppress(Exception):
                await nc.drain()
        await worker.stop()
    return sides, failures


async def measure_leaf(settings: Rounds) -> None:
    with sites() as (hub_url, leaf_url):
        sides, failures = await measure_sides(
            hub_url,
            DOMAIN,
            [
                Client("at the hub", hub_url),
                Client("at the leaf", leaf_url, f" (js_domain {DOMAIN})"),
            ],
            settings,
        )
    print(
        f"hub (JetStream, domain {DOMAIN}) and leaf (no JetStream) on 127.0.0.1; worker at the"
        f" hub; {settings.rounds} rounds x {settings.per_round} sequential calls per side"
        f" ({settings.rounds * settings.per_round} each); failed calls: {failures.count}"
    )
    report(sides, [("leaf hop", 1, 0)])


def _gateway_peer(sc: Supercluster, node: str) -> str:
    """The server `node`'s outbound gateway (to the other cluster) lands on (``/gatewayz``).

    A server sends to another cluster only over its own outbound gateway connection."""
    other = WEST if sc.node(node).cluster == EAST else EAST
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        conn = sc.node(node).http_json("/gatewayz")["outbound_gateways"][other]["connection"]
        for n in sc.nodes:
            if n.gateway_port == int(conn["port"]):
                return n.name
    raise RuntimeError(f"{node}: no outbound gateway to {other} in /gatewayz")


def _gateway_pair(sc: Supercluster) -> tuple[str, str, str]:
    """(east node for the worker, west node for the client, the path in words): a pair whose
    outbound gateways land on each other when there is one (request and reply cross the
    gateway only), else the west node's peer (the reply takes a route hop in west too)."""
    peer = {n.name: _gateway_peer(sc, n.name) for n in sc.nodes}
    for w in (n.name for n in sc.cluster_nodes(WEST)):
        if peer[peer[w]] == w:
            return peer[w], w, f"request {w} -> {peer[w]} and reply: each one gateway hop"
    w = sc.cluster_nodes(WEST)[0].name
    e = peer[w]
    return (
        e,
        w,
        f"request {w} -> {e}: one gateway hop; reply {e} -> {peer[e]} -> {w}: gateway, route",
    )


async def measure_supercluster(settings: Rounds) -> None:
    """The route and gateway hops: the worker on an east node, clients on the same node,
    on another east node (a route hop) and on a west node (the gateway), buckets in east."""
    os.environ[PLACEMENT_CLUSTER_ENV] = EAST  # the worker process inherits it
    with Supercluster() as sc:
        await sc.wait_ready()
        east, west, path = _gateway_pair(sc)
        other = next(n.name for n in sc.cluster_nodes(EAST) if n.name != east)
        sides, failures = await measure_sides(
            sc.node(east).url,
            None,
            [
                Client(f"in east, same server as the worker ({east})", sc.node(east).url),
                Client(f"in east, another server ({other}: route)", sc.node(other).url),
                Client(f"in west ({west}: gateway)", sc.node(west).url),
            ],
            settings,
        )
        nc = await nats.connect(sc.node(east).url)
        try:
            buckets = await stream_cluster(nc, "KV_hookbus_handlers")
        finally:
            await nc.close()
    print(
        f"supercluster on 127.0.0.1 (east, west: 3 nodes each, gateways); worker on {east};"
        f" buckets in {buckets}; {path}; {settings.rounds} rounds x {settings.per_round}"
        f" sequential calls per side ({settings.rounds * settings.per_round} each);"
        f" failed calls: {failures.count}"
    )
    report(sides, [("route hop", 1, 0), ("gateway hop", 2, 0), ("gw vs route", 2, 1)])


def report(sides: list[Side], hops: list[tuple[str, int, int]]) -> None:
    """The table, then each hop (label, client index, base client index) for raw and emit,
    then emit / raw per client."""
    k = len(sides) // 2
    width = max(len(s.name) for s in sides) + 2
    print(f"{'':{width}}{'p50':>10}{'p95':>10}")
    for side in sides:
        print(f"{side.name:{width}}{side.p(0.5) * 1e3:>7.3f} ms{side.p(0.95) * 1e3:>7.3f} ms")
    for label, i, j in hops:
        for kind, off in (("raw", 0), ("emit", k)):
            hop, base = sides[off + i], sides[off + j]
            print(
                f"{kind + ' ' + label:17}"
                f" ({hop.name[1]})/({base.name[1]}) ratio p50 {hop.p(0.5) / base.p(0.5):.2f}x"
                f" p95 {hop.p(0.95) / base.p(0.95):.2f}x;"
                f" added p50 {(hop.p(0.5) - base.p(0.5)) * 1e3:+.3f} ms"
                f" p95 {(hop.p(0.95) - base.p(0.95)) * 1e3:+.3f} ms"
            )
    print(
        "emit / raw p50: "
        + ", ".join(
            f"({sides[k + i].name[1]})/({sides[i].name[1]}) "
            f"{sides[k + i].p(0.5) / sides[i].p(0.5):.2f}x"
            for i in range(k)
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument(
        "--topology",
        choices=("leaf", "supercluster", "both"),
        default="both",
        help="the leaf hop, the route and gateway hops of a supercluster, or both (default)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--js-domain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.url, args.js_domain))
        return 0
    settings = QUICK if args.quick else DEFAULT
    runs = {"leaf": [measure_leaf], "supercluster": [measure_supercluster]}.get(
        args.topology, [measure_leaf, measure_supercluster]
    )
    try:
        for k, run in enumerate(runs):
            if k:
                print()
            asyncio.run(run(settings))
    except (RuntimeError, TimeoutError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
