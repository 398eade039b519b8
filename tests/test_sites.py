"""hookbus across sites: a hub nats-server (JetStream, domain ``hub``) and leaf nodes linked
to it, one without JetStream and one with its own (domain ``leaf1``), on 127.0.0.1.

At a leaf, with ``js_domain="hub"``, an agent's dispatcher decides against the hub's
registry (a worker at the hub denies), and its suspensions and approvals live at the hub.
Without it, a leaf without JetStream fails at start within seconds naming the topology, and
a leaf with its own JetStream refuses to start (fail closed) instead of creating empty
buckets there and letting ``rm -rf /`` continue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from _cluster import free_ports
from _sites import (
    EVENT,
    asked_and_allowed,
    hooked_and_resolved,
    hub_conf,
    leaf_conf,
    serve,
    site_worker,
    wait_linked,
    wait_listening,
)
from nats.aio.client import Client as NATS

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import JetStreamDomainError
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


@dataclass
class Sites:
    hub: str
    leaf: str
    """A leaf without JetStream."""
    leaf1: str
    """A leaf with its own JetStream, domain ``leaf1``."""
    base: Path


@pytest.fixture(scope="module")
def sites() -> Iterator[Sites]:
    base = Path(tempfile.mkdtemp(prefix="hookbus-sites-"))
    hub_port, leaf_port, leaf1_port, link_port = free_ports(4)
    servers = (
        ("hub", hub_port, hub_conf(base, hub_port, link_port)),
        ("leaf", leaf_port, leaf_conf("leaf", leaf_port, link_port)),
        ("leaf1", leaf1_port, leaf_conf("leaf1", leaf1_port, link_port, domain="leaf1", base=base)),
    )
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, port, conf in servers:
            proc = serve(name, conf, base)
            procs.append(proc)
            log = base / f"{name}.log"
            wait_listening(port, proc, log)
            if name != "hub":
                wait_linked(log, proc)
        yield Sites(
            hub=f"nats://127.0.0.1:{hub_port}",
            leaf=f"nats://127.0.0.1:{leaf_port}",
            leaf1=f"nats://127.0.0.1:{leaf1_port}",
            base=base,
        )
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


async def _connect(conns: list[NATS], url: str) -> NATS:
    nc = await nats.connect(url, max_reconnect_attempts=2, connect_timeout=2)
    conns.append(nc)
    return nc


@pytest.fixture
async def hub_worker(sites: Sites, conns: list[NATS]) -> AsyncIterator[HookWorker]:
    """A worker at the hub: a deny-policy security handler on `EVENT` that denies
    ``rm -rf``, and one asking the user on `ASK_EVENT`."""
    worker = site_worker(await _connect(conns, sites.hub), js_domain="hub")

    async with worker:
        yield worker


RM = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}


# -- a leaf without JetStream --------------------------------------------------------------
async def test_leaf_without_jetstream_decides_suspends_and_approves_at_the_hub(
    sites: Sites, conns: list[NATS], hub_worker: HookWorker
) -> None:
    d = HookDispatcher(await _connect(conns, sites.leaf), agent_id="a1", js_domain="hub")
    other = HookDispatcher(await _connect(conns, sites.leaf), js_domain="hub", approvals=False)
    async with d, other:
        assert d.list_handlers(EVENT)[EVENT] == ["security"]
        r = await d.emit(EVENT, RM)
        assert r.action == "deny" and r.decided_by == "security"
        ok = await d.emit(EVENT, {"tool_name": "bash", "tool_input": {"command": "ls"}})
        assert ok.action == "continue"

        # a suspension: hooked at the leaf, resolved from another leaf process
        got = await hooked_and_resolved(d, other, "a1", 10)
        assert got == [{"ok": True}]

        # an approval: asked at the hub's worker, answered by an approver at the leaf
        approver = await ApprovalsClient.open(await _connect(conns, sites.leaf), js_domain="hub")
        try:
            assert (await asked_and_allowed(d, approver, 10)).action == "continue"
        finally:
            await approver.close()


async def test_leaf_without_jetstream_and_no_domain_fails_fast_naming_the_topology(
    sites: Sites, conns: list[NATS]
) -> None:
    d = HookDispatcher(await _connect(conns, sites.leaf))
    started = time.monotonic()
    with pytest.raises(JetStreamDomainError) as err:
        await d.start()
    assert time.monotonic() - started < 8
    assert "leaf node" in str(err.value) and "js_domain" in str(err.value)


# -- a leaf with its own JetStream (domain leaf1) -----------------------------------------
async def test_leaf_with_its_own_jetstream_fails_closed_without_a_domain(
    sites: Sites, conns: list[NATS], hub_worker: HookWorker
) -> None:
    nc = await _connect(conns, sites.leaf1)
    heard: list[str] = []
    watcher = await _connect(conns, sites.leaf1)

    async def hear(msg: Any) -> None:
        heard.append(msg.subject)

    await watcher.subscribe("hookbus.>", cb=hear)
    d = HookDispatcher(nc)
    with pytest.raises(JetStreamDomainError) as err:
        await d.start()
    assert "'leaf1'" in str(err.value) and "js_domain" in str(err.value)
    with pytest.raises(
        nats.js.errors.BucketNotFoundError
    ):  # no bucket was created in the leaf's JetStream
        await nc.jetstream().key_value("hookbus_handlers")
    await watcher.flush()
    assert not [s for s in heard if "handler" in s or "emit" in s]  # nothing was emitted

    worker = HookWorker(await _connect(conns, sites.leaf1))  # nor may a worker there

    @worker.handler(EVENT, name="security")
    async def allow(event: str, data: dict[str, Any]) -> None:
        return None

    with pytest.raises(JetStreamDomainError):
        await worker.start()


async def test_leaf_with_its_own_jetstream_decides_as_at_the_hub_with_the_domain(
    sites: Sites, conns: list[NATS], hub_worker: HookWorker
) -> None:
    async with HookDispatcher(await _connect(conns, sites.leaf1), js_domain="hub") as d:
        r = await d.emit(EVENT, RM)
    assert r.action == "deny" and r.decided_by == "security"


async def test_a_domain_no_jetstream_answers_for_fails_fast(
    sites: Sites, conns: list[NATS]
) -> None:
    d = HookDispatcher(await _connect(conns, sites.leaf), js_domain="nosuch")
    started = time.monotonic()
    with pytest.raises(JetStreamDomainError) as err:
        await d.start()
    assert time.monotonic() - started < 8
    assert "'nosuch'" in str(err.value)


# -- the CLI -------------------------------------------------------------------------------
async def _hookbus(*args: str, env: dict[str, str] | None = None) -> Any:
    return await anyio.run_process(
        [sys.executable, "-m", "hookbus.cli", *args],
        check=False,
        env={**os.environ, "NATS_CONTEXT": "", **(env or {})},
    )


async def test_cli_emits_from_a_leaf_with_js_domain_and_a_context(
    sites: Sites, hub_worker: HookWorker, tmp_path: Path
) -> None:
    data = json.dumps(RM)
    done = await _hookbus("emit", EVENT, data, "--url", sites.leaf, "--js-domain", "hub")
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["action"] == "deny"

    context = tmp_path / "site.json"
    context.write_text(json.dumps({"url": sites.leaf1, "jetstream_domain": "hub"}))
    done = await _hookbus("emit", EVENT, data, "--context", str(context))
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["action"] == "deny"
