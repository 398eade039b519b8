"""The benchmark's child processes: servers that signal readiness on stderr (`Proc`), and
helpers driven by one JSON object per line on stdin / stdout (`JsonChild`).

Every child gets SIGTERM when the benchmark dies (Linux ``PR_SET_PDEATHSIG``), so none is
left reconnecting to a server that is gone. Stderr is kept drained; its last lines are
shown when a run is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import _workers as W

__all__ = ["JsonChild", "Proc", "agent_proc", "raw_proc", "running", "worker_proc"]

HERE = Path(__file__).resolve().parent
WORKERS_FILE = str(HERE / "_workers.py")

TAIL = 50
"""Lines of stderr kept per child."""


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the benchmark dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """A child process that writes `ready` to stderr once it serves.

    `start` raises RuntimeError (with the child's last stderr lines) if the child exits or
    is not ready within its timeout.
    """

    def __init__(self, label: str, argv: list[str], ready: str) -> None:
        self.label = label
        self.argv = argv
        self.ready = ready
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._drain: asyncio.Task[None] | None = None

    async def _spawn(self, stdio: bool) -> asyncio.subprocess.Process:
        pipe = asyncio.subprocess.PIPE
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=pipe if stdio else asyncio.subprocess.DEVNULL,
            stdout=pipe if stdio else asyncio.subprocess.DEVNULL,
            stderr=pipe,
            preexec_fn=_die_with_parent,
            limit=16 * 1024 * 1024,
        )
        return self.proc

    async def start(self, timeout_s: float = 60.0) -> None:
        proc = await self._spawn(stdio=False)
        assert proc.stderr is not None
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    line = await proc.stderr.readline()
                    if not line:
                        raise RuntimeError(
                            f"{self.label} exited before it was ready:\n{self.tail()}"
                        )
                    self.lines.append(line.decode(errors="replace"))
                    if self.ready in self.lines[-1]:
                        break
        except TimeoutError:
            await self.stop()
            raise RuntimeError(
                f"{self.label} not ready within {timeout_s}s:\n{self.tail()}"
            ) from None
        self._drain = asyncio.create_task(self._drain_stderr())

    def tail(self, n: int = 20) -> str:
        return "".join(self.lines[-n:])

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    async def _drain_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.lines.append(line.decode(errors="replace"))
            del self.lines[:-TAIL]

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._drain, 2)


class JsonChild(Proc):
    """A child that reads one JSON object per line on stdin and answers one per line on
    stdout; its first stdout line (a JSON object) says it is ready.

    `ask` raises RuntimeError (with the child's last stderr lines) if the child ends or
    answers something that is not a JSON object.
    """

    def __init__(self, label: str, argv: list[str]) -> None:
        super().__init__(label, argv, ready="")
        self.hello: dict[str, Any] = {}

    async def start(self, timeout_s: float = 60.0) -> None:
        await self._spawn(stdio=True)
        self._drain = asyncio.create_task(self._drain_stderr())
        try:
            self.hello = await asyncio.wait_for(self._read(), timeout_s)
        except TimeoutError:
            await self.stop()
            raise RuntimeError(
                f"{self.label} not ready within {timeout_s}s:\n{self.tail()}"
            ) from None

    async def stop(self) -> None:
        """End of input first (the child ends by itself), SIGTERM after 2 s."""
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 2)
        await super().stop()

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None, "not started"
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.proc.stdin.drain()

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        await self.send(message)
        return await self._read()

    async def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None, "not started"
        line = await self.proc.stdout.readline()
        if not line:
            await asyncio.sleep(0.2)  # let the last stderr lines arrive
            raise RuntimeError(f"{self.label} ended:\n{self.tail()}")
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RuntimeError(f"{self.label} answered {line[:200]!r}")
        if "error" in answer:
            raise RuntimeError(f"{self.label}: {answer['error']}")
        return answer


@contextlib.asynccontextmanager
async def running(procs: Sequence[Proc]) -> AsyncIterator[None]:
    """Start `procs` together; stop them all on exit (also when a start failed)."""
    try:
        started = await asyncio.gather(*(p.start() for p in procs), return_exceptions=True)
        for outcome in started:
            if isinstance(outcome, BaseException):
                raise outcome
        yield
    finally:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)


def worker_proc(
    attr: str, url: str, *, max_concurrency: int | None = None, label: str = ""
) -> Proc:
    """``hookbus worker benchmarks/_workers.py:<attr>`` (the real CLI), ready once it serves."""
    argv = [sys.executable, "-m", "hookbus.cli", "--log-level", "info", "worker",
            f"{WORKERS_FILE}:{attr}", "--url", url]  # fmt: skip
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    return Proc(label or attr, argv, W.WORKER_READY)


def raw_proc(url: str, *, fleet: bool = False, label: str = "raw responder") -> Proc:
    """The plain nats-py responder (`_workers.serve_raw`)."""
    argv = [sys.executable, WORKERS_FILE, "--url", url] + (["--fleet"] if fleet else [])
    return Proc(label, argv, W.RAW_READY)


def agent_proc(url: str, name: str) -> JsonChild:
    """One fleet agent (`_fleet_agent.py`)."""
    argv = [sys.executable, str(HERE / "_fleet_agent.py"), "--url", url, "--name", name]
    return JsonChild(name, argv)
