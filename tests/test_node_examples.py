"""examples/node: a hook worker and an agent written in Node.js with the official ``nats``
package, against the Python side: the `hookbus dispatcher` service and a Python worker.

The worker declares ``sql_guard`` (``tool:pre``, priority 0, tool filter ``sql*``, failure
policy deny) in the handlers bucket and serves it; a Python worker serves ``py_redact``
(priority 5, modifies the data). The Node agent emits through the dispatcher service and
reads the folded result; a Python agent (an embedded `HookDispatcher`) sees the same
decisions. Killing the Node worker turns its calls into ``no_responders`` failures that its
deny policy closes. ``nats`` is installed by npm outside the work tree (see `_node`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import nats
import pytest
from _fleet import Fleet
from _node import node_packages

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HANDLERS_BUCKET, HookResult, check_declaration, handler_key
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "node"
DROP = {"tool_name": "sql", "tool_input": {"query": "DROP TABLE invoices"}}
SELECT = {"tool_name": "sql", "tool_input": {"query": "SELECT 1"}, "password": "hunter2"}


@pytest.fixture(scope="session")
def nats_js() -> Path:
    """The examples' own dependencies (examples/node/package.json), installed by npm."""
    return node_packages(EXAMPLES / "package.json", "node-examples")


def _env(url: str, node_modules: Path) -> dict[str, str]:
    return {**os.environ, "NATS_URL": url, "NODE_PATH": str(node_modules)}


async def _start_node_worker(url: str, node_modules: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        "node", str(EXAMPLES / "worker.js"),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env=_env(url, node_modules),
    )  # fmt: skip
    assert proc.stderr is not None
    line = await asyncio.wait_for(proc.stderr.readline(), 30)
    assert line.startswith(b"serving sql_guard"), line + await proc.stderr.read()
    return proc


async def _agent(url: str, node_modules: Path, *args: str) -> tuple[int, Any]:
    proc = await asyncio.create_subprocess_exec(
        "node", str(EXAMPLES / "agent.js"), *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=_env(url, node_modules),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode in (0, 3), err.decode()
    return proc.returncode, json.loads(out)


async def _py_redact(event: str, data: dict[str, Any]) -> HookResult | None:
    if "password" in data:
        return HookResult(action="modify", data={**data, "password": "***"})
    return None


@pytest.mark.timeout(120)
async def test_node_worker_and_agent_with_the_python_dispatcher(nats_js, tmp_path):
    with EmbeddedNatsServer() as server:
        url = server.url
        node_worker = await _start_node_worker(url, nats_js)
        nc = await nats.connect(url)
        try:
            # the Node worker's declaration is one a Python dispatcher accepts
            kv = await nc.jetstream().key_value(HANDLERS_BUCKET)
            key = handler_key("tool:pre", "sql_guard")
            decl = check_declaration(key, (await kv.get(key)).value)
            assert (decl.priority, decl.tool_filter, decl.failure_policy) == (0, ["sql*"], "deny")
            assert decl.retry_safe is True

            py_worker = HookWorker(nc)
            py_worker.add_handler("tool:pre", _py_redact, priority=5, name="py_redact")
            async with py_worker, Fleet(url, tmp_path) as fleet:
                await fleet.dispatcher()  # loads the registry: both handlers are routed

                status, reply = await _agent(
                    url, nats_js, "payments", "tool:pre", json.dumps(SELECT)
                )
                result = reply["result"]
                assert status == 0
                assert (result["action"], result["failures"]) == ("continue", [])
                assert result["data"]["password"] == "***"
                assert result["decided_by"] == "py_redact"
                assert result["modified_by"] == ["py_redact"]
                assert result["data"]["agent_id"] == "payments"

                status, reply = await _agent(url, nats_js, "payments", "tool:pre", json.dumps(DROP))
                assert status == 3
                assert reply["result"]["action"] == "deny"
                assert reply["result"]["decided_by"] == "sql_guard"
                assert reply["result"]["reason"].startswith("destructive SQL refused")

                status, reply = await _agent(
                    url, nats_js, "payments", "tool:pre", json.dumps(SELECT), "--collect"
                )
                assert reply == {"responses": [{**SELECT, "password": "***"}]}

                # a Python agent, embedded dispatcher: the same decisions
                async with HookDispatcher(nc, agent_id="payments") as hooks:
                    denied = await hooks.emit("tool:pre", DROP)
                    assert (denied.action, denied.decided_by) == ("deny", "sql_guard")
                    bash = await hooks.emit("tool:pre", {"tool_name": "bash"})
                    assert (bash.action, bash.failures) == ("continue", [])  # filter: not called

                    node_worker.send_signal(signal.SIGKILL)
                    await node_worker.wait()
                    closed = await hooks.emit("tool:pre", DROP)
                    assert closed.action == "deny"
                    assert [(f.handler, f.kind, f.policy) for f in closed.failures] == [
                        ("sql_guard", "no_responders", "deny")
                    ]
        finally:
            if node_worker.returncode is None:
                node_worker.send_signal(signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await node_worker.wait()
            await nc.close()


async def test_node_worker_drains_on_sigterm(nats_js):
    with EmbeddedNatsServer() as server:
        worker = await _start_node_worker(server.url, nats_js)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.wait(), 15) == 0
