"""One process of `fleet_scale.py`: many agents, each on a NATS connection of its own.

    python benchmarks/_fleet_scale_host.py --url URL --count 1000 --shape embedded \\
        [--agent-id fleet] [--nkey SEED_FILE --inbox-prefix P --ca CA]

Shapes: ``embedded`` (a `HookDispatcher` per agent, deciding in the agent's process) and
``thin`` (no dispatcher: each emit is one request to ``hookbus dispatcher``).

It writes ``{"ready": true}`` first; then commands on stdin, one JSON object per line,
and one JSON answer per line on stdout:

- ``{"op": "start"}``: connect and start every agent (50 at a time); answers
  ``{"ok", "failed", "first_error", "seconds", "rss_mb"}``.
- ``{"op": "emit", "event": E, "cases": [[COMMAND, EXPECTED_ACTION], ...]}``: every agent
  (the first ``limit``, if given)
  emits each case once (at most 100 emits in flight in this process; an expected action
  ``unknown_event`` expects `UnknownEventError`, the service's answer to an event nobody
  handles); answers
  ``{"latencies_ms": [...], "wrong": n, "errors": n, "refused": n, "first": "..."}``
  (``refused``: the service told the agent to send it again: its per-agent rate limit,
  or a replica at its concurrency bound).
- ``{"op": "watch", "event": E, "timeout_s": T}``: embedded agents only: the wall-clock
  time (``time.time``) at which each agent is first seen to route E (checked every
  `WATCH_EVERY_S`); answers ``{"times": [...],
  "missing": n}``.
- ``{"op": "stop"}``: close every agent and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import nats

from hookbus.cli._service_emit import service_emit
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import UnknownEventError

UNKNOWN = "unknown_event"
"""The expected answer of an event with no handler from the dispatcher service (its
events are strict: `UnknownEventError`)."""
REFUSALS = ("answered quota", "answered busy")
"""How a thin agent's emit refused by the service reads (its per-agent rate limit, or a
replica at its concurrency bound, after the client's retries): the tool does not run and
the agent is told to send it again: counted apart, not as wrong."""
START_AT_ONCE = 50
CONNECT_TRIES = 5
CONNECT_TRY_S = 30.0
EMITS_IN_FLIGHT = 100
WATCH_EVERY_S = 0.02
"""How often a watch checks its agents' routing tables: a reach is read up to this late.
(Checking 1,000 tables every 5 ms took most of a core per process: on 2 cores, the
watch itself delayed the changes it timed.)"""


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Host:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.conns: list[Any] = []
        self.agents: list[Any] = []  # a HookDispatcher, or a service emit

    async def _connect(self) -> Any:
        a = self.args
        options: dict[str, Any] = {"max_reconnect_attempts": -1, "connect_timeout": 20}
        if a.nkey:
            options["nkeys_seed"] = a.nkey
            options["inbox_prefix"] = a.inbox_prefix
        if a.ca:
            options["tls"] = ssl.create_default_context(cafile=a.ca)
        for attempt in range(CONNECT_TRIES):
            try:
                # nats-py never returns from a TLS handshake the server cut (closing the
                # half-upgraded socket waits forever): bound each try, then try again
                return await asyncio.wait_for(nats.connect(a.url, **options), CONNECT_TRY_S)
            except TimeoutError:
                if attempt == CONNECT_TRIES - 1:
                    raise
                await asyncio.sleep(1.0 + attempt)
        raise AssertionError("unreachable")

    async def _start_one(self) -> None:
        nc = await self._connect()
        self.conns.append(nc)
        agent_id = self.args.agent_id
        if self.args.distinct_ids:
            agent_id = f"{agent_id}-{self.args.first}-{len(self.conns)}"
        if self.args.shape == "embedded":
            d = HookDispatcher(nc, agent_id=agent_id)
            await d.start()
            self.agents.append(d)
        else:
            self.agents.append(service_emit(nc, agent_id=agent_id))

    async def start(self) -> dict[str, Any]:
        gate = asyncio.Semaphore(START_AT_ONCE)
        failed: list[str] = []
        began = time.monotonic()

        async def one() -> None:
            async with gate:
                try:
                    await self._start_one()
                except Exception as exc:
                    failed.append(f"{type(exc).__name__}: {exc}"[:300])

        await asyncio.gather(*(one() for _ in range(self.args.count)))
        return {
            "ok": len(self.agents),
            "failed": len(failed),
            "first_error": failed[0] if failed else "",
            "seconds": time.monotonic() - began,
            "rss_mb": _rss_mb(),
        }

    async def _emit(self, agent: Any, event: str, data: dict[str, Any]) -> Any:
        if isinstance(agent, HookDispatcher):
            return await agent.emit(event, data, timeout_s=10.0)
        return await agent(event, data)

    async def emit(
        self, event: str, cases: list[list[str]], limit: int | None = None
    ) -> dict[str, Any]:
        gate = asyncio.Semaphore(EMITS_IN_FLIGHT)
        out: dict[str, Any] = {
            "latencies_ms": [], "wrong": 0, "errors": 0, "refused": 0, "first": ""
        }  # fmt: skip

        async def one(agent: Any, command: str, expected: str) -> None:
            async with gate:
                began = time.perf_counter()
                try:
                    result = await self._emit(agent, event, {"tool_input": {"command": command}})
                except Exception as exc:
                    if isinstance(exc, UnknownEventError) and expected == UNKNOWN:
                        out["latencies_ms"].append((time.perf_counter() - began) * 1000.0)
                        return
                    if any(r in str(exc) for r in REFUSALS):  # told to send it again later
                        out["refused"] += 1
                        return
                    out["errors"] += 1
                    out["first"] = out["first"] or f"{type(exc).__name__}: {exc}"[:300]
                    return
                out["latencies_ms"].append((time.perf_counter() - began) * 1000.0)
                if result.action != expected:
                    out["wrong"] += 1
                    out["first"] = out["first"] or f"{command!r}: {result.action} {result.reason}"

        await asyncio.gather(
            *(one(a, command, expected) for a in self.agents[:limit] for command, expected in cases)
        )
        return out

    async def watch(self, event: str, timeout_s: float) -> dict[str, Any]:
        seen: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < len(self.agents) and time.monotonic() < deadline:
            now = time.time()
            for i, d in enumerate(self.agents):
                if i not in seen and d.routes(event):
                    seen[i] = now
            await asyncio.sleep(WATCH_EVERY_S)
        return {"times": list(seen.values()), "missing": len(self.agents) - len(seen)}

    async def stop(self) -> None:
        for agent in self.agents:
            if isinstance(agent, HookDispatcher):
                await agent.close()
        for nc in self.conns:
            await nc.close()


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--shape", choices=("embedded", "thin"), required=True)
    p.add_argument("--agent-id", default="fleet")
    p.add_argument(
        "--distinct-ids",
        action="store_true",
        help="each agent its own id, AGENT_ID-FIRST-N (an open server)",
    )
    p.add_argument("--first", type=int, default=0, help="this process's number")
    p.add_argument("--nkey")
    p.add_argument("--inbox-prefix")
    p.add_argument("--ca")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio")
    return p.parse_args()


async def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.ERROR)
    host = Host(args)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": True}), flush=True)
    while line := await reader.readline():
        ask = json.loads(line)
        op = ask["op"]
        if op == "start":
            answer: Any = await host.start()
        elif op == "emit":
            answer = await host.emit(ask["event"], ask["cases"], ask.get("limit"))
        elif op == "watch":
            answer = await host.watch(ask["event"], ask["timeout_s"])
        else:
            await host.stop()
            print(json.dumps({"stopped": True}), flush=True)
            return
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    arguments_ = arguments()
    if arguments_.loop == "uvloop":
        import uvloop

        uvloop.run(main(arguments_))
    else:
        asyncio.run(main(arguments_))
