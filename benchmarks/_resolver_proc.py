"""The resolver's side of `suspensions.py --processes`: a process of its own, driven line by
line on stdin, answering each command with one line on stdout.

    python benchmarks/_resolver_proc.py URL BUCKET

Commands: ``resolve <label>`` (`HookDispatcher.resolve_hook` with an ``Answer``),
``put <key>`` and ``floor`` (a raw KV put of a record-sized value on BUCKET, key ``k<key>``
or ``floor``). Each answer is ``<t0> <seconds>``: `time.perf_counter()` just before the
call and how long the call took. On Linux `time.perf_counter` is ``CLOCK_MONOTONIC``, one
clock for every process of the machine, so the driving process compares its own times
with ``t0``. ``ready`` is written once connected.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import nats

from hookbus.dispatcher import HookDispatcher


async def main(url: str, bucket: str) -> None:
    from suspensions import Answer, _record_sized_value  # a sibling: on the path

    nc = await nats.connect(url, name="bench-resolver")
    resolver = HookDispatcher(nc, approvals=False)
    await resolver.start()
    kv = await nc.jetstream().key_value(bucket)
    value = _record_sized_value()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    try:
        while line := (await reader.readline()).decode().strip():
            command, _, arg = line.partition(" ")
            t0 = time.perf_counter()
            if command == "resolve":
                await resolver.resolve_hook(arg, Answer(approved=True, by="bench"))
            elif command == "put":
                await kv.put(f"k{arg}", value)
            elif command == "floor":
                await kv.put("floor", value)
            else:
                raise SystemExit(f"unknown command {line!r}")
            print(f"{t0!r} {time.perf_counter() - t0!r}", flush=True)
    finally:
        await resolver.close()
        await nc.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    asyncio.run(main(sys.argv[1], sys.argv[2]))
