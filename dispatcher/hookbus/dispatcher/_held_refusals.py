"""An agent's refusals, answered after a pause (`HeldRefusals`).

A client that sends again as soon as it is refused, with many requests in flight, would
keep a replica, the server and the machine busy with refusals. Held for about 1 s
(``quota``) or 0.25 s (the agent's ``busy``), each spread over half to one and a half
times that so refusals do not come back as one burst, and at most half the request's own
``timeout_s`` so the caller still hears it, such a client slows to its bounds. At most
`MAX_HELD_REFUSALS` wait at once; past them, refusals are answered at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
from nats.aio.msg import Msg

from hookbus.schemas import CollectReply, EmitReply, WireError

__all__ = ["AGENT_REFUSAL_HOLD_S", "MAX_HELD_REFUSALS", "HeldRefusals", "Reply"]

Reply = type[EmitReply] | type[CollectReply]
"""The reply type of a service endpoint (what its answers are encoded as)."""

Refuse = Callable[[Msg, Reply, WireError, int], Awaitable[None]]

AGENT_REFUSAL_HOLD_S: Final = {"quota": 1.0, "busy": 0.25}
"""Seconds an agent's refusal waits before it is sent (see the module docstring)."""

MAX_HELD_REFUSALS: Final = 10_000
"""Refusals of a replica waiting to be sent at most; past it they are sent at once."""


class _Timeout(msgspec.Struct):
    """The one field of a request a held refusal reads (the rest is never decoded)."""

    timeout_s: float | None = None


class HeldRefusals:
    """The refusals of one replica waiting for their hold; `refuse` sends one
    (``refuse(msg, reply_type, error, received)``, received: ``time.perf_counter_ns()``
    when the request came). Its length is how many wait."""

    def __init__(self, refuse: Refuse) -> None:
        self._refuse = refuse
        self._held: dict[int, tuple[asyncio.TimerHandle, tuple[Msg, Reply, WireError, int]]] = {}
        """Refusals waiting for their hold, by number."""
        self._held_seq = 0
        self._tasks: set[asyncio.Future[None]] = set()

    def __len__(self) -> int:
        return len(self._held)

    async def hold(self, msg: Msg, reply_type: Reply, error: WireError, received: int) -> None:
        """Answer an agent's refusal `error` after its hold (`AGENT_REFUSAL_HOLD_S`, at
        most half the request's ``timeout_s``), or at once when too many wait already."""
        # spread over half to one and a half times the hold: refusals released together
        # would come back together, a burst every other agent's requests queue behind
        hold = AGENT_REFUSAL_HOLD_S.get(error.code, 0.0) * (0.5 + random.random())
        if hold and len(self._held) < MAX_HELD_REFUSALS:
            # whatever the body (nested past the decoder's depth: RecursionError), the
            # refusal is sent: only its hold depends on the body
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, RecursionError):
                asked = msgspec.json.decode(msg.data, type=_Timeout).timeout_s
                if asked is not None and asked > 0:
                    hold = min(hold, asked / 2)
            if hold > 0.001:
                self._held_seq += 1
                key = self._held_seq
                handle = asyncio.get_running_loop().call_later(hold, self._release, key)
                self._held[key] = (handle, (msg, reply_type, error, received))
                return
        await self._refuse(msg, reply_type, error, received)

    def _release(self, key: int) -> None:
        """A held refusal's time came: send it."""
        held = self._held.pop(key, None)
        if held is not None:
            task = asyncio.ensure_future(self._refuse(*held[1]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def release_all(self) -> None:
        """Send every held refusal now (the replica stops), and wait (at most 2 s) for
        those already on their way."""
        held, self._held = list(self._held.values()), {}
        for handle, entry in held:
            handle.cancel()
            await self._refuse(*entry)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
