"""The dispatcher's own CPU per call, with the network taken out: a profiling harness.

    .venv/bin/python benchmarks/client_loopback.py                   # every kind, 256 lanes
    .venv/bin/python benchmarks/client_loopback.py --kind one --lanes 1 --n 20000
    .venv/bin/python benchmarks/client_loopback.py --kind chain --profile   # cProfile

`HookDispatcher` runs against a stand-in for the nats-py client that answers in the same
process: ``publish`` queues a fixed, HookReply-shaped reply and one task hands each reply to
the subscription callback it is addressed to, as nats-py's subscription task does. No
sockets, no server, no worker: what is left is the dispatcher's code and asyncio. The raw
side is `_raw.RawRequester` on the same stand-in: the least a request costs here.

Kinds: ``raw`` (`RawRequester.request`), ``scatter`` (`RawRequester.scatter` of 3),
``one`` (a one-handler emit), ``chain`` (an emit of 3 handlers of one worker process: one
chain request, its final reply), ``collect`` (`emit_and_collect` of 3). Each prints the
median CPU time per call (`time.process_time`) over the rounds.

The real benchmarks (`run.py`, `client_cpu.py`) measure through a nats-server and worker
processes; their client figures move with the machine by several microseconds, this one by
a few tenths, so an A/B of a change to the dispatcher's hot path reads best here (run it
against the code before the change with that code first on ``PYTHONPATH``). It is a tool,
not a test: the stand-in is never used by the test suite, which runs against real servers.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import _workers as W
from _raw import RawRequester

from hookbus._core.direct_delivery import subscribe_direct
from hookbus.dispatcher import HookDispatcher
from hookbus.dispatcher._route_table import Route
from hookbus.schemas import HookReply, HookResult, encode

KINDS = ("raw", "scatter", "one", "chain", "collect")
STEPS = ("s0", "s1", "s2")
ONE = Route.make(
    event="bench:one", name="one", priority=0, timeout_s=5.0, failure_policy="ignore",
    parallel=False, tool_filter=None, subject="hookbus.v1.handler.bench=3Aone.one",
)  # fmt: skip
CHAIN = tuple(
    dataclasses.replace(
        Route.make(
            event="bench:chain", name=name, priority=i, timeout_s=5.0, failure_policy="ignore",
            parallel=False, tool_filter=None, seq=i, handler_set=STEPS,
            subject=f"hookbus.v1.handler.bench=3Achain.{name}",
        ),
        chain="hookbus.v1.chain.bench=3Achain." + "0" * 32,
    )
    for i, name in enumerate(STEPS)
)  # fmt: skip
REPLY = encode(HookReply(handler="one", result=HookResult(), instance="a" * 16))
CHAIN_REPLY = encode(
    HookReply(
        handler="0" * 32,
        chain=[HookReply(handler=n, result=HookResult(), instance="a" * 16) for n in STEPS],
        instance="a" * 16,
    )
)
COLLECT_REPLIES = [
    encode(HookReply(handler=n, result=HookResult(data={"from": n}), instance="a" * 16))
    for n in STEPS
]


class _Msg:
    __slots__ = ("data", "headers", "reply", "subject")

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.headers, self.reply = subject, data, None, ""


class LoopbackClient:
    """What the dispatcher and `RawRequester` use of a nats-py client, answered in process:
    a request on a chain subject gets `CHAIN_REPLY`, on a collect subject the three
    `COLLECT_REPLIES`, on any other `REPLY`; one task delivers the replies in order."""

    max_payload = 1 << 20
    is_connected = True
    is_closed = False

    def __init__(self) -> None:
        self._queue: asyncio.Queue[_Msg] = asyncio.Queue()
        self._subs: list[tuple[str, Callable[[Any], Awaitable[None]]]] = []
        self._task: asyncio.Task[None] | None = None
        self._inboxes = 0

    def new_inbox(self) -> str:
        self._inboxes += 1
        return f"_INBOX.loopback{self._inboxes}"

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: Any = None
    ) -> None:
        if ".collect." in subject:
            for data in COLLECT_REPLIES:
                self._queue.put_nowait(_Msg(reply, data))
        else:
            self._queue.put_nowait(_Msg(reply, CHAIN_REPLY if ".chain." in subject else REPLY))

    async def subscribe(
        self, subject: str, queue: str = "", cb: Callable[[Any], Awaitable[None]] | None = None
    ) -> Any:
        assert cb is not None
        self._subs.append((subject.rstrip("*"), cb))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._deliver())
        return self

    async def flush(self) -> None:
        pass

    async def _deliver(self) -> None:
        while True:
            msg = await self._queue.get()
            for prefix, cb in self._subs:
                if msg.subject.startswith(prefix):
                    await cb(msg)
                    break


async def _dispatcher() -> HookDispatcher:
    """A dispatcher whose router talks to a `LoopbackClient` and routes `ONE` and `CHAIN`
    (its registry watch is not started: the routes are set here)."""
    nc = LoopbackClient()
    d = HookDispatcher()
    router = d._router
    router.nc = nc  # type: ignore[assignment]
    await router._requester.start(nc)  # type: ignore[arg-type]
    router._inbox_prefix = nc.new_inbox()
    await subscribe_direct(nc, router._inbox_prefix + ".*", router._on_collect_reply)
    router.started = True
    router.table.routes = lambda event: CHAIN if event == "bench:chain" else (ONE,)  # type: ignore[method-assign]
    return d


async def _call(kind: str) -> Callable[[], Awaitable[Any]]:
    if kind in ("raw", "scatter"):
        raw = await RawRequester(LoopbackClient()).start()
        if kind == "raw":
            return lambda: raw.request("bench.raw", W.RAW_PAYLOAD)
        return lambda: raw.scatter("bench.collect.raw", W.RAW_PAYLOAD, 3)
    d = await _dispatcher()
    if kind == "one":
        return lambda: d.emit("bench:one", W.DATA)
    if kind == "chain":
        return lambda: d.emit("bench:chain", W.DATA)
    return lambda: d.emit_and_collect("bench:chain", W.DATA)


async def measure(kind: str, lanes: int, n: int, rounds: int, profile: bool) -> list[float]:
    """CPU microseconds per call of `kind`, one figure per round (`lanes` calls in flight,
    `n` calls per lane per round)."""
    call = await _call(kind)

    async def lane(count: int) -> None:
        for _ in range(count):
            await call()

    await asyncio.gather(*(lane(max(1, n // 10)) for _ in range(lanes)))  # warm up
    profiler = cProfile.Profile() if profile else None
    figures = []
    for _ in range(rounds):
        if profiler is not None:
            profiler.enable()
        start = time.process_time()
        await asyncio.gather(*(lane(n) for _ in range(lanes)))
        figures.append((time.process_time() - start) / (lanes * n) * 1e6)
        if profiler is not None:
            profiler.disable()
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=(*KINDS, "all"), default="all")
    parser.add_argument("--lanes", type=int, default=256, help="calls in flight (default 256)")
    parser.add_argument("--n", type=int, default=200, help="calls per lane per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the rounds")
    args = parser.parse_args(argv)
    for kind in KINDS if args.kind == "all" else (args.kind,):
        figures = asyncio.run(measure(kind, args.lanes, args.n, args.rounds, args.profile))
        print(
            f"{kind:8s} {statistics.median(figures):6.2f} us CPU per call (median of"
            f" {len(figures)}; {min(figures):.2f}-{max(figures):.2f}), {args.lanes} in flight"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
