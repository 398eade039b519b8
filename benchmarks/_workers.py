"""What the benchmark's server side runs, each in a process of its own (as in production).

- The hookbus workers are served by the real CLI:
  ``python -m hookbus.cli --log-level info worker benchmarks/_workers.py:latency_worker --url URL``
  (its ``serving N handler(s)`` log line, written once the subscriptions are flushed and the
  declarations are in the registry bucket, is the ready signal).
- The raw baseline is this file run as a script, ``python benchmarks/_workers.py --url URL``:
  plain nats-py, one subscription on `RAW_SUBJECT` (queue group) and three on
  `RAW_SCATTER_SUBJECT`, replying inline in the subscription callback (no task, no
  decode: one publish) with the fixed, HookReply-shaped
  `RAW_REPLY`. It writes `RAW_READY` to stderr once subscribed. With ``--fleet`` it serves
  `RAW_FLEET_SUBJECT` (queue group) alone: two such processes are the raw shape of a
  2-replica worker. It runs on the event loop ``hookbus worker`` picks (`event_loop`): uvloop
  when installed, unless ``HOOKBUS_LOOP=asyncio``.

Every handler does no work (or awaits 5 ms of simulated I/O), so the figures measure the bus.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

import anyio

from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

EVENT_ONE = "bench:one"
"""One handler, answers continue."""
EVENT_CHAIN = "bench:chain"
"""Three sequential handlers (priorities 1, 2, 3), each answers continue; one process."""
EVENT_CHAIN_RESULT = "bench:chain-result"
"""The chain of 3 in one process, each handler returning ``HookResult(action="continue")``
(the shape of amplifier-core's handlers), not None."""
EVENT_BIG = "bench:big"
"""One handler (answers continue) that gets a large event: the 64 KB and 512 KB rows."""
EVENT_BIG_CHAIN = "bench:big-chain"
"""Three sequential handlers in one process (a chain request) that answer continue, for
large events (``profile_sides.py --kb``)."""
EVENT_BIG_MODIFY = "bench:big-modify"
"""Three sequential handlers in one process, each answering ``modify`` with the data it got
(whole replacement, as large as the event), for large events."""
EVENT_CHAIN_SPREAD = "bench:chain-spread"
"""The same chain of 3, each handler served by a process of its own."""
EVENT_PARALLEL = "bench:parallel"
"""Three adjacent ``parallel=True`` handlers: one concurrent group."""
EVENT_COLLECT = "bench:collect"
"""Three handlers that answer with data, for emit_and_collect."""
EVENT_IO = "bench:io"
"""One handler that awaits 5 ms (simulated I/O)."""
EVENT_REPLICAS = "bench:replicas"
"""Same 5 ms handler, served by 1, 2 or 4 replicas with a small concurrency bound."""
EVENT_FLEET = "bench:fleet"
"""One handler, answers continue, served by 2 replicas for the fleet rows."""

IO_SECONDS = 0.005
"""Simulated I/O per call of the io handlers, seconds."""

DATA: dict[str, Any] = {
    "tool_name": "bash",
    "tool_input": {"command": "ls -la /tmp"},
    "agent_id": "agent-1",
    "session_id": "session-1",
}
"""The event data of every emit (a typical small tool:pre payload)."""
RAW_PAYLOAD = json.dumps(
    {"id": "0" * 32, "event": EVENT_ONE, "data": DATA, "emitted_at": 0.0}
).encode()
"""The raw baseline sends bytes of an envelope's size, encoded once (no per-call work)."""


def big_data(nbytes: int) -> dict[str, Any]:
    """`DATA` with ``tool_input.content`` a text of about `nbytes` bytes (lines of words,
    newlines escaped in JSON, as a file written by a tool would be)."""
    line = "the quick brown fox jumps over the lazy dog 0123456789 " * 2 + "\n"
    text = (line * (nbytes // len(line) + 1))[:nbytes]
    return {**DATA, "tool_input": {"command": "write", "content": text}}


def raw_payload(data: dict[str, Any]) -> bytes:
    """The raw baseline's bytes for `data`: an envelope-sized JSON document, encoded once."""
    return json.dumps(
        {"id": "0" * 32, "event": EVENT_BIG, "data": data, "emitted_at": 0.0}
    ).encode()


RAW_SUBJECT = "bench.raw"
RAW_SCATTER_SUBJECT = "bench.raw.scatter"
"""Heard by 3 plain subscriptions (no queue group): one publish gets 3 replies, the raw
shape of emit_and_collect of 3."""
RAW_FLEET_SUBJECT = "bench.raw.fleet"
"""Served by 2 raw responder processes (``--fleet``) in one queue group."""
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


@latency_worker.handler(EVENT_BIG)
async def big(event: str, data: dict[str, Any]) -> None:
    return None


def _passthrough(name: str) -> Any:
    async def handler(event: str, data: dict[str, Any]) -> None:
        return None

    handler.__name__ = name
    return handler


def _continue(name: str) -> Any:
    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue")

    handler.__name__ = name
    return handler


def _modify(name: str) -> Any:
    async def handler(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data=data)

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
        w.add_handler(EVENT_CHAIN_RESULT, _continue(f"chain_result_{i}"), priority=i)
        w.add_handler(EVENT_PARALLEL, _passthrough(f"parallel_{i}"), priority=i, parallel=True)
        w.add_handler(EVENT_COLLECT, _answer(f"collect_{i}"), priority=i)
    return w


groups_worker = _group_worker(1, 2, 3)
"""All three handlers of each group in one process (one worker serving several hooks)."""


large_worker = HookWorker()
"""Large events (``profile_sides.py --kb``): one handler, a chain of 3 that continue and a
chain of 3 that modify."""
large_worker.add_handler(EVENT_BIG, _passthrough("big"))
for _i in (1, 2, 3):
    large_worker.add_handler(EVENT_BIG_CHAIN, _passthrough(f"big_chain_{_i}"), priority=_i)
    large_worker.add_handler(EVENT_BIG_MODIFY, _modify(f"big_modify_{_i}"), priority=_i)


def _chain_worker(i: int) -> HookWorker:
    w = HookWorker()
    w.add_handler(EVENT_CHAIN_SPREAD, _passthrough(f"spread_{i}"), priority=i)
    return w


chain_worker_1 = _chain_worker(1)
"""Handler 1 of the spread chain: one process per handler (think security, audit, context)."""
chain_worker_2 = _chain_worker(2)
chain_worker_3 = _chain_worker(3)

fleet_worker = HookWorker()
"""The fleet rows' handler (run as 2 replicas)."""


@fleet_worker.handler(EVENT_FLEET)
async def fleet_one(event: str, data: dict[str, Any]) -> None:
    return None


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
async def serve_raw(url: str, fleet: bool = False) -> None:
    """Reply `RAW_REPLY` to every request on `RAW_SUBJECT` and `RAW_SCATTER_SUBJECT` (or,
    with `fleet`, on `RAW_FLEET_SUBJECT` alone) until SIGTERM / SIGINT."""
    import nats

    nc = await nats.connect(url, name="bench-raw-responder")
    publish = nc.publish

    async def on_message(msg: Any) -> None:
        # inline, in the subscription's own callback: no task, no decode, one publish
        await publish(msg.reply, RAW_REPLY)

    if fleet:
        subs = [await nc.subscribe(RAW_FLEET_SUBJECT, queue="bench-raw", cb=on_message)]
    else:
        subs = [await nc.subscribe(RAW_SUBJECT, queue="bench-raw", cb=on_message)]
        for _ in range(3):
            subs.append(await nc.subscribe(RAW_SCATTER_SUBJECT, cb=on_message))
    await nc.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop_name = type(loop).__module__.split(".")[0]  # "uvloop" or "asyncio"
    print(f"{RAW_READY} ({loop_name} event loop)", file=sys.stderr, flush=True)
    await stop.wait()
    for sub in subs:
        await sub.drain()
    await nc.drain()


def event_loop() -> Any:
    """The loop factory ``hookbus worker`` would use: uvloop's when installed and
    ``HOOKBUS_LOOP`` is not ``asyncio``, else asyncio's (None)."""
    if os.environ.get("HOOKBUS_LOOP", "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="raw nats-py responder for the benchmark")
    parser.add_argument("--url", required=True)
    parser.add_argument("--fleet", action="store_true", help=f"serve {RAW_FLEET_SUBJECT} only")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=event_loop()) as runner:
        runner.run(serve_raw(args.url, args.fleet))
