"""The ``hookbus`` CLI run as a user runs it: a subprocess of this interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import anyio

__all__ = ["hookbus_cli"]


async def hookbus_cli(
    nats_url: str, *args: str, timeout_s: float = 30
) -> subprocess.CompletedProcess[bytes]:
    """``python -m hookbus.cli ARGS --url NATS_URL`` to its end, in a wide terminal (tables
    do not wrap) without colours; its exit code is not checked.

    Raises:
        TimeoutError: it has not exited after `timeout_s` seconds (it is killed).
    """
    with anyio.fail_after(timeout_s):
        return await anyio.run_process(
            [sys.executable, "-m", "hookbus.cli", *args, "--url", nats_url],
            check=False,
            env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1"},
        )
