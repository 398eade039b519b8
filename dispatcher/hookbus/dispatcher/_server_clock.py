"""The server's clock: how old a key's revision is by the time JetStream keeps, never by a
host's wall clock (an approval's expiry is judged by it; see `hookbus.dispatcher._approvals`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import msgspec
import nats.js.api
from nats.js.kv import KeyValue

from hookbus._core.kv import kv_retry

__all__ = ["SERVER_CLOCK_TTL_S", "server_age"]

SERVER_CLOCK_TTL_S = 30.0
"""Seconds a reading of the server's clock (``STREAM.INFO``'s ``ts``) is carried forward on
this process's monotonic clock before it is read again (one request per 30 s, not one per
approval judged: a monotonic clock's rate is true to well under a second in that time)."""

_server_clocks: dict[tuple[str, str], tuple[datetime.datetime, float]] = {}
"""By (JetStream API prefix, stream): the server's time read and `time.monotonic()` then."""


async def server_age(kv: KeyValue, key: str, revision: int) -> float | None:
    """Seconds, by the server's clock, since revision `revision` of `key` was written: the
    time JetStream stamped on the key's last message against the server's time now (read
    from ``STREAM.INFO``, carried forward `SERVER_CLOCK_TTL_S`). None: the key's last
    message is another revision (it changed meanwhile).

    Raises:
        HookbusTimeoutError: JetStream stayed unavailable for 5 s.
    """
    js: Any = kv._js  # type: ignore[attr-defined]
    stream: str = kv._stream  # type: ignore[attr-defined]
    subject = f"{kv._pre}{key}"  # type: ignore[attr-defined]
    clock_key = (str(js._prefix), stream)

    async def read() -> float | None:
        last = await js.get_last_msg(stream, subject, direct=True)
        if last.seq != revision or last.time is None:
            return None
        read_at = _server_clocks.get(clock_key)
        if read_at is None or time.monotonic() - read_at[1] > SERVER_CLOCK_TTL_S:
            info = await js._nc.request(f"{js._prefix}.STREAM.INFO.{stream}", b"", timeout=2.0)
            server_now = nats.js.api.Base._parse_utc_iso(msgspec.json.decode(info.data)["ts"])
            read_at = _server_clocks[clock_key] = (server_now, time.monotonic())
        now = read_at[0] + datetime.timedelta(seconds=time.monotonic() - read_at[1])
        return (now - last.time).total_seconds()

    return await kv_retry(read, deadline_s=5.0, what=f"reading the age of {key[:80]}")
