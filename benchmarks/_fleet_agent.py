"""One agent of the fleet rows, a process of its own: an embedded `HookDispatcher` (as an
agent embeds it) and plain ``nc.request`` on one NATS connection.

    python benchmarks/_fleet_agent.py --url URL --name agent-3

One JSON object per line: first ``{"ready": true}`` on stdout (connected, the routing table
loaded, the fleet handler routed), then for each request read on stdin,
``{"mode": "emit" | "raw", "start": T0, "end": T1, "in_flight": K}`` (T0, T1 on
``time.monotonic``, the machine-wide clock every process shares), it keeps K calls in
flight from receipt until T1 and answers ``{"calls", "failures", "refused", "first"}``:
the calls completed without failure between T0 and T1 (the time before T0 is warm-up).
``emit`` is one-handler ``emit(EVENT_FLEET, DATA)``; ``raw`` is ``nc.request`` to
`RAW_FLEET_SUBJECT`. It ends at end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from typing import Any

import nats
from _measure import REFUSED, Call, emit_outcome
from _workers import DATA, EVENT_FLEET, RAW_FLEET_SUBJECT, RAW_PAYLOAD

from hookbus.dispatcher import HookDispatcher


async def window(call: Call, start: float, end: float, in_flight: int) -> dict[str, Any]:
    """Keep `in_flight` calls going until `end`; count those that complete in [start, end]."""
    out: dict[str, Any] = {"calls": 0, "failures": 0, "refused": 0, "first": ""}
    clock = time.monotonic

    async def lane() -> None:
        while clock() < end:
            try:
                ok = await call()
            except Exception as exc:
                ok = f"{type(exc).__name__}: {exc}"
            if not start <= clock() <= end:
                continue
            if ok is True:
                out["calls"] += 1
            elif ok == REFUSED:
                out["refused"] += 1
            else:
                out["failures"] += 1
                out["first"] = out["first"] or str(ok)

    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return out


async def serve(url: str, name: str) -> None:
    nc = await nats.connect(url, name=f"bench-fleet-{name}")
    d = HookDispatcher(nc)
    await d.start()
    await d.refresh()
    if len(d.routes(EVENT_FLEET)) != 1:
        raise RuntimeError(f"{EVENT_FLEET}: {len(d.routes(EVENT_FLEET))} routes, expected 1")

    async def emit() -> bool | str:
        return emit_outcome(await d.emit(EVENT_FLEET, DATA))

    async def raw() -> bool:
        await nc.request(RAW_FLEET_SUBJECT, RAW_PAYLOAD, timeout=5)
        return True

    calls: dict[str, Call] = {"emit": emit, "raw": raw}

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    say({"ready": True})
    while line := await asyncio.to_thread(sys.stdin.readline):
        try:
            ask = json.loads(line)
            call = calls[ask["mode"]]
            say(await window(call, float(ask["start"]), float(ask["end"]), int(ask["in_flight"])))
        except Exception as exc:  # reported to the parent, which stops the run
            say({"error": f"{type(exc).__name__}: {exc}"})
    await d.close()
    await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--name", required=True)
    args = parser.parse_args()
    # failures are counted and reported by the parent; one log line each would flood it
    logging.getLogger("hookbus").setLevel(logging.ERROR)
    asyncio.run(serve(args.url, args.name))


if __name__ == "__main__":
    main()
