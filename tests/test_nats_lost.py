"""``hookbus gateway`` and ``hookbus console`` end when their NATS server is gone for good.

Each runs as a real subprocess against a nats-server of its own (started for the test),
with ``--max-reconnects 1``. Once it serves, the server is killed: after its one reconnect
attempt nats-py gives up, and the command must stop serving and exit 1 with one error
line naming the server, within a bound, never a traceback, rather than serve errors (the
gateway's fail-closed fallback, the console's 503s) forever.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from typing import Any

import anyio
import pytest
from _served_process import ServedProcess

from hookbus.cli import EmbeddedNatsServer

pytestmark = pytest.mark.anyio

EXIT_WITHIN_S = 20.0
"""From the server's death to the command's exit: one reconnect attempt 2 s after the
loss (plus a connect timeout of 3 s), then uvicorn's graceful stop."""

COMMANDS: dict[str, tuple[list[str], str, dict[str, str]]] = {
    "gateway http": (
        ["gateway", "http", "--port", "0", "--grace-period", "2"],
        "hookbus gateway serving ",
        {},
    ),
    "gateway aos": (
        ["gateway", "aos", "--port", "0", "--grace-period", "2"],
        "hookbus gateway serving ",
        {},
    ),
    "console": (
        ["console", "--port", "0"],
        "hookbus console serving ",
        {"HOOKBUS_CONSOLE_TOKEN": "a-console-token"},
    ),
}


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return int(response.status)


@pytest.mark.parametrize("command", sorted(COMMANDS))
async def test_exits_1_with_one_line_once_nats_is_given_up_on(
    command: str, embedded_server: EmbeddedNatsServer
) -> None:
    args, banner, env = COMMANDS[command]
    argv = [*args, "--url", embedded_server.url, "--max-reconnects", "1"]
    async with ServedProcess(argv, banner=banner, env=env) as served:
        health = "/healthz" if command.startswith("gateway") else "/"
        assert await anyio.to_thread.run_sync(_get, served.url.rstrip("/") + health) == 200
        assert served.proc is not None
        embedded_server.kill()
        killed = time.monotonic()
        with anyio.fail_after(EXIT_WITHIN_S):
            code = await served.proc.wait()
        took = time.monotonic() - killed
        await _rest_of_stderr(served)
    err = served.stderr
    assert code == 1, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, err
    assert f"gave up on NATS at {embedded_server.url}: 1 reconnect attempts failed" in errors[0]
    assert "--max-reconnects -1 retries forever" in errors[0]
    assert "lost the connection to NATS" in err  # said once, when it happened
    print(f"{command}: exit 1 {took:.1f} s after the server died")


async def _rest_of_stderr(served: Any) -> None:
    """Wait until the process's stderr is read to its end."""
    pump = served._pump
    if pump is not None:
        with anyio.fail_after(5):
            await asyncio.shield(pump)
