"""What the single-handler benchmarks (`gateway_bench.py`, `pydantic_ai_bench.py`) share:
their worker process (one ``tool:pre`` handler that allows every call, and a raw nats-py
responder with a HookReply-shaped answer for the baseline, served until SIGTERM/SIGINT) and
their command line (``--url``, ``--quick``, and ``--serve`` for the worker process); `serve_worker`
also serves `sites_bench.py`'s worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.msg import Msg

from hookbus.cli import EmbeddedNatsServer
from hookbus.schemas import TOOL_PRE
from hookbus.workers import HookWorker

S = TypeVar("S")

RAW_REPLY = b'{"handler":"raw","result":{"action":"continue"}}'


async def stop_process(proc: asyncio.subprocess.Process) -> None:
    """Stop a child process: SIGTERM, then SIGKILL after 15 s (nothing if it ended)."""
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 15)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


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

    await serve_worker(nc, worker, raw_subject=raw_subject, ready=ready)


async def serve_worker(nc: Any, worker: HookWorker, *, raw_subject: str, ready: str) -> None:
    """Serve `worker` (its handlers added) and the raw responder on `raw_subject` until
    SIGTERM/SIGINT; print `ready` on stderr once both are subscribed and the declaration is
    in the registry. Unregisters the worker and drains `nc` at the end."""

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


def bench_main(
    doc: str | None,
    *,
    serve: Callable[[str], Awaitable[None]],
    measure: Callable[[str, S], Awaitable[int]],
    quick: S,
    default: S,
) -> int:
    """A benchmark's ``main``: ``--serve`` runs the worker process; else `measure` against
    ``--url``, or a nats-server of its own, with the `quick` or `default` settings."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--url", help="an existing nats-server with JetStream")
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.url))
        return 0
    settings = quick if args.quick else default
    try:
        if args.url:
            return asyncio.run(measure(args.url, settings))
        with EmbeddedNatsServer() as server:
            return asyncio.run(measure(server.url, settings))
    except (RuntimeError, TimeoutError) as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
