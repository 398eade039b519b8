"""The HTTP commands (``hookbus gateway``, ``hookbus console``) end when NATS is gone for
good, as ``worker`` and ``dispatcher`` do (`_lifecycle.Supervisor`).

nats-py retries a lost server ``--max-reconnects`` times, `RECONNECT_WAIT_S` apart, then
closes the connection for good. An HTTP server left running then would answer every
request with its fallback (the gateway) or an error (the console) forever, and its
``/readyz`` would say "not ready" forever: nothing an orchestrator restarts. So while
uvicorn serves, `nats_lost` watches the connection; once nats-py has given up, it asks
uvicorn to stop (its graceful shutdown: requests in flight are answered), and `check`
then ends the command with one error line, exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import click
from nats.aio.client import Client as NATS

from ._connect import _redacted

__all__ = ["LostWatch", "gave_up_message", "nats_lost"]

POLL_S = 0.1
"""How often the connection's state is read, seconds (what `Supervisor` does too)."""


def gave_up_message(nc: NATS, url: str, max_reconnects: int) -> str:
    """The one line a command ends with once nats-py closed its connection for good:
    where, after how many attempts, the last error, and what to do."""
    error = nc.last_error
    reason = f" (last error: {error})" if error else ""
    where = _redacted(url)
    if max_reconnects >= 0:
        return (
            f"gave up on NATS at {where}: {max_reconnects} reconnect attempts failed{reason};"
            " start this again once the server is back (--max-reconnects -1 retries forever)"
        )
    return f"the connection to NATS at {where} was closed{reason}"


class LostWatch:
    """What `nats_lost` saw: `message` is set once the connection was given up on."""

    def __init__(self) -> None:
        self.message: str | None = None

    def check(self) -> None:
        """Raises:
        click.ClickException: the connection was given up on while serving (one line,
            exit 1)."""
        if self.message is not None:
            raise click.ClickException(self.message)


@contextlib.asynccontextmanager
async def nats_lost(
    nc: NATS, url: str, max_reconnects: int, server: Any
) -> AsyncIterator[LostWatch]:
    """Watch `nc` while uvicorn's `server` serves inside the block: if nats-py closes it for
    good (not because `server` is already stopping, whose shutdown closes it), set
    ``server.should_exit`` (uvicorn's graceful stop) and note why in the `LostWatch`
    yielded; call its `check` after the block.

    Args:
        nc: the command's connection (made with ``max_reconnects``).
        url: where it connects, for the message (credentials are redacted).
        max_reconnects: its reconnect attempts, for the message (-1: forever).
        server: the ``uvicorn.Server`` to stop.
    """
    watch = LostWatch()

    async def poll() -> None:
        while not server.should_exit:
            if nc.is_closed:
                watch.message = gave_up_message(nc, url, max_reconnects)
                server.should_exit = True
                return
            await asyncio.sleep(POLL_S)

    task = asyncio.ensure_future(poll())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
