"""Approvals on a secured server (``hookbus auth init``): an agent's own dispatcher may not
create approval records there, so its question is denied at once, saying that approvals
are asked through the dispatcher service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from test_auth import _secured_server, connect_as, ident

from hookbus.cli._provision import provision
from hookbus.dispatcher import Suspensions
from hookbus.dispatcher._approvals import Approvals
from hookbus.schemas import HookResult

pytestmark = pytest.mark.anyio


@pytest.fixture
def secured_alone(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    yield from _secured_server(tmp_path / "auth")


async def test_an_agents_own_approvals_are_denied_at_once_on_a_secured_server(
    secured_alone: tuple[str, Path],
) -> None:
    """The agent's embedded dispatcher's approvals (its own scoped stores, as
    `HookDispatcher(nc, agent_id=...)` opens them): the question is denied within seconds,
    in one line naming the dispatcher service, never after a write retried for 15 s."""
    url, out = secured_alone
    admin_nc, _ = await connect_as(url, out, ident(out, "ACME", "admin", "admin"))
    agent_nc, _ = await connect_as(url, out, ident(out, "ACME", "agent", "payments"))
    try:
        await provision(admin_nc)  # the buckets: only the admin may create them
        store = await Suspensions.open(agent_nc, agent_id="payments", scoped=True)
        approvals = await Approvals.open(agent_nc, store)
        ask = HookResult(
            action="ask_user", decided_by="guard", approval_timeout=60,
            data={"tool_name": "bash", "session_id": "s1", "agent_id": "payments"},
        )  # fmt: skip
        began = time.monotonic()
        with anyio.fail_after(12):
            r = await approvals.decide("tool:pre", ask, call_id="call-1", wait_s=30)
        took = time.monotonic() - began
        await approvals.close()
        await store.close()
    finally:
        await agent_nc.close()
        await admin_nc.close()
    assert r.action == "deny", r
    assert r.reason is not None and r.reason.startswith("approval not asked"), r.reason
    assert "dispatcher service" in r.reason and "\n" not in r.reason
    assert took < 10, took  # never the 15 s of a write retried to its deadline
