"""nats-py against nats-core (the NATS maintainers' lean client, ``nats.client``, Python
3.13+) on hookbus's request/reply shape: sequential round trips, CPU per request on each
side, requests per second at 256 in flight. A command, not a test.

    python3.13 benchmarks/nats_clients.py                 # 3 rounds, about 1.5 minutes
    python3.13 benchmarks/nats_clients.py --rounds 6 --seconds 3   # about 2.5 minutes

Processes: one nats-server (`EmbeddedNatsServer`, the bundled binary), and per side a
responder and a requester process of its own (`--role`), driven over stdin / stdout (one
JSON object per line). Sides:

- ``nats-py``: the baseline, hookbus's own shape (`_call_router`): the requester publishes
  with a reply subject on one long-lived wildcard inbox and resolves a future from the
  inbox subscription's callback; the responder replies inline in its callback
  (``await nc.publish(msg.reply, REPLY)``).
- ``nats-py request()``: nats-py's own ``request`` (a NUID token, ``asyncio.wait_for``),
  against the same responder: what a comparison with plain nats-py code measures.
- ``nats-core``: ``Client.request`` (one multiplexed inbox, a counter token: the same shape);
  the responder iterates its subscription and replies with ``publish``.
- ``nats-core flush 0``: the same with the client's private minimum interval between two
  flushes (``_min_flush_interval``, 5 ms) set to 0 on both sides: what that pacing costs.

Each request carries `PAYLOAD_BYTES` of payload and one trace header; the reply is `REPLY`.
Per round, each side in turn (the order rotates each round) runs: `--sequential` requests
one after the other (p50, and the CPU per request of both processes, ``time.process_time``
read in each process), `--spaced` requests each after 10 ms idle (a lone request), as
many each after 2 ms idle (a steady trickle of about 400/s), then a `--seconds` window
with `--in-flight` requests outstanding (requests/s, CPU per request). Figures are medians
over the rounds; a ratio is the median [range] of each round's figure over nats-py's in
the same round: the machine is shared, so read the ratios, not the absolute numbers.

If nats-core is not importable it prints one line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

SUBJECT = "bench.clients"
PAYLOAD_BYTES = 300
PAYLOAD = b'{"event":"tool:pre","data":"' + b"x" * (PAYLOAD_BYTES - 30) + b'"}'
HEADERS = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
REPLY = b'{"handler":"raw","result":{"action":"continue"}}'
"""What a hookbus worker answers for a handler that returns None (49 bytes)."""
LONE_GAP_S = 0.010
"""Idle time before each lone request: longer than nats-core's 5 ms flush pacing."""
STEADY_GAP_S = 0.002
"""Idle time before each request of the steady trickle (about 400 requests/s): shorter
than that pacing, as the requests a worker answers under a moderate load."""
THIS_FILE = str(Path(__file__).resolve())
SIDES = ("nats-py", "nats-py request()", "nats-core", "nats-core flush 0")


def _nats_core_missing() -> str | None:
    if sys.version_info < (3, 13):
        return f"nats-core needs Python 3.13+ (this is {sys.version.split()[0]})"
    try:
        if importlib.util.find_spec("nats.client") is None:
            return "nats-core is not installed (no module nats.client)"
    except ImportError as exc:
        return f"nats-core is not importable: {exc}"
    return None


# -- the clients, behind one small shape --------------------------------------------------
class _PyClient:
    """nats-py: publish with a reply subject on one wildcard inbox, a future per request;
    or (`plain`) nats-py's own ``request``."""

    def __init__(self, subject: str, plain: bool = False) -> None:
        self.subject = subject
        if plain:
            self.request = self._plain_request

    async def connect(self, url: str) -> None:
        import nats

        self.nc = await nats.connect(url, allow_reconnect=False)
        self.waiting: dict[str, asyncio.Future[Any]] = {}
        self.prefix = self.nc.new_inbox() + "."
        self.n = 0
        cut = len(self.prefix)
        waiting = self.waiting

        async def on_reply(msg: Any) -> None:
            fut = waiting.pop(msg.subject[cut:], None)
            if fut is not None and not fut.done():
                fut.set_result(msg.data)

        await self.nc.subscribe(self.prefix + "*", cb=on_reply)
        await self.nc.flush()

    async def request(self) -> bytes:
        self.n += 1
        token = str(self.n)
        fut = asyncio.get_running_loop().create_future()
        self.waiting[token] = fut
        try:
            await self.nc.publish(self.subject, PAYLOAD, reply=self.prefix + token, headers=HEADERS)
            return await asyncio.wait_for(fut, 5.0)
        finally:
            self.waiting.pop(token, None)

    async def _plain_request(self) -> bytes:
        msg = await self.nc.request(self.subject, PAYLOAD, timeout=5.0, headers=HEADERS)
        return msg.data

    async def serve(self) -> None:
        nc = self.nc

        async def on_request(msg: Any) -> None:
            await nc.publish(msg.reply, REPLY)

        await nc.subscribe(self.subject, queue="q", cb=on_request)
        await nc.flush()

    async def close(self) -> None:
        await self.nc.close()


class _CoreClient:
    """nats-core: ``Client.request``; the responder iterates its subscription."""

    def __init__(self, subject: str, min_flush_interval: float | None) -> None:
        self.subject = subject
        self.min_flush_interval = min_flush_interval
        self.task: asyncio.Task[None] | None = None

    async def connect(self, url: str) -> None:
        from nats.client import connect

        self.nc = await connect(url, allow_reconnect=False)
        if self.min_flush_interval is not None:
            self.nc._min_flush_interval = self.min_flush_interval  # private: no public knob

    async def request(self) -> bytes:
        msg = await self.nc.request(self.subject, PAYLOAD, timeout=5.0, headers=HEADERS)
        return msg.data

    async def serve(self) -> None:
        nc = self.nc
        sub = await nc.subscribe(self.subject, queue="q")

        async def loop() -> None:
            async for msg in sub:
                await nc.publish(msg.reply, REPLY)

        self.task = asyncio.create_task(loop())
        await nc.flush()

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.nc.close()


def _client(side: str) -> Any:
    """The client of `side`, on a subject of its own."""
    subject = f"{SUBJECT}.{SIDES.index(side)}"
    if side.startswith("nats-py"):
        return _PyClient(subject, plain=side != "nats-py")
    return _CoreClient(subject, 0.0 if side.endswith("flush 0") else None)


# -- the child processes ----------------------------------------------------------------------
async def _sequential(request: Callable[[], Awaitable[bytes]], n: int, gap: float) -> dict:
    samples: list[float] = []
    clock = time.perf_counter
    c0 = time.process_time()
    for _ in range(n):
        if gap:
            await asyncio.sleep(gap)
        t0 = clock()
        await request()
        samples.append(clock() - t0)
    return {"samples": samples, "cpu_s": time.process_time() - c0, "calls": n}


async def _window(request: Callable[[], Awaitable[bytes]], in_flight: int, seconds: float) -> dict:
    calls = 0
    counting = False

    async def drive(until: float) -> None:
        nonlocal calls
        while time.perf_counter() < until:
            await request()
            calls += counting

    t = time.perf_counter()
    await asyncio.gather(*(drive(t + 0.3) for _ in range(in_flight)))  # warm-up
    counting = True
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(drive(t0 + seconds) for _ in range(in_flight)))
    elapsed = time.perf_counter() - t0
    return {"calls": calls, "elapsed_s": elapsed, "cpu_s": time.process_time() - c0}


async def _child(role: str, side: str, url: str) -> None:
    """One responder or requester: a JSON hello, then one answer per JSON line on stdin."""
    client = _client(side)
    await client.connect(url)
    if role == "responder":
        await client.serve()
    print(json.dumps({"ready": side}), flush=True)
    # stdin is read in a thread: asked between measurements only, never during one
    while line := await asyncio.to_thread(sys.stdin.readline):
        ask = json.loads(line)
        if ask["op"] == "cpu":
            answer: dict = {"cpu_s": time.process_time()}
        elif ask["op"] == "sequential":
            answer = await _sequential(client.request, ask["n"], ask["gap_s"])
        else:
            answer = await _window(client.request, ask["in_flight"], ask["seconds"])
        print(json.dumps(answer), flush=True)
    await client.close()


# -- the run ----------------------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


async def _measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    from _procs import JsonChild, running

    from hookbus.cli import EmbeddedNatsServer

    server = EmbeddedNatsServer()
    url = server.start()
    me = [sys.executable, THIS_FILE, "--url", url]
    pairs = {
        side: (
            JsonChild(f"{side} responder", [*me, "--role", "responder", "--side", side]),
            JsonChild(f"{side} requester", [*me, "--role", "requester", "--side", side]),
        )
        for side in SIDES
    }
    figures: dict[str, dict[str, list[float]]] = {s: {} for s in SIDES}
    try:
        async with running([p for pair in pairs.values() for p in pair]):
            for r in range(args.rounds):
                for j in range(len(SIDES)):
                    side = SIDES[(j + r) % len(SIDES)]
                    responder, requester = pairs[side]
                    out = figures[side]
                    for name, ask in (
                        ("seq", {"op": "sequential", "n": args.sequential, "gap_s": 0.0}),
                        ("lone", {"op": "sequential", "n": args.spaced, "gap_s": LONE_GAP_S}),
                        ("steady", {"op": "sequential", "n": args.spaced, "gap_s": STEADY_GAP_S}),
                        (
                            "tput",
                            {"op": "window", "in_flight": args.in_flight, "seconds": args.seconds},
                        ),
                    ):
                        before = (await responder.ask({"op": "cpu"}))["cpu_s"]
                        got = await requester.ask(ask)
                        served = (await responder.ask({"op": "cpu"}))["cpu_s"] - before
                        per = 1e6 / got["calls"]
                        if name == "tput":
                            out.setdefault("rps", []).append(got["calls"] / got["elapsed_s"])
                        else:
                            out.setdefault(f"{name}_p50_us", []).append(
                                _median(got["samples"]) * 1e6
                            )
                        out.setdefault(f"{name}_req_cpu_us", []).append(got["cpu_s"] * per)
                        out.setdefault(f"{name}_resp_cpu_us", []).append(served * per)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return figures


ROWS = (
    ("sequential round trip p50, us", "seq_p50_us"),
    ("  requester CPU per request, us", "seq_req_cpu_us"),
    ("  responder CPU per request, us", "seq_resp_cpu_us"),
    ("lone request (10 ms idle before) p50, us", "lone_p50_us"),
    ("steady trickle (2 ms idle before) p50, us", "steady_p50_us"),
    ("requests/s, N in flight", "rps"),
    ("  requester CPU per request, us", "tput_req_cpu_us"),
    ("  responder CPU per request, us", "tput_resp_cpu_us"),
)


def _report(figures: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> None:
    """One row per figure: nats-py's median over the rounds, and per other side its median
    and the median [range] of its per-round ratios to nats-py (same round, side by side)."""
    base = figures["nats-py"]
    print(
        f"\n{args.rounds} rounds; per side and round {args.sequential} back-to-back requests,"
        f" {args.spaced} lone, {args.spaced} steady, {args.seconds:g} s at {args.in_flight}"
        f" in flight; {PAYLOAD_BYTES} B payload + 1 header; Python {sys.version.split()[0]};"
        f" load average before/after: {args.load_before} / {os.getloadavg()[0]:.2f}"
    )
    width = 42
    head = f"{'nats-py':>9}" + "".join(f"{s:>31}" for s in SIDES[1:])
    print(f"{'median over rounds; ratio: median [range]':<{width}}{head}")
    for label, key in ROWS:
        cells = f"{_median(base[key]):>9,.0f}"
        for side in SIDES[1:]:
            ratios = [v / b for v, b in zip(figures[side][key], base[key], strict=True)]
            cells += (
                f"{_median(figures[side][key]):>10,.0f} {_median(ratios):5.2f}x"
                f" [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
        print(f"{label.replace('N', str(args.in_flight)):<{width}}{cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sequential", type=int, default=1000, help="per side and round")
    parser.add_argument("--spaced", type=int, default=100, help="lone requests per side and round")
    parser.add_argument("--seconds", type=float, default=2.0, help="throughput window")
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--json", help="also write every round's figures here")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--role", choices=("responder", "requester"), help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_child(args.role, args.side, args.url))
        return
    missing = _nats_core_missing()
    if missing:
        print(f"nats_clients: {missing}; nothing measured")
        return
    args.load_before = f"{os.getloadavg()[0]:.2f}"
    _report(asyncio.run(_measure(args)), args)


if __name__ == "__main__":
    main()
