"""Where a large event's time goes: the same bytes three ways, in interleaved rounds.

    .venv/bin/python benchmarks/large_events.py                 # 512 KB of event data
    .venv/bin/python benchmarks/large_events.py --kb 64
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728 \\
        .venv/bin/python benchmarks/large_events.py             # glibc keeps big buffers

Sides (one agent process, one ``hookbus worker`` process with one handler that allows,
an embedded nats-server):

- (a) raw: ``nc.request`` of the encoded envelope to a responder in the agent's process
  that replies inline (it reads nothing);
- (b) worker: ``nc.request`` of the same bytes to the worker's handler subject: what the
  worker adds (decoding the data into the dict its handler gets, its reply);
- (c) emit: ``HookDispatcher.emit`` of the data: what the dispatcher adds on top (the JSON
  copy amplifier-core's semantics require, the envelope, folding the reply).

Prints p50 per side and the ratios (b)/(a), (c)/(b), (c)/(a). Not a test: nothing here
asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import EventEnvelope, encode, handler_subject

WORKER = """
from hookbus.workers import HookWorker

worker = HookWorker()

@worker.handler("tool:pre", name="allow")
async def allow(event, data):
    return None
"""
REPLY = b'{"handler":"allow","result":{"action":"continue"}}'


async def measure(url: str, kb: int, rounds: int, per_round: int) -> dict[str, list[float]]:
    responder = await nats.connect(url)
    nc = await nats.connect(url)
    try:

        async def inline(msg: nats.aio.msg.Msg) -> None:
            await responder.publish(msg.reply, REPLY)

        await responder.subscribe("bench.raw", cb=inline)
        await responder.flush()
        async with HookDispatcher(nc) as d:
            while "allow" not in {r.name for r in d.routes("tool:pre")}:
                await d.refresh()
                await asyncio.sleep(0.05)
            data = {"tool_name": "bash", "tool_input": {"content": "x" * (kb * 1024)}}
            envelope = encode(EventEnvelope(id="bench", event="tool:pre", data=data))
            subject = handler_subject("tool:pre", "allow")
            sides = {
                "(a) raw request, inline responder": lambda: nc.request(
                    "bench.raw", envelope, timeout=5
                ),
                "(b) raw request to the worker": lambda: nc.request(subject, envelope, timeout=5),
                "(c) emit": lambda: d.emit("tool:pre", data),
            }
            samples: dict[str, list[float]] = {name: [] for name in sides}
            for call in sides.values():  # warm-up
                for _ in range(10):
                    await call()
            for _ in range(rounds):
                for name, call in sides.items():
                    for _ in range(per_round):
                        started = time.perf_counter()
                        await call()
                        samples[name].append(time.perf_counter() - started)
            print(f"event data {kb} KB; envelope {len(envelope):,} bytes")
            return samples
    finally:
        await nc.close()
        await responder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kb", type=int, default=512, help="KB of event data (default 512)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=30)
    args = parser.parse_args()
    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "allow_worker.py"
        path.write_text(WORKER)
        worker = subprocess.Popen(
            [sys.executable, "-m", "hookbus.cli", "worker", f"{path}:worker", "--url", server.url],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            samples = asyncio.run(measure(server.url, args.kb, args.rounds, args.per_round))
        finally:
            worker.terminate()
            worker.wait()
    p50 = {name: statistics.median(v) for name, v in samples.items()}
    for name, value in p50.items():
        print(f"{name:36s} p50 {value * 1e3:.3f} ms")
    a, b, c = p50.values()
    print(f"the worker's part     (b)/(a) {b / a:.2f}x (+{(b - a) * 1e3:.3f} ms)")
    print(f"the dispatcher's part (c)/(b) {c / b:.2f}x (+{(c - b) * 1e3:.3f} ms)")
    print(f"emit / raw            (c)/(a) {c / a:.2f}x")


if __name__ == "__main__":
    main()
