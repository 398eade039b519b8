"""The secured hub and leaf of ``deploy/leaf/secured/``, run as shipped (only addresses,
ports and the store folder changed) with the ``auth.conf`` of ``hookbus auth init
--js-domain hub``: identities connect at the leaf, reach the hub's JetStream as
``$JS.hub.API``, and decide across the link."""

from __future__ import annotations

import re
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _cluster import free_ports
from _sites import ASK_EVENT, EVENT, serve, site_worker, wait_linked, wait_listening

from hookbus.cli._auth_files import load_setup
from hookbus.cli._connect import ConnectionSettings, auth_ca
from hookbus.cli._permissions import inbox_prefix
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import handler_subject

pytestmark = pytest.mark.anyio

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "leaf" / "secured"
PASSWORD = "leaf-link-secret"


def shipped(name: str, *, port: int, link_port: int, store: Path) -> str:
    """``deploy/leaf/secured/<name>`` with 127.0.0.1 addresses, the given ports and store."""
    text = (DEPLOY / name).read_text()
    text = text.replace("0.0.0.0:4222", f"127.0.0.1:{port}")
    text = text.replace("0.0.0.0:7422", f"127.0.0.1:{link_port}")
    return text.replace('"/data/jetstream"', f'"{store}"')


async def connect(url: str, out: Path, role: str, name: str, jwt: bool) -> tuple[Any, list[str]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    if jwt:  # issued: a .creds file, not in the manifest; the JWT run speaks TLS
        creds = out / f"{role}-{name}.creds"
        options = ConnectionSettings(creds=str(creds), tls_ca=auth_ca(str(creds))).nats_options()
    else:
        who = load_setup(out).find("HOOKBUS", role, name)
        assert who is not None
        options = {"nkeys_seed": str(who.seed_path(out)),
                   "inbox_prefix": inbox_prefix(who.public_key)}  # fmt: skip
    nc = await nats.connect(url, error_cb=on_error, connect_timeout=5, **options)
    return nc, errors


def hookbus(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "hookbus.cli", *args], capture_output=True,
                         text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("mode", ["nkey", "jwt"])
async def test_a_secured_leaf_site_decides_through_the_hubs_domain(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nkey: the static users of auth.conf, the link as user "leaf" with a password.
    jwt: users issued while both servers run (no file of theirs changes), the link with
    the credential of `hookbus auth leaf-link`, good for a leaf link only."""
    jwt = mode == "jwt"
    creds = ""  # the leaf link's credential (JWT mode)
    out = tmp_path / "site"
    hub_port, leaf_port, link_port = free_ports(3)
    if jwt:
        hookbus("auth", "init", "--out", str(out), "--jwt", "--js-domain", "hub")
        monkeypatch.setenv("HOOKBUS_HUB_LEAF_URL", f"nats-leaf://127.0.0.1:{link_port}")
        creds, account = hookbus("auth", "leaf-link", "site1", "--dir", str(out)).split()
        monkeypatch.setenv("HOOKBUS_LEAF_CREDS", creds)
        monkeypatch.setenv("HOOKBUS_LEAF_ACCOUNT", account)
    else:
        served = f"w:{EVENT}/security,{ASK_EVENT}/asker"
        hookbus("auth", "init", "--out", str(out), "--no-tls", "--js-domain", "hub",
                "--embedded-agent", "a1", "--worker", served)  # fmt: skip
        monkeypatch.setenv("HOOKBUS_LEAF_PASSWORD", PASSWORD)
        monkeypatch.setenv(
            "HOOKBUS_HUB_LEAF_URL", f"nats-leaf://leaf:{PASSWORD}@127.0.0.1:{link_port}"
        )
    suffix = "-jwt" if jwt else ""
    hub_conf = shipped(f"hub{suffix}.conf", port=hub_port, link_port=link_port, store=out / "js")
    leaf_conf = shipped(f"leaf{suffix}.conf", port=leaf_port, link_port=link_port, store=out / "js")
    if not jwt:
        assert re.search(r"password: \$HOOKBUS_LEAF_PASSWORD", hub_conf)  # no secret in the file
    procs = [serve("hub", hub_conf, out)]
    try:
        wait_listening(hub_port, procs[0], out / "hub.log")
        procs.append(serve("leaf", leaf_conf, out))
        wait_listening(leaf_port, procs[1], out / "leaf.log")
        wait_linked(out / "leaf.log", procs[1], timeout_s=20)
        hub, leaf = f"nats://127.0.0.1:{hub_port}", f"nats://127.0.0.1:{leaf_port}"
        await anyio.to_thread.run_sync(
            hookbus, "auth", "provision", "--dir", str(out), "--url", hub, "--js-domain", "hub"
        )
        if jwt:  # issued while both servers run
            hookbus("auth", "issue", "agent", "a1", "--embedded", "--dir", str(out))
            hookbus("auth", "issue", "worker", "w", "--handler", f"{EVENT}/security",
                    "--handler", f"{ASK_EVENT}/asker", "--dir", str(out))  # fmt: skip
        worker_nc, worker_errors = await connect(leaf, out, "worker", "w", jwt)
        agent_nc, agent_errors = await connect(leaf, out, "agent", "a1", jwt)
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
            # the agent's permissions hold at the leaf: it may not serve a handler
            await agent_nc.subscribe(handler_subject(EVENT, "security"), queue="security")
            with anyio.fail_after(10):
                while not agent_errors:  # noqa: ASYNC110 (the error callback's list)
                    await anyio.sleep(0.05)
            assert "permissions violation" in agent_errors[0].lower(), agent_errors
        finally:
            await worker_nc.close()
            await agent_nc.close()
        if jwt:  # the link's credential is good for a leaf link only
            tls = ssl.create_default_context(cafile=str(out / "ca.pem"))
            with pytest.raises(Exception, match=r"(?i)authorization"):
                await nats.connect(hub, user_credentials=creds, connect_timeout=5,
                                   allow_reconnect=False, tls=tls)  # fmt: skip
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
