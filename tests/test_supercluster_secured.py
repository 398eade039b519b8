"""The supercluster of ``deploy/supercluster/``, run as shipped (only addresses, ports and
store folders changed) with what ``hookbus auth init --route east=... --route west=...
--gateway east=... --gateway west=...`` writes beside it, in both modes: static nkey users
on plain TCP, and ``--jwt`` with TLS on the client port.

Three nodes run (``east-n1``, ``east-n2``, ``west-n1``, the ones ``--route`` and
``--gateway`` name: a new JetStream meta group waits for every node they name; the buckets
placed in ``east``):

- an embedded agent connected to ``west`` and a worker connected to ``east`` decide deny
  and continue across the gateway, as the identities ``auth init`` wrote (JWT mode: both
  issued with ``hookbus auth issue`` while the servers run);
- ``east-n3`` started with a wrong route password (and a wrong gateway one, so it reaches
  nobody else either): the east nodes refuse its routes; no route between them;
- ``west-n2`` started with the right route password but a wrong gateway password: it joins
  ``west`` by its route, and its gateways to ``east`` are refused.

A refusal is waited for in the logs (the intruder's "Authorization Violation" and the
refusing nodes' "Authentication Failure"), never slept for; then the monitoring endpoints
show no link.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from _cluster import Node, free_ports, wait_for
from _sites import ASK_EVENT, EVENT, site_worker
from nats.aio.client import Client as NATS

from hookbus.cli._auth_files import load_setup
from hookbus.cli._connect import ConnectionSettings, auth_ca
from hookbus.dispatcher import HookDispatcher

pytestmark = pytest.mark.anyio

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "supercluster"
NODES = {"east": ("east-n1", "east-n2", "east-n3"), "west": ("west-n1", "west-n2")}
RUN = ("east-n1", "east-n2", "west-n1")
ROUTE_INTRUDER, GATEWAY_INTRUDER = "east-n3", "west-n2"
READY_S = 90.0
"""Readiness and refusal waits: generous (a busy 2-core machine), polled, never slept."""


@dataclass
class ShippedNode(Node):
    """A node run from ``deploy/supercluster/<name>.conf`` as shipped, its listen addresses
    (client, monitoring, cluster, gateway) on 127.0.0.1 ports and its store under `base`."""

    cluster: str = "east"
    gateway_port: int = 0

    def write_config(self) -> None:
        text = (DEPLOY / f"{self.name}.conf").read_text()
        for shipped, local in (
            ("0.0.0.0:4222", f"127.0.0.1:{self.port}"),
            ("0.0.0.0:8222", f"127.0.0.1:{self.http_port}"),
            ("0.0.0.0:6222", f"127.0.0.1:{self.cluster_port}"),
            ("0.0.0.0:7222", f"127.0.0.1:{self.gateway_port}"),
            (f'"/data/{self.name}/jetstream"', f'"{self.base / self.name / "jetstream"}"'),
        ):
            assert text.count(shipped) == 1, (self.name, shipped)
            text = text.replace(shipped, local)
        self.config_file.write_text(text)

    def json(self, path: str) -> Any:
        try:
            return self.http_json(path)
        except (OSError, ValueError):
            return {}

    def route_peers(self) -> set[str]:
        """Server names this node has a route to (``/routez``)."""
        return {r.get("remote_name", "") for r in self.json("/routez").get("routes") or []}

    def gateway_peers(self) -> dict[str, set[str]]:
        """``outbound`` / ``inbound``: the clusters this node has a gateway to / from."""
        gz = self.json("/gatewayz")
        return {
            "outbound": set((gz.get("outbound_gateways") or {}).keys()),
            "inbound": set((gz.get("inbound_gateways") or {}).keys()),
        }

    def log_size(self) -> int:
        return len(self.log_file.read_text(errors="replace")) if self.log_file.exists() else 0

    def log_has(self, needle: str, *, since: int = 0) -> bool:
        """Whether the log holds `needle` after its first `since` characters."""
        if not self.log_file.exists():
            return False
        return needle in self.log_file.read_text(errors="replace")[since:]


@dataclass
class Secured:
    """The running supercluster: its nodes (not all started), the auth folder, the mode."""

    base: Path
    auth: Path
    jwt: bool
    nodes: dict[str, ShippedNode]

    def urls(self, cluster: str) -> list[str]:
        return [self.nodes[n].url for n in RUN if self.nodes[n].cluster == cluster]

    def intruder(self, name: str, *, wrong: tuple[str, ...]) -> ShippedNode:
        """Node `name` in a folder of its own, with `auth/` copied and a wrong password in
        each file of `wrong` (its authorization and its URLs alike)."""
        folder = self.base / f"intruder-{name}"
        shutil.copytree(self.auth, folder / "auth")
        shutil.copy(DEPLOY / "common.conf", folder / "common.conf")
        for conf in wrong:
            path = folder / "auth" / conf
            text = path.read_text()
            right = re.findall(r"//hookbus-(?:route|gateway):([0-9a-f]+)@", text)[0]
            path.write_text(text.replace(right, secrets.token_hex(32)))
        node = self.nodes[name]
        return ShippedNode(name=name, port=node.port, cluster_port=node.cluster_port,
                           http_port=node.http_port, base=folder, cluster=node.cluster,
                           gateway_port=node.gateway_port)  # fmt: skip


def _hookbus(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hookbus.cli", *args],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout


@pytest.fixture(scope="module", params=["nkey", "jwt"])
def secured(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secured]:
    jwt = request.param == "jwt"
    base = tmp_path_factory.mktemp(f"secured-{request.param}")
    names = [n for c in NODES for n in NODES[c]]
    ports = iter(free_ports(4 * len(names)))
    nodes = {
        n: ShippedNode(name=n, port=next(ports), cluster_port=next(ports),
                       http_port=next(ports), base=base, cluster=c, gateway_port=next(ports))
        for c in NODES for n in NODES[c]
    }  # fmt: skip
    auth = base / "auth"
    args = ["auth", "init", "--out", str(auth), "--host", "0.0.0.0",
            "--jwt" if jwt else "--no-tls"]  # fmt: skip
    for c in NODES:  # the running nodes only: a new JetStream meta group waits for all
        own = [nodes[n] for n in NODES[c] if n in RUN]
        args += ["--route", f"{c}=" + ",".join(f"127.0.0.1:{n.cluster_port}" for n in own)]
        args += ["--gateway", f"{c}=" + ",".join(f"127.0.0.1:{n.gateway_port}" for n in own)]
    if not jwt:
        args += ["--embedded-agent", "a1", "--worker", f"w:{EVENT}/security,{ASK_EVENT}/asker"]
    _hookbus(*args)
    shutil.copy(DEPLOY / "common.conf", base / "common.conf")
    sc = Secured(base, auth, jwt, nodes)
    try:
        for n in RUN:
            nodes[n].start()
        anyio.run(_wait_ready, sc, backend="asyncio")
        _hookbus("auth", "provision", "--dir", str(auth), "--url", ",".join(sc.urls("west")),
                 "--placement-cluster", "east")  # fmt: skip
        if jwt:  # issued while the servers run: no file of theirs changes, no reload
            _hookbus("auth", "issue", "agent", "a1", "--embedded", "--dir", str(auth))
            _hookbus("auth", "issue", "worker", "w", "--handler", f"{EVENT}/security",
                     "--handler", f"{ASK_EVENT}/asker", "--dir", str(auth))  # fmt: skip
        yield sc
    finally:
        for node in nodes.values():
            node.stop()


async def _wait_ready(sc: Secured) -> None:
    running = [sc.nodes[n] for n in RUN]
    for node in running:
        await node.wait_healthy(READY_S)

    def linked() -> bool:
        east1, east2, _ = running
        return (
            "east-n2" in east1.route_peers()
            and "east-n1" in east2.route_peers()
            and all(n.gateway_peers()["outbound"] >= ({"east", "west"} - {n.cluster})
                    for n in running)
        )  # fmt: skip

    async def ready() -> bool:
        return await anyio.to_thread.run_sync(linked)

    await wait_for(ready, READY_S)


async def _connect(sc: Secured, cluster: str, role: str, name: str, opened: list[NATS]) -> NATS:
    """A client of `cluster`'s running nodes as identity (`role`, `name`)."""
    who = load_setup(sc.auth).find("HOOKBUS", role, name)
    stem = f"{role}-{name}"
    secret = sc.auth / (f"{stem}.creds" if sc.jwt else f"{stem}.nk")
    assert secret.is_file() and (who is None) == sc.jwt  # JWT: issued, not in the manifest
    key = "creds" if sc.jwt else "nkey"
    settings = ConnectionSettings(**{key: str(secret)}, tls_ca=auth_ca(str(secret)))
    assert (settings.tls_ca is not None) == sc.jwt  # the JWT run speaks TLS
    nc = NATS()
    opened.append(nc)
    await nc.connect(servers=sc.urls(cluster), connect_timeout=15, max_reconnect_attempts=-1,
                     **settings.nats_options())  # fmt: skip
    return nc


async def test_an_agent_in_west_and_a_worker_in_east_decide_across_the_gateway(
    secured: Secured, conns: list[NATS]
) -> None:
    worker_nc = await _connect(secured, "east", "worker", "w", conns)
    agent_nc = await _connect(secured, "west", "agent", "a1", conns)
    async with site_worker(worker_nc), HookDispatcher(agent_nc, agent_id="a1") as d:
        with anyio.fail_after(30):
            while not d.routes(EVENT):
                await d.refresh()
                await anyio.sleep(0.05)
        bad = {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}
        denied = await d.emit(EVENT, bad)
        assert denied.action == "deny" and denied.decided_by == "security", denied
        ok = {"tool_name": "bash", "tool_input": {"command": "ls"}}
        allowed = await d.emit(EVENT, ok)
        assert allowed.action == "continue" and not allowed.failures, allowed


async def _refused(node: ShippedNode, link: str, refusers: list[ShippedNode]) -> None:
    """Start `node` and wait until it has logged its `link` (``Route``, ``Gateway``) refused
    and each of `refusers` has logged refusing one since."""
    marks = {n.name: n.log_size() for n in refusers}

    async def logged() -> bool:
        return node.log_has(f"{link} Error 'Authorization Violation'") and all(
            n.log_has(f"{'Router' if link == 'Route' else link} connection closed:"
                      " Authentication Failure", since=marks[n.name])
            for n in refusers
        )  # fmt: skip

    node.start()
    try:
        await wait_for(logged, READY_S)
    except TimeoutError:
        tails = {n.name: n.log_file.read_text(errors="replace")[-1500:] for n in [node, *refusers]}
        raise AssertionError(f"no refusal logged: {tails}") from None


async def test_a_node_with_a_wrong_route_password_does_not_join(secured: Secured) -> None:
    east = [secured.nodes["east-n1"], secured.nodes["east-n2"]]
    intruder = secured.intruder(
        ROUTE_INTRUDER, wrong=("cluster-auth-east.conf", "gateway-auth.conf")
    )
    try:
        await _refused(intruder, "Route", east)
        assert intruder.running
        for node in east:
            assert ROUTE_INTRUDER not in node.route_peers(), node.name
        assert intruder.route_peers() == set()
        assert intruder.gateway_peers() == {"outbound": set(), "inbound": set()}
    finally:
        intruder.stop()


async def test_a_gateway_with_a_wrong_password_does_not_connect(secured: Secured) -> None:
    east = [secured.nodes["east-n1"], secured.nodes["east-n2"]]
    west = secured.nodes["west-n1"]
    intruder = secured.intruder(GATEWAY_INTRUDER, wrong=("gateway-auth.conf",))
    try:
        await _refused(intruder, "Gateway", east)
        assert intruder.running

        async def routed() -> bool:  # the route password is right: it joins west
            return await anyio.to_thread.run_sync(lambda: "west-n1" in intruder.route_peers())

        await wait_for(routed, READY_S)
        assert intruder.gateway_peers() == {"outbound": set(), "inbound": set()}
        assert west.gateway_peers()["outbound"] >= {"east"}  # the right one stays linked
    finally:
        intruder.stop()
