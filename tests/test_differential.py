"""The differential test: every fast path of `HookDispatcher` gives the one-by-one decision.

Cases come from hypothesis (`_differential.cases`: handler sets over worker processes and
replicas, results, filters, flags, policies, timeouts, and one fault among SIGKILL, SIGTERM
and SIGSTOP of a replica mid-step, a caller deadline, a rolling redeclaration and a rogue
peer); each runs through a real nats-server with every fast path on, one by one over NATS
(``chains=False``), and through the in-process reference with the fault made explicit.
Divergences are collected over all cases and reported together, each with its replay line.

    HOOKBUS_DIFFERENTIAL_CASES=1000 .venv/bin/pytest tests/test_differential.py
    HOOKBUS_DIFFERENTIAL_REPLAY='{"handlers": ...}' .venv/bin/pytest tests/test_differential.py
    HOOKBUS_DIFFERENTIAL_FINDINGS=findings.md   # also append every divergent case there
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from _differential import Case, CaseReport, Harness, cases, format_report, record_findings
from _differential import replay_cases as _replay
from hypothesis import HealthCheck, Phase, given, settings

pytestmark = pytest.mark.faults

T = TypeVar("T")

CASES = int(os.environ.get("HOOKBUS_DIFFERENTIAL_CASES", "200"))
FINDINGS = os.environ.get("HOOKBUS_DIFFERENTIAL_FINDINGS")
REPLAY = os.environ.get("HOOKBUS_DIFFERENTIAL_REPLAY")


class LoopThread:
    """An event loop in a thread of its own: the harness outlives each hypothesis example."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def harness(nats_url: str) -> Iterator[tuple[LoopThread, Harness]]:
    runner = LoopThread()
    h = Harness(nats_url)
    runner.run(h.start(), 120)
    try:
        yield runner, h
    finally:
        runner.run(h.close(), 60)
        runner.stop()


def run_all(runner: LoopThread, h: Harness, todo: list[Case] | None) -> list[CaseReport]:
    """Run the replayed cases, or `CASES` cases drawn by hypothesis (derandomized)."""
    reports: list[CaseReport] = []

    def one(case: Case) -> None:
        report = runner.run(h.run_case(case, len(reports)))
        reports.append(report)
        record_findings(FINDINGS, report, seed=f"derandomized example {report.index}")

    if todo is not None:
        for case in todo:
            one(case)
        return reports

    @settings(
        max_examples=CASES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def draw(case: Case) -> None:
        one(case)

    draw()
    return reports


@pytest.mark.timeout(1800)
def test_fast_paths_decide_as_one_by_one(harness: tuple[LoopThread, Harness]) -> None:
    runner, h = harness
    reports = run_all(runner, h, _replay(REPLAY) if REPLAY else None)
    if not REPLAY:
        assert len(reports) == CASES, f"ran {len(reports)} cases, not {CASES}"
    divergent = [r for r in reports if r.divergences]
    assert not divergent, f"{len(divergent)} of {len(reports)} cases diverge:\n\n" + "\n".join(
        format_report(r) for r in divergent[:10]
    )
