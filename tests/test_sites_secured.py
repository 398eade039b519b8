"""The secured hub and leaf of ``deploy/leaf/secured/``, run as shipped (only addresses,
ports and the store folder changed) with the ``auth.conf`` of ``hookbus auth init
--js-domain hub``: identities connect at the leaf, reach the hub's JetStream as
``$JS.hub.API``, and decide across the link."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _cluster import free_ports
from _sites import ASK_EVENT, EVENT, serve, site_worker, wait_linked, wait_listening

from hookbus.cli._auth_files import load_setup
from hookbus.cli._permissions import inbox_prefix
from hookbus.dispatcher import HookDispatcher

pytestmark = pytest.mark.anyio

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "leaf" / "secured"
PASSWORD = "leaf-link-secret"


def shipped(name: str, *, port: int, link_port: int, store: Path) -> str:
    """``deploy/leaf/secured/<name>`` with 127.0.0.1 addresses, the given ports and store."""
    text = (DEPLOY / name).read_text()
    text = text.replace("0.0.0.0:4222", f"127.0.0.1:{port}")
    text = text.replace("0.0.0.0:7422", f"127.0.0.1:{link_port}")
    return text.replace('"/data/jetstream"', f'"{store}"')


async def connect(url: str, out: Path, role: str, name: str) -> tuple[Any, list[str]]:
    who = load_setup(out).find("HOOKBUS", role, name)
    assert who is not None
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        url, nkeys_seed=str(who.seed_path(out)), inbox_prefix=inbox_prefix(who.public_key),
        error_cb=on_error, connect_timeout=5,
    )  # fmt: skip
    return nc, errors


async def test_a_secured_leaf_site_decides_through_the_hubs_domain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "site"
    await anyio.run_process(
        [sys.executable, "-m", "hookbus.cli", "auth", "init", "--out", str(out), "--no-tls",
         "--js-domain", "hub", "--embedded-agent", "a1",
         "--worker", f"w:{EVENT}/security,{ASK_EVENT}/asker"],
        check=True,
    )  # fmt: skip
    hub_port, leaf_port, link_port = free_ports(3)
    monkeypatch.setenv("HOOKBUS_LEAF_PASSWORD", PASSWORD)
    monkeypatch.setenv("HOOKBUS_HUB_LEAF_URL", f"nats-leaf://leaf:{PASSWORD}@127.0.0.1:{link_port}")
    hub_conf = shipped("hub.conf", port=hub_port, link_port=link_port, store=out / "js")
    leaf_conf = shipped("leaf.conf", port=leaf_port, link_port=link_port, store=out / "js")
    assert re.search(r"password: \$HOOKBUS_LEAF_PASSWORD", hub_conf)  # no secret in the file
    procs = [serve("hub", hub_conf, out)]
    try:
        wait_listening(hub_port, procs[0], out / "hub.log")
        procs.append(serve("leaf", leaf_conf, out))
        wait_listening(leaf_port, procs[1], out / "leaf.log")
        wait_linked(out / "leaf.log", procs[1], timeout_s=20)
        hub, leaf = f"nats://127.0.0.1:{hub_port}", f"nats://127.0.0.1:{leaf_port}"
        with anyio.fail_after(120):
            run = await anyio.run_process(
                [sys.executable, "-m", "hookbus.cli", "auth", "provision", "--dir", str(out),
                 "--url", hub, "--js-domain", "hub"], check=False,
            )  # fmt: skip
        assert run.returncode == 0, run.stderr.decode()
        worker_nc, worker_errors = await connect(leaf, out, "worker", "w")
        agent_nc, agent_errors = await connect(leaf, out, "agent", "a1")
        try:
            async with site_worker(worker_nc, js_domain="hub"):
                async with HookDispatcher(agent_nc, agent_id="a1", js_domain="hub") as d:
                    with anyio.fail_after(10):
                        while not d.routes(EVENT):  # noqa: ASYNC110 (no change event)
                            await anyio.sleep(0.05)
                    bad = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}
                    denied = await d.emit(EVENT, bad)
                    assert denied.action == "deny" and denied.decided_by == "security"
                    ok = {"tool_name": "bash", "tool_input": {"command": "ls"}}
                    assert (await d.emit(EVENT, ok)).action == "continue"
            assert worker_errors == [] and agent_errors == []
        finally:
            await worker_nc.close()
            await agent_nc.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
