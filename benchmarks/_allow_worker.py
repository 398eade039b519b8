"""The worker process of the single-handler benchmarks (`gateway_bench.py`,
`pydantic_ai_bench.py`): one ``tool:pre`` handler that allows every call, and a raw nats-py
responder with a HookReply-shaped answer for the baseline, served until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from typing import Any

import nats
from nats.aio.msg import Msg

from hookbus.schemas import TOOL_PRE
from hookbus.workers import HookWorker

RAW_REPLY = b'{"handler":"raw","result":{"action":"continue"}}'


async def serve_allow_all(
    url: str, *, client: str, handler: str, raw_subject: str, ready: str
) -> None:
    """Serve `handler` on ``tool:pre`` and the raw responder on `raw_subject`; print `ready`
    on stderr once both are subscribed and the declaration is in the registry."""
    nc = await nats.connect(url, name=client)
    worker = HookWorker(nc, replace=True)

    async def allow(event: str, data: dict[str, Any]) -> None:
        return None

    worker.add_handler(TOOL_PRE, allow, name=handler, timeout_s=5.0)

    async def raw(msg: Msg) -> None:
        await msg.respond(RAW_REPLY)

    await nc.subscribe(raw_subject, cb=raw)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        await nc.flush()
        print(ready, file=sys.stderr, flush=True)
        await stop.wait()
    with contextlib.suppress(Exception):
        await worker.unregister()
    await nc.drain()
