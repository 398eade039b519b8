"""The raw NATS client side of the baseline, as lean as plain nats-py allows.

`RawRequester` is a request/reply with nats-py and nothing else: one wildcard reply
subscription per connection (the shape nats-py's own ``nc.request`` uses), a counter as the
token, a future per call resolved from the subscription's callback, and a timer handle for
the timeout. It skips what ``nc.request`` adds per call (a NUID and ``os.urandom`` token, a
done-callback closure, ``asyncio.wait_for``), so the raw side pays only: one ``publish``, the
server round trip, the reply's delivery through nats-py's subscription machinery, one future.

`RawRequester.scatter` is the raw shape of ``emit_and_collect`` of k: one publish, done when
k replies have come to the same inbox.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["RawRequester"]


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError("raw request: no reply in time"))


class RawRequester:
    """Requests on one long-lived wildcard inbox (plain nats-py, no hookbus code)."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.prefix = ""
        self.n = 0
        self.waiting: dict[str, list[Any]] = {}
        """token -> [future, replies still expected]"""

    async def start(self) -> RawRequester:
        self.prefix = self.nc.new_inbox() + "."
        cut = len(self.prefix)
        waiting = self.waiting

        async def on_reply(msg: Any) -> None:
            entry = waiting.get(msg.subject[cut:])
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0 and not entry[0].done():
                    entry[0].set_result(msg)

        await self.nc.subscribe(self.prefix + "*", cb=on_reply)
        await self.nc.flush()
        return self

    async def request(self, subject: str, payload: bytes, timeout: float = 5.0) -> Any:
        """One request, one reply (the reply `Msg`)."""
        return await self.scatter(subject, payload, 1, timeout)

    async def scatter(self, subject: str, payload: bytes, k: int, timeout: float = 5.0) -> Any:
        """One publish; returns once `k` replies came (the last one)."""
        self.n += 1
        token = str(self.n)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiting[token] = [fut, k]
        timer = loop.call_later(timeout, _expire, fut)
        try:
            await self.nc.publish(subject, payload, reply=self.prefix + token)
            return await fut
        finally:
            timer.cancel()
            del self.waiting[token]
