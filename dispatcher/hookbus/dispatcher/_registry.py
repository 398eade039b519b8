"""Keeping the routing table in step with the handler registry bucket.

A KV watch on `HANDLERS_BUCKET` feeds every put and delete into the `RoutingTable`, so an
emit never waits on discovery. FIELD-NOTES: a watch can stall for seconds after its server
dies, so the watch is re-created when it ends or fails, and a full resync (read every key)
runs every `resync_s` seconds as a backstop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus.schemas import (
    HandlerDeclaration,
    HookbusError,
    decode,
    handlers_bucket_config,
    parse_handler_key,
)

from ._routes import RoutingTable

__all__ = ["RegistryWatch", "open_handlers_bucket"]

log = logging.getLogger("hookbus.dispatcher")


async def open_handlers_bucket(nc: NATS, *, replicas: int = 1) -> KeyValue:
    """The handlers bucket, created with `handlers_bucket_config` if absent."""
    js = nc.jetstream()
    try:
        return await js.create_key_value(config=handlers_bucket_config(replicas=replicas))
    except nats.js.errors.BadRequestError:  # exists with another config: use it as it is
        return await js.key_value(handlers_bucket_config().bucket)


class RegistryWatch:
    """Watches the handlers bucket into a routing table. `start` returns once the
    current declarations are loaded; `stop` is idempotent."""

    def __init__(self, kv: KeyValue, table: RoutingTable, *, resync_s: float = 30.0) -> None:
        self._kv = kv
        self._table = table
        self._resync_s = resync_s
        self._task: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        await self.resync()
        self._task = asyncio.create_task(self._run(), name="hookbus-registry-watch")
        await self._loaded.wait()

    async def stop(self) -> None:
        """Stop the watch task. Idempotent; never swallows the caller's own cancellation.

        On Python 3.11 the `asyncio.wait_for` inside nats-py's watcher can swallow a
        cancel, so the task is also told to stop by a flag and cancelled until it ends.
        """
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if not task.cancelled() and task.exception() is not None:
            log.warning("registry watch ended with %r", task.exception())

    async def resync(self) -> None:
        """Read every declaration into the routing table.

        nats-py's `keys()` can report too few keys (its "initial values done" signal races
        the consumer; nats.py issues 842, 995), so: a "no keys" answer is retried while the
        stream holds messages, and the remote routes are replaced wholesale only when the
        keys read account for every message of the bucket; otherwise they are only added
        to (deletions also arrive through the watch).
        """
        keys: list[str] = []
        for attempt in range(5):
            try:
                keys = await self._kv.keys()
                break
            except nats.js.errors.NoKeysError:
                if (await self._kv.status()).values == 0:
                    break  # really empty
                await asyncio.sleep(0.02 * (attempt + 1))
        decls = []
        for key in keys:
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                continue
            decl = self._decode(key, entry.value)
            if decl is not None:
                decls.append(decl)
        if len(keys) == (await self._kv.status()).values:
            self._table.replace_remote(decls)
        else:
            for decl in decls:
                self._table.put_remote(decl)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                watcher = await self._kv.watchall()
                try:
                    await self._follow(watcher)
                finally:
                    with contextlib.suppress(Exception):
                        await watcher.stop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # server lost, stream gone: retry, resync meanwhile
                log.warning("registry watch failed (%s); retrying", exc)
                self._loaded.set()
                await asyncio.sleep(1.0)
                with contextlib.suppress(Exception):
                    await self.resync()

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        loop = asyncio.get_running_loop()
        next_resync = loop.time() + self._resync_s
        while not self._stopping:
            try:
                entry = await watcher.updates(timeout=max(0.1, next_resync - loop.time()))
            except nats.errors.TimeoutError:
                entry = None
            if loop.time() >= next_resync:
                await self.resync()
                next_resync = loop.time() + self._resync_s
            if entry is None:  # end of the initial values, or a quiet period
                self._loaded.set()
                continue
            try:
                event, name = parse_handler_key(entry.key)
            except HookbusError:
                log.warning("ignoring foreign key %r in the handlers bucket", entry.key)
                continue
            if entry.operation in ("DEL", "PURGE") or entry.value is None:
                self._table.delete_remote(event, name)
                continue
            decl = self._decode(entry.key, entry.value)
            if decl is not None:
                self._table.put_remote(decl)

    @staticmethod
    def _decode(key: str, value: bytes | None) -> HandlerDeclaration | None:
        if not value:
            return None
        try:
            return decode(value, HandlerDeclaration)
        except HookbusError as exc:
            log.warning("ignoring bad declaration at %r: %s", key, exc)
            return None
