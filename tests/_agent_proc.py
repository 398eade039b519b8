"""An agent process for the restart tests (tests/test_restart.py runs it as a subprocess).

    python tests/_agent_proc.py NATS_URL RUN_ID LABEL

Enters ``dispatcher.run(RUN_ID)`` and awaits ``dispatcher.hook(LABEL, Grant)``. Prints one
line per step, flushed: ``waiting`` just before the hook is awaited, then
``resolved <resolution as JSON>`` or ``error <ErrorType> <message>``. Exits 0 once the run
scope is closed and the connection drained (every event it published has left).
"""

from __future__ import annotations

import json
import sys

import anyio
import msgspec
import nats

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookbusError


class Grant(msgspec.Struct):
    """The payload the restart tests resolve with."""

    approved: bool
    by: str = ""


def say(line: str) -> None:
    print(line, flush=True)


async def main(url: str, run_id: str, label: str) -> int:
    nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    code = 0
    try:
        async with HookDispatcher(nc, approvals=False) as d, d.run(run_id):
            say("waiting")
            try:
                value = await d.hook(label, Grant, metadata={"agent": "restart-test"})
            except HookbusError as exc:
                say(f"error {type(exc).__name__} {exc}")
                code = 1
            else:
                say(f"resolved {json.dumps(msgspec.to_builtins(value))}")
    finally:
        await nc.drain()
    return code


if __name__ == "__main__":
    url, run_id, label = sys.argv[1:4]
    sys.exit(anyio.run(main, url, run_id, label, backend="asyncio"))
