"""Gateway benchmark: what the HTTP doors add to a decision, measured in the same run.

    .venv/bin/python benchmarks/gateway_bench.py            # about 25 s
    .venv/bin/python benchmarks/gateway_bench.py --quick    # about 8 s, noisier
    .venv/bin/python benchmarks/gateway_bench.py --url nats://127.0.0.1:4222  # your server

Starts its own nats-server (`hookbus.cli.EmbeddedNatsServer`) unless ``--url`` is given, one
hook worker in a process of its own (this file run with ``--serve``: one ``tool:pre``
handler that answers continue, and a raw responder), and the gateway as production runs
it: ``hookbus gateway http --doors claude-code,aos`` in a process of its own. Four rows,
each the p50 / p95 of sequential calls, rounds interleaved (the order rotates each round)
so drift and noise from other processes hit every row alike:

(a) raw ``nc.request`` round trip to the worker process (no hookbus at all: the floor);
(b) ``HookDispatcher.emit("tool:pre", ...)`` in this process, the one remote handler;
(c) ``POST /claude-code`` of a Claude Code PreToolUse input to the gateway: the gateway
    parses it, emits ``tool:pre`` through its dispatcher to the same handler, answers;
(d) ``POST /aos`` of an OWASP AOS ``steps/toolCallRequest`` (JSON-RPC) to the gateway.

HTTP goes over one keep-alive connection per row, written by a minimal HTTP/1.1 client
(`KeepAlive`: one write per request, the answer read by its Content-Length), so the rows
measure the gateway rather than a Python client's own cost; Claude Code's client is not
Python. (c') and (d') send the same requests with httpx (keep-alive too) for comparison:
on a slow machine its pure-Python request path adds a few hundred microseconds per call.
Ratios are against (b); the target is (c) and (d) p50 <= 2x (b). A command, not a test: it
asserts nothing and exits 0 whether the target is met or not (1 only if the run failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

try:
    import httpx
except ImportError:  # not in the gateway extra (the test extra has it): rows (c') (d') left out
    httpx = None
import nats
from _allow_worker import bench_main, serve_allow_all, stop_process
from _measure import Rounds

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import TOOL_PRE

SELF = Path(__file__).resolve()
HANDLER = "bench_gateway_policy"
RAW_SUBJECT = "bench.gateway.raw"
READY = "gateway bench worker ready"
TARGET = 2.0
"""(c) and (d) p50 at most this many times (b)."""

CLAUDE_CODE_INPUT: dict[str, Any] = {
    "session_id": "bench-session",
    "transcript_path": "/tmp/bench.jsonl",
    "cwd": "/work",
    "permission_mode": "default",
    "hook_event_name": "PreToolUse",
    "tool_name": "Bash",
    "tool_input": {"command": "ls -la /tmp"},
}
"""A typical PreToolUse hook input; (b) emits it as the ``tool:pre`` data."""

AOS_REQUEST: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": "bench-1",
    "method": "steps/toolCallRequest",
    "params": {
        "toolCallRequest": {
            "executionId": "exec-1",
            "toolId": "Bash",
            "inputs": [{"name": "command", "value": "ls -la /tmp"}],
        },
        "context": {
            "agent": {
                "id": "bench-agent",
                "name": "bench",
                "instructions": "Run shell commands for the user.",
                "version": "1",
                "provider": {"name": "bench", "url": "https://example.test/"},
            },
            "session": {"id": "bench-session"},
            "turnId": "turn-1",
            "stepId": "step-1",
            "timestamp": "2025-01-24T15:30:45.123Z",
        },
    },
}
"""An OWASP AOS toolCallRequest step (JSON-RPC 2.0)."""


DEFAULT = Rounds(rounds=10, per_round=400, warmup=300)
QUICK = Rounds(rounds=4, per_round=250, warmup=100)


# -- the worker process (this file run with --serve) ------------------------------------------
async def serve(url: str) -> None:
    """One ``tool:pre`` handler that allows every call, and a raw responder, until SIGTERM."""
    await serve_allow_all(
        url, client="gateway-bench-worker", handler=HANDLER, raw_subject=RAW_SUBJECT, ready=READY
    )


# -- processes ---------------------------------------------------------------------------------
async def start(argv: list[str], ready: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start a child; wait for the stderr line holding `ready`; return it and that line."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await proc.stderr.readline()).decode()
                if not line:
                    raise RuntimeError(f"{argv[1]} exited before it was ready:\n{''.join(seen)}")
                seen.append(line)
                if ready in line:
                    break
    except BaseException:
        await stop_process(proc)
        raise
    asyncio.get_running_loop().create_task(_drain(proc.stderr))
    return proc, line


async def _drain(stream: asyncio.StreamReader) -> None:
    async for _ in stream:
        pass


# -- a minimal keep-alive HTTP/1.1 client -------------------------------------------------------
class KeepAlive:
    """One keep-alive HTTP/1.1 connection: ``POST`` with a Content-Length, one write per
    request; the answer's status and body (read by its Content-Length; none: no body)."""

    def __init__(self, base: str) -> None:
        host, _, port = base.removeprefix("http://").rpartition(":")
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> KeepAlive:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await self.reader.readexactly(length) if length else b""


# -- the rows ----------------------------------------------------------------------------------
Call = Callable[[], Awaitable[None]]


def rows(
    nc: nats.NATS,
    dispatcher: HookDispatcher,
    lean: tuple[KeepAlive, KeepAlive],
    clients: tuple[Any, Any] | None,
) -> dict[str, Call]:
    payload = json.dumps(CLAUDE_CODE_INPUT).encode()
    aos_payload = json.dumps(AOS_REQUEST).encode()
    headers = {"content-type": "application/json"}
    cc, aos = clients or (None, None)

    def check_cc(status: int, body: bytes) -> None:
        if status != 200 or body:  # continue = no opinion: 200, empty body
            raise RuntimeError(f"claude-code: {status} {body!r}")

    def check_aos(status: int, body: bytes) -> None:
        if status != 200 or json.loads(body)["result"]["decision"] != "allow":
            raise RuntimeError(f"aos: {status} {body!r}")

    async def raw() -> None:
        await nc.request(RAW_SUBJECT, payload, timeout=5)

    async def emit() -> None:
        result = await dispatcher.emit(TOOL_PRE, dict(CLAUDE_CODE_INPUT))
        if result.failures or result.action != "continue":
            raise RuntimeError(f"emit: {result}")

    async def claude_code() -> None:
        check_cc(*await lean[0].post("/claude-code", payload))

    async def aos_call() -> None:
        check_aos(*await lean[1].post("/aos", aos_payload))

    async def claude_code_httpx() -> None:
        r = await cc.post("/claude-code", content=payload, headers=headers)
        check_cc(r.status_code, r.content)

    async def aos_httpx() -> None:
        r = await aos.post("/aos", content=aos_payload, headers=headers)
        check_aos(r.status_code, r.content)

    calls = {
        "(a) raw nc.request": raw,
        "(b) HookDispatcher.emit": emit,
        "(c) POST /claude-code": claude_code,
        "(d) POST /aos": aos_call,
    }
    if clients is not None:
        calls["(c') /claude-code, httpx"] = claude_code_httpx
        calls["(d') /aos, httpx"] = aos_httpx
    return calls


async def sample(call: Call, n: int, out: list[float]) -> None:
    for _ in range(n):
        started = time.perf_counter()
        await call()
        out.append(time.perf_counter() - started)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(url: str, settings: Rounds) -> int:
    worker, _ = await start([sys.executable, str(SELF), "--serve", "--url", url], READY)
    gateway = None
    try:
        gateway, line = await start(
            [sys.executable, "-m", "hookbus.cli", "gateway", "http", "--doors", "claude-code,aos",
             "--port", "0", "--url", url],
            "hookbus gateway serving ",
        )  # fmt: skip
        base = line.split()[3]
        nc = await nats.connect(url, name="gateway-bench-client")
        try:
            async with (
                HookDispatcher(nc) as dispatcher,
                KeepAlive(base) as lean_cc,
                KeepAlive(base) as lean_aos,
                contextlib.AsyncExitStack() as stack,
            ):
                clients = None
                if httpx is None:
                    print("httpx is not installed: rows (c') and (d') left out (pip install httpx)")
                else:
                    clients = tuple(
                        [await stack.enter_async_context(httpx.AsyncClient(base_url=base,
                                                                           timeout=10))
                         for _ in range(2)]
                    )  # fmt: skip
                await dispatcher.refresh()
                if dispatcher.list_handlers(TOOL_PRE) != {TOOL_PRE: [HANDLER]}:
                    raise RuntimeError(f"tool:pre handlers: {dispatcher.list_handlers(TOOL_PRE)}")
                calls = rows(nc, dispatcher, (lean_cc, lean_aos), clients)
                for call in calls.values():
                    await sample(call, settings.warmup, [])
                samples: dict[str, list[float]] = {name: [] for name in calls}
                names = list(calls)
                for i in range(settings.rounds):
                    order = names[i % len(names) :] + names[: i % len(names)]
                    for name in order:
                        await sample(calls[name], settings.per_round, samples[name])
        finally:
            await nc.drain()
    finally:
        if gateway is not None:
            await stop_process(gateway)
        await stop_process(worker)
    report(samples, settings)
    return 0


def report(samples: dict[str, list[float]], settings: Rounds) -> None:
    n = settings.rounds * settings.per_round
    emit_p50 = statistics.median(samples["(b) HookDispatcher.emit"])
    print(f"gateway benchmark: {n} sequential calls per row, {settings.rounds} rounds interleaved")
    print(f"{'':28}{'p50':>10}{'p95':>10}{'p50 vs (b)':>12}{'target':>9}")
    for name, values in samples.items():
        p50, p95 = statistics.median(values), pct(values, 0.95)
        ratio = p50 / emit_p50
        target = verdict = ""
        if name.startswith(("(c)", "(d)")):
            target = f"<= {TARGET:g}x"
            verdict = "MET" if ratio <= TARGET else "MISSED"
        print(
            f"{name:28}{p50 * 1e6:>7.0f} us{p95 * 1e6:>7.0f} us{ratio:>11.2f}x{target:>9}"
            f"  {verdict}"
        )


def main() -> int:
    return bench_main(__doc__, serve=serve, measure=measure, quick=QUICK, default=DEFAULT)


if __name__ == "__main__":
    sys.exit(main())
