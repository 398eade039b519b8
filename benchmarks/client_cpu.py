"""Client CPU per call: what the dispatcher adds to a raw request, in microseconds.

    .venv/bin/python benchmarks/client_cpu.py            # about 20 s
    .venv/bin/python benchmarks/client_cpu.py --quick    # about 8 s

Latency on a shared machine is noisy; CPU time of the calling process is much less so.
This measures the calling process's CPU (`time.process_time`) per sequential call, rounds
interleaved, median of the rounds: a raw ``nc.request`` to a responder in another process
(the baseline), a one-handler `HookDispatcher.emit` to a worker process (same payload,
same machine), a chain of 3 handlers of that worker, and an in-process emit of 3 local
handlers. Target: one-handler emit within 10 us of the raw request's CPU.
A command, not a test: it asserts nothing and exits 0 whether the target is met or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher

DATA: dict[str, Any] = {
    "tool_name": "bash",
    "tool_input": {"command": "ls -la /tmp"},
    "agent_id": "agent-1",
    "session_id": "session-1",
}
RAW = json.dumps({"id": "0" * 32, "event": "bench:one", "data": DATA, "emitted_at": 0.0}).encode()
REPLY = b'{"handler":"one","result":{"action":"continue"},"instance":"x"}'


async def serve(url: str) -> None:
    """The worker process: one handler, a chain of three, and the raw responder."""
    from hookbus.workers import HookWorker

    nc = await nats.connect(url)
    worker = HookWorker(nc)

    async def one(event: str, data: dict[str, Any]) -> None:
        return None

    worker.add_handler("bench:one", one)
    for i in range(3):
        worker.add_handler("bench:chain", one, name=f"step{i}", priority=i)

    async def raw(msg: Any) -> None:
        await msg.respond(REPLY)

    await nc.subscribe("bench.raw", cb=raw)
    await worker.start()
    print("ready", flush=True)
    await asyncio.Event().wait()


async def measure(n: int, rounds: int) -> dict[str, float]:
    with EmbeddedNatsServer() as server:
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--serve", server.url, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert child.stdout is not None
            await child.stdout.readline()  # "ready"
            nc = await nats.connect(server.url)
            remote = HookDispatcher(nc)
            await remote.start()
            local = HookDispatcher()
            for i in range(3):

                async def handler(event: str, data: dict[str, Any]) -> None:
                    return None

                local.register("bench:local", handler, priority=i, name=f"local{i}")

            async def raw() -> None:
                await nc.request("bench.raw", RAW, timeout=5)

            sides: dict[str, Callable[[], Awaitable[Any]]] = {
                "raw nc.request": raw,
                "emit, one remote handler": lambda: remote.emit("bench:one", DATA),
                "emit, chain of 3 in one worker": lambda: remote.emit("bench:chain", DATA),
                "emit, 3 in-process handlers": lambda: local.emit("bench:local", DATA),
            }
            for call in sides.values():  # warm up
                for _ in range(200):
                    await call()
            per_round: dict[str, list[float]] = {name: [] for name in sides}
            names = list(sides)
            for r in range(rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    call = sides[name]
                    start = time.process_time()
                    for _ in range(n):
                        await call()
                    per_round[name].append((time.process_time() - start) / n * 1e6)
            await remote.close()
            await nc.close()
            return {name: statistics.median(v) for name, v in per_round.items()}
        finally:
            child.kill()
            await child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls per round")
    parser.add_argument("--serve", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    n, rounds = (500, 4) if args.quick else (2000, 6)
    cpu = asyncio.run(measure(n, rounds))
    base = cpu["raw nc.request"]
    print(f"client CPU per call, median of {rounds} rounds of {n} calls")
    for name, us in cpu.items():
        extra = "" if name.startswith("raw") or "in-process" in name else f"  (+{us - base:.1f} us)"
        print(f"  {name:34} {us:7.1f} us{extra}")
    added = cpu["emit, one remote handler"] - base
    status = "MET" if added <= 10 else "MISSED"
    print(
        f"one-handler emit adds {added:.1f} us of client CPU to a raw request (<= 10 us): {status}"
    )


if __name__ == "__main__":
    main()
