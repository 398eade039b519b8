"""pydantic-ai benchmark: the cost of `HookbusCapability` per tool-call step, against the
same agent without it, measured in the same run.

    .venv/bin/python benchmarks/pydantic_ai_bench.py            # about 15 s
    .venv/bin/python benchmarks/pydantic_ai_bench.py --quick    # about 5 s, fewer samples
    .venv/bin/python benchmarks/pydantic_ai_bench.py --url nats://127.0.0.1:4222  # your server

Starts its own nats-server (`hookbus.cli.EmbeddedNatsServer`) unless ``--url`` is given, and
one hookbus worker in a process of its own (this file run with ``--serve``): one ``tool:pre``
handler that answers continue, as a policy that allows the call would.

Two agents, identical but for the capability, run on `FunctionModel` (no network): each run
makes `STEPS` tool-call steps (the model calls one tool, reads its result, calls the next),
then answers. A step's time is the run's time divided by its steps, so it holds one model
request, one tool call and pydantic-ai's own work; the hookbus side adds the capability's
hooks: ``tool:pre`` (a NATS round trip to the worker), ``tool:post`` (no handler: no round
trip), and once per run ``session:start``, ``prompt:submit``, ``prompt:complete`` and
``session:end`` (no handler either), shared out over the steps.

Rounds alternate the two sides (the order flips each round) so drift and noise from other
processes hit both alike; the figure is the median over rounds of each round's mean step.
Also shown: the ``tool:pre`` emit alone (`HookDispatcher.emit`, the capability's data), and
one raw ``nc.request`` round trip to a plain responder in the handler's worker process, the
floor of what ``tool:pre`` adds. Target: the hookbus step at most
1.5x the bare step. A command, not a test: it asserts nothing, and exits 0 whether the target
is met or not (1 only if the run itself failed: a worker not ready, a failed emit).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nats
from _allow_worker import bench_main, serve_allow_all, stop_process
from nats.aio.client import Client as NATS
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from hookbus.dispatcher import HookDispatcher
from hookbus.integrations.pydantic_ai import HookbusCapability
from hookbus.schemas import TOOL_PRE

SELF = Path(__file__).resolve()
STEPS = 20
"""Tool-call steps per agent run."""
HANDLER = "bench_policy"
RAW_SUBJECT = "bench.pydantic_ai.raw"
READY = "pydantic-ai bench worker ready"
TARGET = 1.5
"""The hookbus tool-call step at most this many times the bare one."""


@dataclass(frozen=True)
class Settings:
    rounds: int
    """Rounds; each runs both sides, the order flipping each round."""
    runs: int
    """Agent runs per side per round (each of `STEPS` steps)."""
    warmup: int
    """Unmeasured runs per side first."""
    raw_n: int
    """Raw round trips measured (p50 reported)."""


DEFAULT = Settings(rounds=12, runs=8, warmup=5, raw_n=2000)
QUICK = Settings(rounds=4, runs=5, warmup=3, raw_n=500)


# -- the worker process (this file run with --serve) ------------------------------------------
async def serve(url: str) -> None:
    """One ``tool:pre`` handler that allows every call, and a raw responder, until SIGTERM."""
    await serve_allow_all(
        url,
        client="pydantic-ai-bench-worker",
        handler=HANDLER,
        raw_subject=RAW_SUBJECT,
        ready=READY,
    )


# -- the agents ---------------------------------------------------------------------------------
def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Call `lookup` until `STEPS` tool calls were made, then answer."""
    done = sum(isinstance(m, ModelResponse) for m in messages)
    if done < STEPS:
        return ModelResponse(parts=[ToolCallPart("lookup", {"key": f"k{done}"})])
    return ModelResponse(parts=[TextPart("done")])


def build_agent(capability: HookbusCapability[None] | None) -> Agent[None, str]:
    agent: Agent[None, str] = Agent(
        FunctionModel(model), capabilities=[capability] if capability is not None else []
    )

    @agent.tool_plain
    def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    return agent


async def step_time(agent: Agent[None, str], runs: int) -> float:
    """Mean seconds per tool-call step over `runs` runs."""
    started = time.perf_counter()
    for _ in range(runs):
        result = await agent.run("look the keys up")
        if result.output != "done":
            raise RuntimeError(f"unexpected output {result.output!r}")
    return (time.perf_counter() - started) / (runs * STEPS)


async def raw_p50(nc: NATS, n: int) -> float:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await nc.request(RAW_SUBJECT, b"x" * 200, timeout=5)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def emit_p50(dispatcher: HookDispatcher, n: int) -> float:
    """p50 of the ``tool:pre`` emit alone, with the data the capability sends."""
    data = {
        "run_id": "r",
        "session_id": "bench",
        "tool_name": "lookup",
        "tool_input": {"key": "k0"},
        "tool_call_id": "c",
    }
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        await dispatcher.emit(TOOL_PRE, data, idempotency_key="bench")
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


async def sanity(dispatcher: HookDispatcher) -> None:
    """The capability's tool:pre really reaches the remote handler, and answers continue."""
    if dispatcher.list_handlers(TOOL_PRE) != {TOOL_PRE: [HANDLER]}:
        raise RuntimeError(f"tool:pre handlers: {dispatcher.list_handlers(TOOL_PRE)}")
    result = await dispatcher.emit(TOOL_PRE, {"tool_name": "lookup", "tool_input": {}})
    if result.action not in ("continue", "modify") or result.failures:
        raise RuntimeError(f"tool:pre did not answer continue: {result}")


async def measure(url: str, settings: Settings) -> int:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SELF),
        "--serve",
        "--url",
        url,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            while READY not in (line := (await proc.stderr.readline()).decode()):
                if not line:
                    raise RuntimeError("the worker process exited before it was ready")
        nc = await nats.connect(url, name="pydantic-ai-bench-agent")
        try:
            async with HookDispatcher(nc, agent_id="bench-agent") as dispatcher:
                await dispatcher.refresh()
                await sanity(dispatcher)
                bare = build_agent(None)
                hooked = build_agent(HookbusCapability(dispatcher, session_id="bench"))
                await step_time(bare, settings.warmup)
                await step_time(hooked, settings.warmup)
                bare_s: list[float] = []
                hooked_s: list[float] = []
                for i in range(settings.rounds):
                    sides = [(bare, bare_s), (hooked, hooked_s)]
                    for agent, out in sides if i % 2 == 0 else sides[::-1]:
                        out.append(await step_time(agent, settings.runs))
                raw = await raw_p50(nc, settings.raw_n)
                emit = await emit_p50(dispatcher, settings.raw_n)
                await sanity(dispatcher)
        finally:
            await nc.drain()
    finally:
        await stop_process(proc)
    b, h = statistics.median(bare_s), statistics.median(hooked_s)
    ratio = h / b
    steps = settings.rounds * settings.runs * STEPS
    print(f"pydantic-ai {_version()}, {steps} tool-call steps per side, {settings.rounds} rounds")
    print(f"{'':34}{'per step':>12}{'ratio':>9}{'target':>9}")
    print(f"{'bare agent (no capability)':34}{b * 1e6:>9.0f} us{'1.00x':>9}")
    verdict = "MET" if ratio <= TARGET else "MISSED"
    print(
        f"{'HookbusCapability, 1 remote handler':34}{h * 1e6:>9.0f} us{ratio:>8.2f}x"
        f"{'<= ' + str(TARGET) + 'x':>9}  {verdict}"
    )
    print(f"{'  added per tool call':34}{(h - b) * 1e6:>9.0f} us")
    print(f"{'  tool:pre emit alone (p50)':34}{emit * 1e6:>9.0f} us")
    print(f"{'  raw nc.request round trip (p50)':34}{raw * 1e6:>9.0f} us  (the floor of tool:pre)")
    return 0


def _version() -> str:
    return importlib.metadata.version("pydantic-ai-slim")


def main() -> int:
    return bench_main(__doc__, serve=serve, measure=measure, quick=QUICK, default=DEFAULT)


if __name__ == "__main__":
    sys.exit(main())
