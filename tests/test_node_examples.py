"""examples/node: a hook worker and an agent written in Node.js with the official ``nats``
package, against the Python side: the `hookbus dispatcher` service and a Python worker.

The worker declares ``sql_guard`` (``tool:pre``, priority 0, tool filter ``sql*``, failure
policy deny) and ``sql_readonly`` (priority 1, policy ignore) with their handler set in the
handlers bucket, serves them one by one and as chain requests, and shows as their live
replica (``$SRV.PING.hookbus-worker``); a Python worker serves ``py_redact`` (priority 5,
modifies the data). The Node agent emits through the dispatcher service and reads the
folded result; a Python agent (an embedded `HookDispatcher`) sees the same decisions. Chain
requests sent by hand get what docs/wire.md says: the steps' replies under the set's id, a
stop at a deny, ``stale_declaration`` and ``bad_request`` refusals. Killing the Node worker
turns its calls into ``no_responders`` failures that its deny policy closes. ``nats`` is
installed by npm outside the work tree (see `_node`).
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

from hookbus._core.declarations import check_declaration
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher, live_handlers
from hookbus.schemas import (
    HANDLERS_BUCKET,
    HookResult,
    chain_subject,
    handler_key,
    handler_set_id,
)
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "node"
DROP = {"tool_name": "sql", "tool_input": {"query": "DROP TABLE invoices"}}
SELECT = {"tool_name": "sql", "tool_input": {"query": "SELECT 1"}, "password": "hunter2"}
WRITE = {"tool_name": "sql", "tool_input": {"query": "DELETE FROM t"}, "readonly": True}
NODE_HANDLERS = ["sql_guard", "sql_readonly"]
SET_ID = handler_set_id(NODE_HANDLERS)


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
            assert decl.handler_set == NODE_HANDLERS
            ro = handler_key("tool:pre", "sql_readonly")
            assert check_declaration(ro, (await kv.get(ro)).value).failure_policy == "ignore"
            # its services API metadata holds encoded keys: it counts as a live replica
            live = await live_handlers(nc, timeout_s=0.5)
            assert all(len(live.get(("tool:pre", h), [])) == 1 for h in NODE_HANDLERS), live
            await _chains_by_hand(nc)
            chains: list[bytes] = []

            async def on_chain(msg: Any) -> None:
                chains.append(msg.data)

            await nc.subscribe(chain_subject("tool:pre", SET_ID), cb=on_chain)

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
                    url, nats_js, "payments", "tool:pre", json.dumps(WRITE)
                )
                assert status == 3
                assert reply["result"]["decided_by"] == "sql_readonly"
                assert chains  # the Node handlers were called as chain requests

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


async def _chains_by_hand(nc: Any) -> None:
    """Chain requests as a dispatcher sends them, and the Node worker's answers."""
    subject = chain_subject("tool:pre", SET_ID)
    step = {"failure_policy": "deny", "timeout_s": 2.0, "tool_filter": ["sql*"]}
    envelope = {"id": "e" * 32, "event": "tool:pre", "data": DROP, "budget_s": 5.0}

    async def ask(**fields: Any) -> Any:
        body = json.dumps({**envelope, **fields}).encode()
        return json.loads((await nc.request(subject, body, timeout=10)).data)

    steps = [{**step, "handler": "sql_guard"}, {**step, "handler": "sql_readonly"}]
    got = await ask(chain=steps)  # the deny ends the chain: sql_readonly does not run
    assert got["handler"] == SET_ID and "result" not in got and "running" not in got
    assert [(r["handler"], r["result"]["action"]) for r in got["chain"]] == [("sql_guard", "deny")]
    got = await ask(chain=steps, data=WRITE)
    assert [(r["handler"], r["result"]["action"]) for r in got["chain"]] == [
        ("sql_guard", "continue"),
        ("sql_readonly", "deny"),
    ]
    got = await ask(chain=steps, data={"tool_name": "bash"})  # both skipped by their filter
    assert got == {"handler": SET_ID, "chain": []}
    stale = [{**steps[0], "tool_filter": ["sql", "psql"]}, steps[1]]
    got = await ask(chain=stale)  # judged by another declaration: nothing runs
    assert (got["handler"], got["error"]["code"]) == (SET_ID, "stale_declaration")
    got = await ask(chain=[*steps, {**step, "handler": "not_here"}])
    assert got["error"]["code"] == "bad_request"
    got = await ask(chain=steps, budget_s=0)
    assert (got["error"]["code"], got["error"]["retryable"]) == ("deadline_exceeded", True)


async def test_node_worker_drains_on_sigterm(nats_js):
    with EmbeddedNatsServer() as server:
        worker = await _start_node_worker(server.url, nats_js)
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.wait(), 15) == 0
