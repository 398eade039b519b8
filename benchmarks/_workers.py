"""What the benchmark's server side runs, each in a process of its own (as in production).

- The hookbus workers are served by the real CLI:
  ``python -m hookbus.cli --log-level info worker benchmarks/_workers.py:latency_worker --url URL``
  (its ``serving N handler(s)`` log line, written once the subscriptions are flushed and the
  declarations are in the registry bucket, is the ready signal).
- The raw baseline is this file run as a script, ``python benchmarks/_workers.py --url URL``:
  plain nats-py, one subscription on `RAW_SUBJECT`, one task per message, each replying with
  the fixed, HookReply-shaped `RAW_REPLY`. It writes `RAW_READY` to stderr once subscribed.

Every handler does no work (or awaits 5 ms of simulated I/O), so the figures measure the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

import anyio

from hookbus.workers import HookWorker

EVENT_ONE = "bench:one"
"""One handler, answers continue."""
EVENT_CHAIN = "bench:chain"
"""Three sequential handlers (priorities 1, 2, 3), each answers continue."""
EVENT_PARALLEL = "bench:parallel"
"""Three adjacent ``parallel=True`` handlers: one concurrent group."""
EVENT_COLLECT = "bench:collect"
"""Three handlers that answer with data, for emit_and_collect."""
EVENT_IO = "bench:io"
"""One handler that awaits 5 ms (simulated I/O)."""
EVENT_REPLICAS = "bench:replicas"
"""Same 5 ms handler, served by 1, 2 or 4 replicas with a small concurrency bound."""

IO_SECONDS = 0.005
"""Simulated I/O per call of the io handlers, seconds."""

RAW_SUBJECT = "bench.raw"
RAW_SCATTER_SUBJECT = "bench.raw.scatter"
"""Heard by 3 plain subscriptions (no queue group): one publish gets 3 replies, the raw
shape of emit_and_collect of 3."""
RAW_REPLY = b'{"handler":"raw","result":{"action":"continue"}}'
"""What a hookbus worker answers for a handler that returns None, give or take the name."""
RAW_READY = "raw responder ready"
WORKER_READY = "serving "
"""Prefix of the HookWorker's INFO log line written once it serves."""


# -- hookbus workers (served by `hookbus worker benchmarks/_workers.py:<name>`) --------------
latency_worker = HookWorker()
"""The one-handler rows (latency and throughput)."""


@latency_worker.handler(EVENT_ONE)
async def one(event: str, data: dict[str, Any]) -> None:
    return None


def _passthrough(name: str) -> Any:
    async def handler(event: str, data: dict[str, Any]) -> None:
        return None

    handler.__name__ = name
    return handler


def _answer(name: str) -> Any:
    async def handler(event: str, data: dict[str, Any]) -> dict[str, Any]:
        return {"data": {"from": name}}

    handler.__name__ = name
    return handler


def _group_worker(*indexes: int) -> HookWorker:
    """A worker serving handler `i` (for each of `indexes`) of the chain, of the parallel
    group and of the collect group."""
    w = HookWorker()
    for i in indexes:
        w.add_handler(EVENT_CHAIN, _passthrough(f"chain_{i}"), priority=i)
        w.add_handler(EVENT_PARALLEL, _passthrough(f"parallel_{i}"), priority=i, parallel=True)
        w.add_handler(EVENT_COLLECT, _answer(f"collect_{i}"), priority=i)
    return w


groups_worker = _group_worker(1, 2, 3)
"""All three handlers of each group in one process (the default layout)."""
group_worker_1 = _group_worker(1)
"""With ``--spread``: one process per handler index (think security, audit, context)."""
group_worker_2 = _group_worker(2)
group_worker_3 = _group_worker(3)

io_worker = HookWorker()
"""One 5 ms I/O handler, default concurrency bound (256)."""


@io_worker.handler(EVENT_IO)
async def io_5ms(event: str, data: dict[str, Any]) -> None:
    await anyio.sleep(IO_SECONDS)


replica_worker = HookWorker()
"""The 5 ms handler for the replica rows (run with ``--max-concurrency 8``)."""


@replica_worker.handler(EVENT_REPLICAS)
async def io_5ms_replica(event: str, data: dict[str, Any]) -> None:
    await anyio.sleep(IO_SECONDS)


# -- the raw responder (this file as a script) -------------------------------------------
async def serve_raw(url: str) -> None:
    """Reply `RAW_REPLY` to every request on `RAW_SUBJECT` until SIGTERM / SIGINT."""
    import nats

    nc = await nats.connect(url, name="bench-raw-responder")
    tasks: set[asyncio.Task[None]] = set()

    async def reply(subject: str) -> None:
        await nc.publish(subject, RAW_REPLY)

    async def on_message(msg: Any) -> None:
        task = asyncio.create_task(reply(msg.reply))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    subs = [await nc.subscribe(RAW_SUBJECT, queue="bench-raw", cb=on_message)]
    for _ in range(3):
        subs.append(await nc.subscribe(RAW_SCATTER_SUBJECT, cb=on_message))
    await nc.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(RAW_READY, file=sys.stderr, flush=True)
    await stop.wait()
    for sub in subs:
        await sub.drain()
    while tasks:
        await asyncio.gather(*list(tasks), return_exceptions=True)
    await nc.drain()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="raw nats-py responder for the benchmark")
    parser.add_argument("--url", required=True)
    asyncio.run(serve_raw(parser.parse_args().url))
