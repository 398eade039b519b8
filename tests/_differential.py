"""The differential judge: every fast path of `HookDispatcher` against the one-by-one reference.

A *case* is a handler set (1-8 handlers over 1-3 worker processes, each process run as 1 or 2
replicas) with priorities, results, tool filters, flags and failure policies, plus at most
one *fault*. Each case runs through a real nats-server with every fast path on
(``HookDispatcher(nc)``: chain requests, speculation of pure handlers, hedging, parallel
groups) and is compared with the reference: the handlers called one by one in priority
order, each with its failure policy. The reference is computed twice where it can be:

- the *model*: an in-process ``HookDispatcher()`` whose `register`-ed handlers behave as the
  remote ones and where the fault's effect is made explicit (the handler a killed replica
  was running fails under its policy; later handlers of that process fail only when no
  replica is left; a handler past the caller's deadline fails as ``timeout``);
- ``HookDispatcher(nc, chains=False)`` over NATS with the same workers (and, to confirm a
  divergence under a signal, with the same fault applied to the same handler).

Worker replicas live in a pool of long-lived *host* processes (``python _differential.py
host ...``): each serves one case's handlers on request (a fresh event name per case) and is
replaced in the background when a fault kills it. A handler at the fault's step announces
``started`` on a NATS subject before it holds for a moment, so the signal lands while it runs.
Every handler run is announced too (``ran``, with the emit it belongs to): a handler that is
neither ``retry_safe`` nor ``pure`` and runs twice for one emit is a divergence, whatever the
decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from _proxy import NatsProxy
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hookbus._core.buckets import handlers_bucket_config
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HookReply,
    HookResult,
    collect_subject,
    encode,
    handler_key,
)

__all__ = [
    "Case",
    "CaseReport",
    "Fault",
    "Harness",
    "Spec",
    "cases",
    "drawn_cases",
    "format_report",
    "record_findings",
]

KINDS = (
    "continue", "continue", "deny", "modify", "modify", "retool", "inject", "ask", "none",
    "raise", "deny_fresh", "opaque",
)  # fmt: skip
"""What a handler does. ``modify`` appends its name to ``data["trail"]``; ``retool`` does
that and swaps ``tool_name`` (any spelling of bash -> ``Write``, else ``BASH``: the chained
data changes case, and filters match ignoring case); ``deny``, ``inject`` and ``ask`` quote
the trail they saw (a result computed on stale data differs); ``deny_fresh`` denies only
data no handler modified yet; ``none`` returns None; ``raise`` raises; ``opaque`` modifies
with an object JSON cannot carry in the data (converted to its ``str()`` as amplifier-core
converts a handler's result, in process and by a worker alike)."""
PACES = ("now",) * 16 + ("jitter", "slow", "sometimes", "cpu", "blocking")
"""How a handler takes its time (see `Spec.pace`); at most one handler of a case has a
`TIMED_PACES` pace (`settle`)."""
TIMED_PACES = ("sometimes", "cpu", "blocking")
PACED_S, PACED_TIMEOUT_S = 1.2, 12.0
"""A ``sometimes`` handler awaits, a ``cpu`` one computes and a ``blocking`` one blocks this
long: longer than any other handler's timeout, ten times less than its own."""
FILTERS: tuple[tuple[str, ...] | None, ...] = (
    None, None, ("bash",), ("b*",), ("write",), ("zz",), ("BASH",), ("W*",), ("Bash", "zz"),
)  # fmt: skip
"""Tool filters; the mixed-case ones match the tool names of `TOOLS` ignoring case."""
TOOLS = ("bash", "write", "Bash", "WRITE")
"""Initial tool names: lower case, and as Claude Code and other agents spell them."""
FAULTS = (
    "none", "none", "kill", "kill", "term", "stop", "deadline", "deadline", "redeclare",
    "rogue", "pause",
)  # fmt: skip
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}

TIMEOUT_S = 1.0
"""A handler's timeout (twenty times a round trip on a busy two-core machine)."""
SLOW_TIMEOUT_S, SLOW_SLEEP_S = 0.15, 0.35
"""A ``slow`` handler sleeps past its timeout (a ``timeout`` failure)."""
VICTIM_TIMEOUT_S, VICTIM_HOLD_S = 2.0, 0.15
"""The handler at a signal's step holds this long after it announced itself, within a
timeout more than ten times that (at load 5 on two cores, 1.2 s was once too little)."""
HEDGED_TIMEOUT_S = 3.0
"""The timeout of a ``retry_safe`` handler whose replica a fault stops while a second one
serves it: the dispatcher hedges after a quarter of it, on a cold start after asking the
workers where they are (0.5 s), so the live replica's answer has ten times its round trip
on a busy machine."""
DEADLINE_S, DEADLINE_HOLD_S, DEADLINE_TIMEOUT_S = 1.0, 2.5, 5.0
"""A caller deadline: the emit's ``timeout_s``, and the handler at the step holds past it.
The handlers before that step answer at once: wide enough for their round trips on a busy
machine (at load 20 on two cores, a few answered in 0.26 s against a 0.3 s deadline)."""
DELAYS = (0.0,) * 16 + (0.1, 0.3, 0.5)
"""One-way delays (seconds) of the link between a case's workers and the server (a hop
between sites), added by a proxy to every message both ways while the case's emits run."""
DELAY_TIMEOUT_FACTOR = 20.0
"""Under a delay, a handler's timeout is at least this many delays: ten round trips."""
MAX_DELAYED_HOSTS = 4
"""Most worker hosts of a delayed case (the pool behind the proxy)."""
SKEWS = (0.0,) * 4 + (3600.0, -3600.0)
"""Seconds a case's worker hosts' wall clocks are off (``time.time`` in that process)."""
HOST_SCRIPT = str(Path(__file__).resolve())
"""Run as ``python HOST_SCRIPT host URL PREFIX ID``: a worker host of the pool."""
TERM_GRACE_S = 5.0
"""A host's drain grace on SIGTERM: the handler it runs finishes."""
PAUSE_SETTLE_S = 1.0
"""Seconds a paused replica runs on after it is resumed, before the runs are counted (it
reads every request held for it at once)."""


# -- the case space ---------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One handler of a case."""

    name: str
    proc: int
    priority: int
    kind: str
    tool_filter: tuple[str, ...] | None = None
    pure: bool = False
    parallel: bool = False
    retry_safe: bool = False
    policy: str = "ignore"
    pace: str = "now"
    """``now``; ``jitter`` (sleeps a few ms); ``slow`` (sleeps past its timeout);
    ``sometimes`` (awaits `PACED_S` only on data an earlier handler modified: the pace of a
    cache that misses on some inputs); ``cpu`` (computes `PACED_S` without awaiting);
    ``blocking`` (a sync handler, run in a thread, that blocks `PACED_S`)."""
    timeout_s: float = TIMEOUT_S
    hold_s: float = 0.0
    """Seconds it holds after announcing ``started`` (the fault's step only)."""

    @property
    def order(self) -> tuple[int, str]:
        return (self.priority, self.name)


@dataclass(frozen=True)
class Fault:
    """At most one fault per case.

    ``kill`` / ``term`` / ``stop``: SIGKILL, SIGTERM (graceful drain) or SIGSTOP of the replica
    running the handler at `step` (index in call order) while it runs; ``deadline``: the
    caller's ``emit(..., timeout_s=DEADLINE_S)`` expires while that handler runs;
    ``redeclare``: a second version of the step handler's worker process is started with
    ``replace=True``, changing that handler's tool filter or priority, both versions up;
    ``rogue``: the step's handler and the next made parallel, and a peer on the event's
    collect subject (``emit_and_collect``'s, which an emit must never use) that answers what
    it hears with a deny in every handler's name; hearing anything is a divergence;
    ``pause``: one of the two replicas of the step handler's process is SIGSTOPped before
    the case's emits read anything and resumed (SIGCONT) after them: each call the queue
    group gave it is lost (a handler that is not ``retry_safe`` fails under its policy,
    any subset of them may), and what it reads once resumed must not run a second time.
    """

    kind: str = "none"
    step: int = 0
    change: str = ""
    """``redeclare``: ``filter`` or ``priority``."""
    new_filter: tuple[str, ...] | None = None
    new_priority: int = 0


@dataclass(frozen=True)
class Case:
    handlers: tuple[Spec, ...]
    replicas: tuple[int, ...]
    tool: str = "bash"
    fault: Fault = Fault()
    delay_s: float = 0.0
    """One-way delay of the workers' link to the server (`DELAYS`)."""
    skew_s: float = 0.0
    """How far the workers' wall clocks are off (`SKEWS`)."""

    def ordered(self) -> list[Spec]:
        """The handlers in call order (priority, then name: remote ties go by name)."""
        return sorted(self.handlers, key=lambda s: s.order)

    @property
    def victim(self) -> Spec:
        return self.ordered()[self.fault.step]

    def declared(self) -> Case:
        """The case as the registry holds it once a redeclaration is done (the second
        version's settings)."""
        if self.fault.kind != "redeclare":
            return self
        v, f = self.victim, self.fault
        new = (
            dataclasses.replace(v, tool_filter=f.new_filter)
            if f.change == "filter"
            else dataclasses.replace(v, priority=f.new_priority)
        )
        handlers = tuple(new if s.name == v.name else s for s in self.handlers)
        return dataclasses.replace(self, handlers=handlers, fault=Fault())

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> Case:
        raw = json.loads(text) if isinstance(text, str) else text
        specs = tuple(
            Spec(**{**h, "tool_filter": _tuple(h.get("tool_filter"))}) for h in raw["handlers"]
        )
        f = raw.get("fault") or {}
        fault = Fault(**{**f, "new_filter": _tuple(f.get("new_filter"))})
        return cls(
            specs, tuple(raw["replicas"]), raw.get("tool", "bash"), fault,
            raw.get("delay_s", 0.0), raw.get("skew_s", 0.0),
        )  # fmt: skip


def _tuple(v: Any) -> tuple[str, ...] | None:
    return None if v is None else tuple(v)


def cases() -> Any:
    """The hypothesis strategy of cases (see `Case`, `Spec`, `Fault`)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw: Any) -> Case:
        n_procs = draw(st.sampled_from((1, 1, 2, 2, 3)))  # few processes: long chains
        replicas = tuple(draw(st.integers(1, 2)) for _ in range(n_procs))
        safe = [draw(st.booleans()) for _ in range(n_procs)]  # a chain needs one value
        n = draw(st.integers(1, 8))
        names = draw(st.permutations([f"h{c}" for c in "abcdefgh"]))[:n]
        specs = []
        for name in names:
            pure = draw(st.sampled_from((False, False, False, True)))
            proc = draw(st.integers(0, n_procs - 1))
            specs.append(
                Spec(
                    name=name,
                    proc=proc,
                    priority=draw(st.integers(0, 3)),
                    kind=draw(st.sampled_from(KINDS)),
                    tool_filter=draw(st.sampled_from(FILTERS)),
                    pure=pure,
                    parallel=draw(st.sampled_from((False, False, False, True))),
                    retry_safe=pure or safe[proc],
                    policy=draw(st.sampled_from(("ignore", "deny"))),
                    pace=draw(st.sampled_from(PACES)),
                )
            )
        fault = Fault(
            kind=draw(st.sampled_from(FAULTS)),
            step=draw(st.integers(0, n - 1)),
            change=draw(st.sampled_from(("filter", "priority"))),
            new_filter=draw(st.sampled_from(FILTERS)),
            new_priority=draw(st.integers(0, 3)),
        )
        case = Case(
            tuple(specs), replicas, draw(st.sampled_from(TOOLS)), fault,
            draw(st.sampled_from(DELAYS)), draw(st.sampled_from(SKEWS)),
        )  # fmt: skip
        return settle(case)

    return build()


def drawn_cases(n: int, seed: int | None = None) -> list[Case]:
    """The first `n` distinct cases hypothesis draws from `cases` (derandomized: the same
    list every run; or from `seed`). Repeats are skipped so every case run is new."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    found: dict[str, Case] = {}

    @settings(
        max_examples=max(2 * n, n + 50),
        derandomize=seed is None,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def draw(case: Case) -> None:
        if len(found) < n:
            found.setdefault(case.to_json(), case)

    if seed is not None:
        draw = seeded(seed)(draw)
    draw()
    return list(found.values())


def settle(case: Case) -> Case:
    """The case made deterministic for its fault (a pure function of the drawn case).

    The step's handler gets its hold and timeout. A signalled replica's process must have
    no other handler in the victim's parallel run or among pure handlers (the queue group
    would pick a replica at random for them); under SIGSTOP with two replicas, every
    handler of that process from the step on must be ``retry_safe`` (else: one replica).
    Under a deadline nothing else sleeps.
    """
    case = _delayed(_one_timed_pace(case))
    f = case.fault
    if f.kind == "rogue":
        return _scattered(case)
    if f.kind in ("none", "redeclare"):
        return case
    if f.kind == "pause":
        return _paused(case)
    order = case.ordered()
    victim = order[f.step]
    hold = DEADLINE_HOLD_S if f.kind == "deadline" else VICTIM_HOLD_S
    timeout = DEADLINE_TIMEOUT_S if f.kind == "deadline" else VICTIM_TIMEOUT_S
    new_victim = dataclasses.replace(
        victim, pace="now", hold_s=hold, timeout_s=timeout, tool_filter=None
    )
    replicas = list(case.replicas)
    if f.kind in SIGNALS:
        same = [s for s in order if s.proc == victim.proc and s.name != victim.name]
        if victim.parallel and any(s.name != victim.name for s in _parallel_run(order, f.step)
                                   if s.proc == victim.proc):  # fmt: skip
            new_victim = dataclasses.replace(new_victim, parallel=False)
        if victim.pure and any(s.pure for s in same):
            new_victim = dataclasses.replace(new_victim, pure=False, retry_safe=True)
        later = [s for s in order[f.step :] if s.proc == victim.proc]
        if f.kind == "stop" and not all(
            (new_victim if s.name == victim.name else s).retry_safe for s in later
        ):
            replicas[victim.proc] = 1
    hedged = f.kind in SIGNALS and replicas[victim.proc] == 2
    handlers = []
    for s in case.handlers:
        if s.name == victim.name:
            s = new_victim
        elif f.kind == "deadline":
            s = dataclasses.replace(s, pace="now")
        if hedged and s.proc == victim.proc and s.retry_safe and s.pace not in TIMED_PACES:
            s = dataclasses.replace(s, timeout_s=max(s.timeout_s, HEDGED_TIMEOUT_S))
        handlers.append(s)
    return dataclasses.replace(case, handlers=tuple(handlers), replicas=tuple(replicas))


def _paused(case: Case) -> Case:
    """`case` with two replicas of the step handler's process, whose handlers take no time
    (each call lost to the paused replica costs its timeout, per path); its ``retry_safe``
    ones get `HEDGED_TIMEOUT_S` (hedged to the live replica)."""
    proc = case.victim.proc
    replicas = list(case.replicas)
    replicas[proc] = 2
    handlers = tuple(
        dataclasses.replace(
            s, pace="now", timeout_s=HEDGED_TIMEOUT_S if s.retry_safe else s.timeout_s
        )
        if s.proc == proc
        else s
        for s in case.handlers
    )
    return dataclasses.replace(case, handlers=handlers, replicas=tuple(replicas))


def pausable(case: Case) -> list[str]:
    """Handlers a ``pause`` case may lose to the paused replica: its process's handlers
    that are not ``retry_safe`` (a retry_safe one is called again on the other replica)."""
    if case.fault.kind != "pause":
        return []
    proc = case.victim.proc
    return [s.name for s in case.declared().ordered() if s.proc == proc and not s.retry_safe]


def _delayed(case: Case) -> Case:
    """`case` with its delay kept only where no timing is part of the case (no fault, or a
    redeclaration) and its hosts fit the delayed pool; then every handler's timeout is at
    least `DELAY_TIMEOUT_FACTOR` delays (a ``slow`` one times out whatever the delay)."""
    if not case.delay_s:
        return case
    hosts = sum(case.replicas) + (case.fault.kind == "redeclare")
    if case.fault.kind not in ("none", "redeclare") or hosts > MAX_DELAYED_HOSTS:
        return dataclasses.replace(case, delay_s=0.0)
    floor = DELAY_TIMEOUT_FACTOR * case.delay_s
    handlers = tuple(
        dataclasses.replace(s, timeout_s=max(s.timeout_s, floor)) for s in case.handlers
    )
    return dataclasses.replace(case, handlers=handlers)


def _one_timed_pace(case: Case) -> Case:
    """`case` with a `TIMED_PACES` pace on its first such handler only (the others ``now``):
    each costs `PACED_S` per run."""
    seen = False
    handlers = []
    for s in case.handlers:
        if s.pace in TIMED_PACES:
            if seen:
                s = dataclasses.replace(s, pace="now")
            seen = True
        handlers.append(s)
    return dataclasses.replace(case, handlers=tuple(handlers))


def _scattered(case: Case) -> Case:
    """A rogue case: the step's handler and the next one in order made parallel (a group a
    rogue peer can answer for)."""
    order = case.ordered()
    pair = {s.name for s in order[case.fault.step : case.fault.step + 2]}
    handlers = tuple(
        dataclasses.replace(s, parallel=True) if s.name in pair else s for s in case.handlers
    )
    return dataclasses.replace(case, handlers=handlers)


def _parallel_run(order: list[Spec], i: int) -> list[Spec]:
    """The adjacent sequence of parallel handlers holding `order[i]` (itself if not parallel)."""
    if not order[i].parallel:
        return [order[i]]
    lo = i
    while lo > 0 and order[lo - 1].parallel:
        lo -= 1
    hi = i
    while hi + 1 < len(order) and order[hi + 1].parallel:
        hi += 1
    return order[lo : hi + 1]


def initial_data(case: Case, emit: str | None = None) -> dict[str, Any]:
    """The data a case's emits start with; `emit` names the emit (the handlers' ``ran``
    announcements carry it)."""
    data: dict[str, Any] = {"tool_name": case.tool, "trail": [], "tool_input": {"command": "ls"}}
    if emit is not None:
        data["emit"] = emit
    return data


# -- what a handler does (the same function remote and in the reference) ------------------------
def behave(spec: Spec, data: dict[str, Any]) -> HookResult | None:
    """A handler's answer to `data`, a pure function of both (raises for ``raise``)."""
    trail = list(data.get("trail") or [])
    kind = spec.kind
    if kind == "deny":
        return HookResult(action="deny", reason=f"{spec.name} denies after {trail}")
    if kind == "deny_fresh":
        if not trail:
            return HookResult(action="deny", reason=f"{spec.name}: unmodified data")
        return HookResult(action="continue")
    if kind in ("modify", "retool"):
        new = {**data, "trail": [*trail, spec.name]}
        if kind == "retool":
            tool = data.get("tool_name")
            new["tool_name"] = "Write" if str(tool).casefold() == "bash" else "BASH"
        return HookResult(action="modify", data=new)
    if kind == "inject":
        return HookResult(action="inject_context", context_injection=f"{spec.name} saw {trail}")
    if kind == "ask":
        return HookResult(action="ask_user", approval_prompt=f"{spec.name} asks after {trail}")
    if kind == "opaque":
        return HookResult(
            action="modify", data={**data, "trail": [*trail, spec.name], "found": Opaque(spec)}
        )
    if kind == "none":
        return None
    if kind == "raise":
        raise RuntimeError(f"{spec.name} raises")
    return HookResult(action="continue")


class Opaque:
    """An object JSON cannot carry; its ``str()`` is what a handler's data holds instead."""

    def __init__(self, spec: Spec) -> None:
        self.name = spec.name

    def __str__(self) -> str:
        return f"opaque object of {self.name}"


def remote_handler(
    spec: Spec,
    announce: Callable[[str], Awaitable[None]],
    ran: Callable[[str, Any], None] = lambda name, emit: None,
) -> Callable[[str, dict[str, Any]], Any]:
    """The handler a host serves: say it ran (`ran`, any thread), announce and hold (the
    fault's step), take its pace, behave (a ``blocking`` one is a sync function)."""

    async def handle(event: str, data: dict[str, Any]) -> HookResult | None:
        ran(spec.name, data.get("emit"))
        if spec.hold_s:
            await announce(spec.name)
            await asyncio.sleep(spec.hold_s)
        if spec.pace == "jitter":
            await asyncio.sleep(0.003 + (hash(spec.name) % 5) / 1000)
        elif spec.pace == "slow":
            await asyncio.sleep(SLOW_SLEEP_S)
        elif spec.pace == "sometimes" and data.get("trail"):
            await asyncio.sleep(PACED_S)
        elif spec.pace == "cpu":
            end = time.monotonic() + PACED_S
            while time.monotonic() < end:  # holds the worker's event loop
                pass
        return behave(spec, data)

    def blocking(event: str, data: dict[str, Any]) -> HookResult | None:
        ran(spec.name, data.get("emit"))
        time.sleep(PACED_S)  # a blocking library call: the worker runs it in a thread
        return behave(spec, data)

    handle.__name__ = blocking.__name__ = spec.name
    return blocking if spec.pace == "blocking" and not spec.hold_s else handle


def timeout_of(spec: Spec) -> float:
    """`spec`'s declared timeout, seconds (its pace's, if it has one)."""
    if spec.pace == "slow":
        return SLOW_TIMEOUT_S
    if spec.pace in TIMED_PACES:
        return PACED_TIMEOUT_S
    return spec.timeout_s


def declare_options(spec: Spec) -> dict[str, Any]:
    """`HookWorker.add_handler` options of `spec`."""
    return {
        "name": spec.name,
        "priority": spec.priority,
        "tool_filter": None if spec.tool_filter is None else list(spec.tool_filter),
        "timeout_s": timeout_of(spec),
        "failure_policy": spec.policy,
        "parallel": spec.parallel,
        "retry_safe": spec.retry_safe,
        "pure": spec.pure,
    }


# -- the reference model: one by one, in process, the fault made explicit ----------------------
class FaultModel:
    """Which handler calls fail because of the case's fault, decided as the reference runs.

    The step's handler fires the fault when it is called. Then: under a deadline it fails as
    ``timeout`` and so does every later handler the fold reaches (past its parallel run);
    under a signal it fails unless it is ``retry_safe`` with a second replica to hedge to
    (SIGKILL, SIGSTOP) or the drain lets it finish (SIGTERM), and later handlers of its
    process fail only if it had one replica.
    """

    def __init__(self, case: Case) -> None:
        self.case = case
        self.fired = False
        self.loose: set[str] = set()
        """Handlers whose failure kind is not determined (a signal's doing)."""
        order = case.ordered()
        self.index = {s.name: i for i, s in enumerate(order)}
        f = case.fault
        self.active = f.kind in SIGNALS or f.kind == "deadline"
        if self.active:
            self.victim = order[f.step]
            self.run_end = self.index[_parallel_run(order, f.step)[-1].name]

    def outcome(self, spec: Spec) -> str:
        """``fail`` (made explicit), ``timeout`` or ``ok`` for a call of `spec` now."""
        if not self.active:
            return "ok"
        f, v = self.case.fault, self.victim
        two = self.case.replicas[v.proc] == 2
        if spec.name == v.name:
            self.fired = True
            if f.kind == "deadline":
                return "timeout"
            if f.kind == "term" or (spec.retry_safe and two):
                return "ok"
            self.loose.add(spec.name)
            return "fail"
        if not self.fired:
            return "ok"
        i = self.index[spec.name]
        if f.kind == "deadline":
            return "timeout" if i > self.run_end else "ok"
        if spec.proc == v.proc and i > self.index[v.name] and not two:
            self.loose.add(spec.name)
            return "fail"
        return "ok"


def reference_handler(
    spec: Spec, model: FaultModel, lost: frozenset[str] = frozenset()
) -> Callable[..., Awaitable[Any]]:
    async def handle(event: str, data: dict[str, Any]) -> HookResult | None:
        outcome = "fail" if spec.name in lost else model.outcome(spec)
        if outcome == "fail":
            raise RuntimeError(f"{spec.name}: lost to the fault")
        if outcome == "timeout" or spec.pace == "slow":
            raise TimeoutError  # with a timeout set, call_local reports kind "timeout"
        return behave(spec, data)

    handle.__name__ = spec.name
    return handle


async def reference(
    case: Case, event: str, *, faulted: bool, lost: frozenset[str] = frozenset()
) -> tuple[HookResult, set[str]]:
    """The model's result for `case` (its declared settings), with or without its fault,
    and the handlers whose failure kind is not determined; the handlers in `lost` fail
    (their calls lost to a paused replica)."""
    declared = case.declared()
    if not faulted:
        declared = dataclasses.replace(declared, fault=Fault())
    model = FaultModel(declared)
    d = HookDispatcher()
    for spec in declared.ordered():
        d.register(
            event,
            reference_handler(spec, model, lost),
            spec.priority,
            spec.name,
            timeout_s=timeout_of(spec),
            failure_policy=spec.policy,  # type: ignore[arg-type]
            tool_filter=None if spec.tool_filter is None else list(spec.tool_filter),
            parallel=spec.parallel,
        )
    return await d.emit(event, initial_data(case)), model.loose | lost


async def references(case: Case, event: str) -> list[dict[str, Any]]:
    """Every decision the model allows `case` without a signal: one, or for a ``pause``
    case one per subset of `pausable` handlers whose calls were lost."""
    names = pausable(case)
    out = []
    for subset in itertools.chain.from_iterable(
        itertools.combinations(names, k) for k in range(len(names) + 1)
    ):
        lost = frozenset(subset)
        result, loose = await reference(case, event, faulted=False, lost=lost)
        out.append(summary(result, loose | set(names)))
    return out


# -- comparing decisions ------------------------------------------------------------------------
def summary(r: HookResult, loose: set[str]) -> dict[str, Any]:
    """What must agree: action, decider, reason (unless a failure decided), chained data,
    injections, modifiers, ask_user prompt, failures (handler, policy, kind where known)."""
    failed_closed = any(f.handler == r.decided_by and f.policy == "deny" for f in r.failures)
    data = dict(r.chained_data or {})
    data.pop("timestamp", None)
    data.pop("emit", None)  # which emit it was (`initial_data`)
    return {
        "action": r.action,
        "decided_by": r.decided_by,
        "reason": None if failed_closed else r.reason,
        "data": data,
        "context": r.context_injection,
        "injections": [(i.hook_name, i.content) for i in r.context_injections],
        "modified_by": list(r.modified_by),
        "prompt": r.approval_prompt,
        "failures": [
            (f.handler, f.policy, None if f.handler in loose else f.kind) for f in r.failures
        ],
    }


def differences(expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    return [
        f"{k}: expected {expected[k]!r}, got {got[k]!r}" for k in expected if expected[k] != got[k]
    ]


@dataclass
class Divergence:
    path: str
    """Which run: ``fast`` (fast paths, first emit), ``fast-warm`` (again, replicas known),
    ``one-by-one`` (chains=False over NATS), ``fast+fault``, ``one-by-one+fault``."""
    expected: dict[str, Any]
    got: dict[str, Any]
    diffs: list[str]


@dataclass
class CaseReport:
    case: Case
    index: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    signalled: bool = False


# -- worker hosts -----------------------------------------------------------------------------
_REAL_TIME = time.time
"""This process's true wall clock (a host skews ``time.time`` per case)."""


async def host_main(url: str, prefix: str, host_id: str) -> None:
    """A long-lived worker host: serves one case's handlers at a time on request."""
    ctl = await nats.connect(url, max_reconnect_attempts=2)
    current: dict[str, Any] = {}

    loop = asyncio.get_running_loop()

    async def announce(name: str) -> None:
        await ctl.publish(f"{prefix}.started", json.dumps([host_id, name]).encode())

    def ran(name: str, emit: Any) -> None:  # from the loop or a handler's thread
        body = json.dumps([host_id, name, emit]).encode()
        asyncio.run_coroutine_threadsafe(ctl.publish(f"{prefix}.ran", body), loop)

    async def stop() -> None:
        w, conn = current.pop("worker", None), current.pop("nc", None)
        if w is not None:
            with contextlib.suppress(Exception):
                await w.shutdown(grace_s=0)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def serve(cmd: dict[str, Any]) -> dict[str, Any]:
        from hookbus.workers import HookWorker

        await stop()
        skew = float(cmd.get("skew_s", 0.0))  # this process's wall clock, for this case
        time.time = (lambda: _REAL_TIME() + skew) if skew else _REAL_TIME  # type: ignore[assignment]
        conn = await nats.connect(url, max_reconnect_attempts=2)
        w = HookWorker(conn, replace=cmd["replace"])
        for raw in cmd["handlers"]:
            spec = Spec(**{**raw, "tool_filter": _tuple(raw["tool_filter"])})
            w.add_handler(
                cmd["event"], remote_handler(spec, announce, ran), **declare_options(spec)
            )
        current.update(worker=w, nc=conn)
        await w.start()
        return {"instance": w.instance, "pid": os.getpid()}

    async def on_ctl(msg: Msg) -> None:
        cmd = json.loads(msg.data)
        try:
            out = await serve(cmd) if cmd["op"] == "serve" else (await stop()) or {}
        except Exception as exc:
            out = {"error": repr(exc)}
        await msg.respond(json.dumps(out).encode())

    done = asyncio.Event()

    async def terminate() -> None:
        w = current.get("worker")
        if w is not None:
            await w.shutdown(grace_s=TERM_GRACE_S)
        done.set()

    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: asyncio.ensure_future(terminate())
    )
    await ctl.subscribe(f"{prefix}.host.{host_id}", cb=on_ctl)
    await ctl.flush()
    print("ready", flush=True)
    await done.wait()
    await stop()
    with contextlib.suppress(Exception):
        await ctl.close()


class Host:
    """One host process of a pool."""

    def __init__(self, host_id: str, proc: asyncio.subprocess.Process, pool: HostPool) -> None:
        self.id = host_id
        self.proc = proc
        self.pool = pool

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    async def retire(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.proc.wait(), 10)


class HostPool:
    """Long-lived worker hosts; a retired one is replaced in the background."""

    def __init__(self, url: str, prefix: str, size: int, tag: str = "") -> None:
        self.url, self.prefix, self.size, self.tag = url, prefix, size, tag
        self.ready: asyncio.Queue[Host] = asyncio.Queue()
        self._n = 0
        self._spawning: set[asyncio.Task[None]] = set()
        self.all: set[Host] = set()

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn() for _ in range(self.size)))

    async def _spawn(self) -> None:
        self._n += 1
        host_id = f"{self.tag}{self._n}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, HOST_SCRIPT, "host", self.url, self.prefix, host_id,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        host = Host(host_id, proc, self)
        self.all.add(host)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if b"ready" not in line:
            raise RuntimeError(f"host {host_id} did not start")
        await self.ready.put(host)

    async def acquire(self, n: int) -> list[Host]:
        return [await asyncio.wait_for(self.ready.get(), 60) for _ in range(n)]

    def replace(self, host: Host) -> None:
        """Retire `host` and start another in the background."""
        self.all.discard(host)

        async def swap() -> None:
            await host.retire()
            await self._spawn()

        task = asyncio.create_task(swap())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def close(self) -> None:
        for task in list(self._spawning):
            with contextlib.suppress(BaseException):
                await task
        await asyncio.gather(*(h.retire() for h in list(self.all)))


# -- the harness ------------------------------------------------------------------------------
class Harness:
    """Runs cases: a pool of hosts, a fast dispatcher and a one-by-one dispatcher."""

    def __init__(self, url: str, pool_size: int = 8) -> None:
        self.url = url
        self.prefix = f"hbdiff.{uuid.uuid4().hex[:8]}"
        self.pool = HostPool(url, self.prefix, pool_size)
        self.proxy = NatsProxy(url)
        """The delayed link: hosts of `far` connect through it (latency set per case)."""
        self.far: HostPool | None = None
        self.conns: list[NATS] = []
        self.armed: tuple[str, str, str] | None = None
        """(event, victim, fault kind) while a faulted emit runs."""
        self.hosts: dict[str, Host] = {}
        self.signalled: Host | None = None
        self.cases_run = 0
        self.rogue_heard: list[str] = []
        """Subjects of the requests the rogue peer of the running case heard."""
        self.runs: dict[tuple[str, str], int] = {}
        """Runs per (emit, handler), from the hosts' ``ran`` announcements."""

    async def start(self) -> None:
        nc_ctl, nc_fast, nc_ref = [await self._connect() for _ in range(3)]
        self.ctl = nc_ctl
        self.fast = HookDispatcher(nc_fast, approvals=False)
        self.ref = HookDispatcher(nc_ref, approvals=False, chains=False)
        await self.fast.start()
        await self.ref.start()
        self.kv = await nc_ctl.jetstream().key_value(handlers_bucket_config().bucket)
        await nc_ctl.subscribe(f"{self.prefix}.started", cb=self._on_started)
        await nc_ctl.subscribe(f"{self.prefix}.ran", cb=self._on_ran)
        await self.proxy.start()
        self.far = HostPool(self.proxy.url, self.prefix, MAX_DELAYED_HOSTS, tag="far")
        await asyncio.gather(self.pool.start(), self.far.start())

    async def _connect(self) -> NATS:
        conn = await nats.connect(self.url, max_reconnect_attempts=2)
        self.conns.append(conn)
        return conn

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.fast.close()
            await self.ref.close()
        await self.pool.close()
        if self.far is not None:
            await self.far.close()
        await self.proxy.close()
        for conn in self.conns:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _on_started(self, msg: Msg) -> None:
        host_id, name = json.loads(msg.data)
        armed = self.armed
        if armed is None or name != armed[1] or self.signalled is not None:
            return
        host = self.hosts.get(host_id)
        if host is not None:
            self.signalled = host
            host.signal(SIGNALS[armed[2]])

    async def _on_ran(self, msg: Msg) -> None:
        _, name, emit = json.loads(msg.data)
        if emit is not None:
            self.runs[(emit, name)] = self.runs.get((emit, name), 0) + 1

    # -- one case ---------------------------------------------------------------------------
    async def run_case(self, case: Case, index: int = 0) -> CaseReport:
        """Run `case` every way and compare; never raises for a divergence."""
        report = CaseReport(case, index)
        started = time.monotonic()
        try:
            async with asyncio.timeout(90):
                await self._run(case, report)
        except Exception as exc:
            report.notes.append(f"harness error: {type(exc).__name__}: {exc}")
            report.divergences.append(Divergence("harness", {}, {}, [repr(exc)]))
        report.seconds = time.monotonic() - started
        self.cases_run += 1
        return report

    async def _run(self, case: Case, report: CaseReport) -> None:
        kind = case.fault.kind
        event = f"diff:{uuid.uuid4().hex[:12]}"
        deadline = DEADLINE_S if kind == "deadline" else None
        emits: list[str] = []
        self.runs.clear()  # late announcements of earlier cases (a killed host's) included
        async with self._serving(case, event) as hosts:
            if kind == "deadline":
                clean, loose = await reference(case, event, faulted=True)
                allowed = [summary(clean, loose)]
            else:
                allowed = await references(case, event)
            loose = set(pausable(case))
            paths = [("fast", self.fast), ("one-by-one", self.ref), ("fast-warm", self.fast)]
            if kind in ("redeclare", "rogue"):  # which version or replica answers varies
                paths += [("fast-warm", self.fast)] * 3
            paused = self._paused_host(case, hosts)
            if paused is not None:
                paused.signal(signal.SIGSTOP)
            self.proxy.latency_s = case.delay_s
            try:
                for path, d in paths:
                    emits.append(uuid.uuid4().hex[:12])
                    data = initial_data(case, emits[-1])
                    got = await d.emit(event, data, timeout_s=deadline)
                    self._compare(report, path, allowed, got, loose)
            finally:
                self.proxy.latency_s = 0.0
                if paused is not None:
                    paused.signal(signal.SIGCONT)
            if paused is not None:
                await asyncio.sleep(PAUSE_SETTLE_S)  # it reads what it was sent meanwhile
            if kind == "rogue" and self.rogue_heard:  # an emit published on collect
                heard = list(self.rogue_heard)
                report.divergences.append(Divergence("rogue", {}, {}, heard[:5]))
            if kind in SIGNALS:
                emits.append(uuid.uuid4().hex[:12])
                await self._faulted(case, event, self.fast, "fast+fault", report, hosts, emits[-1])
        if any(d.path == "fast+fault" for d in report.divergences):  # confirm it one by one
            event = f"diff:{uuid.uuid4().hex[:12]}"
            async with self._serving(case, event) as hosts:
                await self.ref.emit(event, initial_data(case))  # the same warm-up
                await self._faulted(case, event, self.ref, "one-by-one+fault", report, hosts)
        await self._count_runs(case, emits, report)

    def _paused_host(self, case: Case, hosts: list[Host]) -> Host | None:
        """The replica a ``pause`` case stops: the first of its step handler's process
        (hosts come in process order, `_serving`)."""
        if case.fault.kind != "pause":
            return None
        return hosts[sum(case.replicas[: case.victim.proc])]

    async def _count_runs(self, case: Case, emits: list[str], report: CaseReport) -> None:
        """A divergence for each handler neither ``retry_safe`` nor ``pure`` that ran more
        than once for one emit. Every host was released (a request answered after its
        announcements, on the same connection) or signalled before this runs."""
        await self.ctl.flush()
        once = {
            s.name
            for version in (case, case.declared())
            for s in version.handlers
            if not (s.retry_safe or s.pure)
        }
        twice = [
            f"{name} ran {n} times for emit {emit}"
            for emit in emits
            for name in sorted(once)
            if (n := self.runs.pop((emit, name), 0)) > 1
        ]
        for emit in emits:
            for key in [k for k in self.runs if k[0] == emit]:
                del self.runs[key]
        if twice:
            report.divergences.append(Divergence("ran twice", {}, {}, twice))

    async def _faulted(
        self, case: Case, event: str, d: HookDispatcher, path: str, report: CaseReport,
        hosts: list[Host], emit: str | None = None,
    ) -> None:  # fmt: skip
        faulted, loose = await reference(case, event, faulted=True)
        self.signalled = None
        self.armed = (event, case.victim.name, case.fault.kind)
        try:
            got = await d.emit(event, initial_data(case, emit))
        finally:
            self.armed = None
        if self.signalled is not None:
            report.signalled = True
            if self.signalled in hosts:
                hosts.remove(self.signalled)
            self.signalled.pool.replace(self.signalled)
        self._compare(report, path, [summary(faulted, loose)], got, loose)

    def _compare(
        self, report: CaseReport, path: str, allowed: list[dict[str, Any]], got: HookResult,
        loose: set[str],
    ) -> None:  # fmt: skip
        """A divergence unless `got` is one of the `allowed` decisions (the closest one is
        reported)."""
        mine = summary(got, loose)
        if any(not differences(expected, mine) for expected in allowed):
            return
        expected = min(allowed, key=lambda e: len(differences(e, mine)))
        report.divergences.append(Divergence(path, expected, mine, differences(expected, mine)))

    @contextlib.asynccontextmanager
    async def _serving(self, case: Case, event: str) -> Any:
        """Hosts serving `case`'s processes (and a second version, for a redeclaration)
        and a rogue peer if asked; both dispatchers route the declared settings."""
        n = sum(case.replicas) + (1 if case.fault.kind == "redeclare" else 0)
        pool = self.far if case.delay_s and self.far is not None else self.pool
        hosts = await pool.acquire(n)
        self.hosts.update({h.id: h for h in hosts})
        rogue = None
        try:
            it = iter(hosts)
            jobs = []
            for p, count in enumerate(case.replicas):
                specs = [s for s in case.handlers if s.proc == p]
                for _ in range(count):
                    host = next(it)
                    if specs:
                        jobs.append(
                            self._serve(host, event, specs, replace=False, skew_s=case.skew_s)
                        )
            await asyncio.gather(*jobs)
            if case.fault.kind == "redeclare":
                v2 = case.declared()
                specs = [s for s in v2.handlers if s.proc == case.victim.proc]
                await self._serve(next(it), event, specs, replace=True, skew_s=case.skew_s)
            if case.fault.kind == "rogue":
                self.rogue_heard = []
                rogue = await self.ctl.subscribe(
                    collect_subject(event), cb=functools.partial(self._rogue_reply, case)
                )
                await self.ctl.flush()
            await self._routed(case.declared(), event)
            yield hosts
        finally:
            if rogue is not None:
                with contextlib.suppress(Exception):
                    await rogue.unsubscribe()
            await asyncio.gather(*(self._release(h) for h in hosts))
            for spec in case.handlers:
                with contextlib.suppress(Exception):
                    await self.kv.purge(handler_key(event, spec.name))

    async def _serve(
        self, host: Host, event: str, specs: list[Spec], *, replace: bool, skew_s: float = 0.0
    ) -> None:
        cmd = {
            "op": "serve",
            "event": event,
            "replace": replace,
            "skew_s": skew_s,
            "handlers": [dataclasses.asdict(s) for s in specs],
        }
        msg = await self.ctl.request(f"{self.prefix}.host.{host.id}", json.dumps(cmd).encode(), 30)
        out = json.loads(msg.data)
        if "error" in out:
            raise RuntimeError(f"host {host.id} could not serve: {out['error']}")

    async def _release(self, host: Host) -> None:
        self.hosts.pop(host.id, None)
        try:
            await self.ctl.request(f"{self.prefix}.host.{host.id}", b'{"op": "stop"}', 10)
        except Exception:
            host.pool.replace(host)
            return
        await host.pool.ready.put(host)

    async def _routed(self, case: Case, event: str) -> None:
        """Wait until both dispatchers route every handler with its declared settings."""
        want = {s.name: (s.priority, s.tool_filter, s.parallel, s.policy) for s in case.handlers}

        def ok(d: HookDispatcher) -> bool:
            routes = d.routes(event)
            have = {
                r.name: (r.priority, r.tool_filter, r.parallel, r.failure_policy) for r in routes
            }
            return have == want and all(r.handler_set for r in routes)

        async with asyncio.timeout(20):
            while not (ok(self.fast) and ok(self.ref)):  # noqa: ASYNC110  (no change event)
                await asyncio.sleep(0.003)

    async def _rogue_reply(self, case: Case, msg: Msg) -> None:
        """A hostile peer on the event's collect subject, which only ``emit_and_collect``
        publishes on: it notes every request it hears (an emit must send none there) and
        answers each with a deny in the name of every handler of the case, so a path that
        read replies there would fold the rogue's deny."""
        self.rogue_heard.append(msg.subject)
        if not msg.reply:
            return
        with contextlib.suppress(Exception):
            for spec in case.handlers:
                reply = HookReply(
                    handler=spec.name,
                    result=HookResult(action="deny", reason="rogue"),
                    instance="rogue",
                )
                await self.ctl.publish(msg.reply, encode(reply))


# -- reporting ------------------------------------------------------------------------------------
def describe(case: Case) -> str:
    """The case as a table of its handlers in call order and its fault."""
    lines = [
        f"replicas per process {list(case.replicas)}, initial tool_name {case.tool!r},"
        f" link delay {case.delay_s:g} s, worker clocks off by {case.skew_s:g} s,"
        f" fault {case.fault.kind}"
        + (f" at step {case.fault.step} ({case.victim.name})" if case.fault.kind != "none" else "")
        + (
            f", changing {case.fault.change} to "
            f"{case.fault.new_filter if case.fault.change == 'filter' else case.fault.new_priority}"
            if case.fault.kind == "redeclare"
            else ""
        ),
        "| step | name | proc | prio | kind | filter | flags | policy | pace |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, s in enumerate(case.ordered()):
        flags = ",".join(f for f in ("pure", "parallel", "retry_safe") if getattr(s, f)) or "-"
        filt = "-" if s.tool_filter is None else list(s.tool_filter)
        lines.append(
            f"| {i} | {s.name} | {s.proc} | {s.priority} | {s.kind} | {filt} | {flags} |"
            f" {s.policy} | {s.pace}{f' hold {s.hold_s}' if s.hold_s else ''} |"
        )
    return "\n".join(lines)


def format_report(report: CaseReport, seed: str = "") -> str:
    out = [
        f"### case {report.index}{f' ({seed})' if seed else ''}: {report.case.fault.kind}",
        "",
        describe(report.case),
        "",
        f"replay: `HOOKBUS_DIFFERENTIAL_REPLAY='{report.case.to_json()}'`",
        "",
    ]
    paths = {d.path for d in report.divergences}
    for d in report.divergences:
        out.append(f"- **{d.path}** differs from the reference:")
        out += [f"  - {line}" for line in d.diffs]
    if "fast+fault" in paths:
        out.append(
            "- the one-by-one run under the same fault also differs from the model: unconfirmed"
            if "one-by-one+fault" in paths
            else "- confirmed: the one-by-one run under the same fault decides as the model"
        )
    out += [f"- note: {n}" for n in report.notes]
    return "\n".join(out) + "\n"


def record_findings(path: str | None, report: CaseReport, seed: str = "") -> None:
    """Append a divergent case to the findings file `path` (None: nowhere)."""
    if not path or not report.divergences:
        return
    with open(path, "a") as f:
        f.write("\n" + format_report(report, seed) + "\n")


def replay_cases(spec: str) -> list[Case]:
    """Cases from ``HOOKBUS_DIFFERENTIAL_REPLAY``: a case's JSON, a JSON list, or a file of
    either."""
    text = Path(spec).read_text() if not spec.lstrip().startswith(("{", "[")) else spec
    raw = json.loads(text)
    return [Case.from_json(r) for r in (raw if isinstance(raw, list) else [raw])]


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "host":
    asyncio.run(host_main(sys.argv[2], sys.argv[3], sys.argv[4]))
