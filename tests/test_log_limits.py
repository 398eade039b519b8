"""A flood of bad requests is a few log lines of bounded size, in the dispatcher service as
in the worker (one shared helper): never one multi-kilobyte WARNING per request."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from hookbus._core.log_limits import LOGGED_TEXT_MAX, RateLimitedWarning, clip
from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import encode_token

pytestmark = pytest.mark.anyio


def test_clip_bounds_and_counts() -> None:
    assert clip("short") == "short"
    cut = clip("x" * 5000)
    assert cut.startswith("x" * LOGGED_TEXT_MAX)
    assert cut.endswith("... (4800 more characters)")
    assert len(cut) < LOGGED_TEXT_MAX + 40


def test_rate_limited_warning_logs_a_burst_then_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hookbus._core.log_limits as limits

    now = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    logger = logging.getLogger("hookbus.test.limits")
    warn = RateLimitedWarning(logger, burst=3, interval_s=10, what="odd thing(s)")
    with caplog.at_level(logging.WARNING, logger="hookbus.test.limits"):
        for i in range(50):
            warn.warn("thing %d", i)
        assert [r.getMessage() for r in caplog.records] == ["thing 0", "thing 1", "thing 2"]
        now[0] += 11
        warn.warn("thing %d", 50)
    assert [r.getMessage() for r in caplog.records][3:] == [
        "47 more odd thing(s) in the last 11s (not logged one by one)",
        "thing 50",
    ]


def test_the_worker_uses_the_shared_helper() -> None:
    import hookbus.workers._requests as worker

    assert worker.RateLimitedWarning is RateLimitedWarning
    assert not hasattr(worker, "_RateLimitedWarning")


async def test_a_flood_of_bad_requests_is_a_few_short_warnings(
    connect: Any, event: str, caplog: pytest.LogCaptureFixture
) -> None:
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    service = DispatcherService(d, snc)
    await service.start()
    agent = await connect()
    bad_event = f"{event}-" + "x" * 3000  # a long name no handler declares
    good = b'{"data": {"payload": "' + b"A" * 4000 + b'"}}'  # ~4 KB each
    bad = b'{"data": {"payload": "' + b"A" * 4000 + b'"}, "agent_id": 5}'
    requests = [("hookbus.v1.emit.=." + encode_token(bad_event), good)] * 20
    requests += [("hookbus.v1.emit.=." + encode_token(event), bad)] * 20
    try:
        with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"):
            for subject, body in requests:
                reply = json.loads((await agent.request(subject, body, timeout=5)).data)
                assert reply["error"]["code"] in ("bad_request", "unknown_event"), reply
    finally:
        await service.stop()
    refused = [r.getMessage() for r in caplog.records if " refused (" in r.getMessage()]
    assert 1 <= len(refused) <= 5, refused
    assert "refused (unknown_event)" in refused[0], refused
    assert all(len(line) < 3 * LOGGED_TEXT_MAX + 200 for line in refused), refused
