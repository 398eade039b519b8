"""Tracing of the ``ai`` integration's waits: an aborted wait and the wait that resumes it
are tied to the run that created the suspension (not roots of their own).

A real nats-server, the SDK's in-memory exporter (`_otel_harness`). An ``ai`` agent
(``ai.testing.FakeModel``) asks for a tool approval; the run is aborted at ``pending``
(``RunBlocked``), then resumed by a second `HookbusHooks` on its own connection (another
run, as another process would), answered there. Checks: each run is an ``invoke_agent``
span, the aborted ``await suspension`` is a child of the first, the resumed one a child
of the second and linked to the first (the run that created the suspension); and, as a
link is not shown everywhere, both runs' spans (runs and waits) carry the same run id and
session (``gen_ai.conversation.id``), so one attribute finds them together.

``ai`` needs Python >= 3.12: on an older interpreter the test of this file that needs it
is skipped and `test_ai_tracing_passes_on_python312` runs this file on such an
interpreter (the venv of `tests/test_integration_ai_runner.py`).
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from _otel_harness import Otel, children

pytestmark = pytest.mark.anyio

HERE = Path(__file__).resolve()


async def test_an_aborted_then_resumed_wait_links_to_the_run_that_created_it(
    otel: Otel, nc: Any, connect: Any
) -> None:
    ai = pytest.importorskip("ai", reason="ai needs Python >= 3.12 (see the module docstring)")
    from ai import testing

    from hookbus.integrations import ai as hb_ai
    from hookbus.integrations.ai import HookbusHooks

    @ai.tool(require_approval=True)
    async def transfer(amount: int) -> str:
        """Send `amount`."""
        return f"sent {amount}"

    agent_id = f"ai-{uuid.uuid4().hex[:10]}"
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    call = testing.tool_call(transfer, amount=5)
    label = f"approve_{call.tool_call_id}"
    script = [ai.user_message("pay 5"), ai.assistant_message("paying", call)]

    first = await HookbusHooks.open(nc, agent_id=agent_id)
    try:
        model = testing.FakeModel([*script, ai.assistant_message("done")])
        async with first.run(ai.Agent(tools=[transfer]), model, script[:1], run_id=run_id) as s:
            async for event in s:
                if isinstance(event, ai.events.HookEvent) and event.hook.status == "pending":
                    assert first.abort_pending_hook(event.hook) is True
        messages = s.messages
    finally:
        await first.close()
    record, _ = await (await HookbusHooks.open(await connect(), agent_id=agent_id)).suspensions.get(
        label
    )  # type: ignore[misc]
    assert record.status == "pending"
    assert record.metadata[hb_ai.AI_METADATA_KEY][hb_ai.AI_TRACE_KEY].startswith("00-")

    second = await HookbusHooks.open(await connect(), agent_id=agent_id)
    try:
        replay = [
            messages[0],
            messages[1].model_copy(update={"replay": True}),
            ai.assistant_message("done"),
        ]
        statuses = []
        async with second.run(
            ai.Agent(tools=[transfer]), testing.FakeModel(replay), messages, run_id=run_id
        ) as s:
            async for event in s:
                if isinstance(event, ai.events.HookEvent):
                    statuses.append(event.hook.status)
                    if event.hook.status == "pending":
                        await second.approve(event.hook, "Allow", approver="alice")
    finally:
        await second.close()
    assert statuses == ["pending", "resolved"]

    spans = otel.spans()
    runs = [s for s in spans if s.name == f"invoke_agent {agent_id}"]
    waits = [s for s in spans if s.name == "await suspension"]
    assert len(runs) == 2 and len(waits) == 2, [s.name for s in spans]
    created, resumed = runs
    aborted, answered = sorted(waits, key=lambda s: s.start_time or 0)
    assert [e.name for e in aborted.events][-1] == "aborted"
    assert aborted in children(spans, created) and not aborted.links  # its parent created it
    assert answered in children(spans, resumed)
    assert [(ln.context.trace_id, ln.context.span_id) for ln in answered.links] == [
        (created.context.trace_id, created.context.span_id)
    ]
    assert answered.links[0].attributes["hookbus.suspension.created_by"] is True
    assert created.attributes["gen_ai.agent.id"] == agent_id
    # found together by attribute: the run id and the session (here the run id) on both
    # runs' spans, the waits included (their link alone ties them otherwise)
    for span in (created, resumed, aborted, answered):
        assert span.attributes["hookbus.run.id"] == run_id, span.name
        assert span.attributes["gen_ai.conversation.id"] == run_id, span.name
    assert aborted.attributes["gen_ai.agent.id"] == answered.attributes["gen_ai.agent.id"]
    assert all(w.parent is not None for w in waits)  # no root waits


def test_ai_tracing_passes_on_python312(nats_url: str) -> None:
    """This file on a Python >= 3.12 with ``ai`` (the ai integration tests' venv)."""
    try:
        import ai  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("ai is importable here: the test above ran in this interpreter")
    import test_integration_ai_runner as runner

    venv_python = runner._venv(runner._interpreter())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("VIRTUAL_ENV", None)
    env["HOOKBUS_TEST_NATS_URL"] = nats_url
    result = runner._run(
        [str(venv_python), "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider",
         "-k", "links_to_the_run"],
        runner.RUN_TIMEOUT_S, cwd=HERE.parent.parent, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    tail = "\n".join(output.splitlines()[-60:])
    assert result.returncode == 0, f"{HERE.name} failed on {venv_python}:\n{tail}"
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b1 passed", summary) and "skipped" not in summary, tail
