"""A hookbus command that serves HTTP (`gateway`, `console`), run as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

HOOKBUS = [str(Path(sys.executable).with_name("hookbus"))]
"""The console script of this venv."""


class ServedProcess:
    """``hookbus ARGS`` as a subprocess, its environment without ``NATS_*``/``HOOKBUS_*``
    (plus `env`); `url` is read from its ``<banner> URL ...`` line on stderr, and every
    stderr line is kept in `lines`. Leaving it sends SIGTERM (killed after 20 s)."""

    def __init__(self, args: list[str], *, banner: str, env: dict[str, str] | None = None):
        self.argv = [*HOOKBUS, *args]
        self.banner = banner
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
        self.env.update(env or {})
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self.url = ""
        self._pump: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Any:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env=self.env,
        )  # fmt: skip
        assert self.proc.stderr is not None
        with anyio.fail_after(30):
            while not self.url:
                line = (await self.proc.stderr.readline()).decode()
                if not line:
                    raise AssertionError(f"{self.argv[1]} exited:\n" + "".join(self.lines))
                self.lines.append(line)
                if line.startswith(self.banner):
                    self.url = line[len(self.banner) :].split()[0]
        self._pump = asyncio.create_task(self._drain(self.proc.stderr))
        return self

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        async for line in stream:
            self.lines.append(line.decode())

    async def stop(self) -> int:
        """SIGTERM, then the exit code (killed after 20 s)."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                with anyio.fail_after(20):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._pump is not None:
            with anyio.fail_after(5):
                await self._pump
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)
