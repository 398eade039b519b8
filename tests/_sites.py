"""A hub and leaf-node servers on 127.0.0.1, for the site tests and the site benchmarks.

Each server is a real ``nats-server`` process (`hookbus.cli.find_nats_server`) with its
config and log file in a base folder. The hub runs JetStream in domain ``hub`` and takes
leaf connections; a leaf links to a given port (the hub's leafnode port, or a relay in
front of it) with a 1 s x 2 ping, so a silent link is noticed in 2 s. Readiness is a poll
of the client port and of the leaf's log ("JetStream using domains" once linked), never a
sleep; a server that exits meanwhile fails the wait with its log's tail. `site_worker` is
the worker the site tests (and the supercluster's) decide with.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from _cluster import free_ports
from nats.aio.client import Client as NATS

from hookbus.cli import find_nats_server
from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

__all__ = [
    "ASK_EVENT",
    "EVENT",
    "HUB_DOMAIN",
    "SitePorts",
    "asked_and_allowed",
    "hooked_and_resolved",
    "hub_and_leaf",
    "hub_conf",
    "leaf_conf",
    "serve",
    "site_worker",
    "wait_linked",
    "wait_listening",
]

HUB_DOMAIN = "hub"
EVENT = "tool:pre"
ASK_EVENT = "tool:post"


def hub_conf(base: Path, port: int, link_port: int) -> str:
    """The hub: JetStream in domain `HUB_DOMAIN` (store under `base`), leafs on `link_port`."""
    return f"""
server_name: hub
listen: 127.0.0.1:{port}
jetstream {{ store_dir: "{base / "hub"}", domain: {HUB_DOMAIN} }}
leafnodes {{ listen: 127.0.0.1:{link_port}, no_advertise: true }}
"""


def leaf_conf(name: str, port: int, remote_port: int, *, domain: str | None = None,
              base: Path | None = None) -> str:  # fmt: skip
    """A leaf `name` linked to `remote_port`; with `domain`, JetStream of its own in that
    domain (store under `base`)."""
    jetstream = "" if domain is None else (
        f'jetstream {{ store_dir: "{(base or Path(".")) / name}", domain: {domain} }}\n'
    )  # fmt: skip
    return f"""
server_name: {name}
listen: 127.0.0.1:{port}
ping_interval: "1s"
ping_max: 2
{jetstream}leafnodes {{ remotes: [ {{ url: "nats-leaf://127.0.0.1:{remote_port}" }} ] }}
"""


def serve(name: str, conf: str, base: Path) -> subprocess.Popen[bytes]:
    """Start a nats-server with `conf` as ``<base>/<name>.conf``, logging to ``<name>.log``."""
    path, log = base / f"{name}.conf", base / f"{name}.log"
    path.write_text(conf)
    return subprocess.Popen(
        [find_nats_server(), "-c", str(path), "-l", str(log)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait(check: object, what: str, proc: subprocess.Popen[bytes] | None, log: Path,
          timeout_s: float) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"nats-server exited: {_tail(log)}")
        if check():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what}: {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-2000:] if log.exists() else "(no log)"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def wait_listening(port: int, proc: subprocess.Popen[bytes] | None, log: Path,
                   timeout_s: float = 10.0) -> None:  # fmt: skip
    """Return once something listens on `port` (`proc`'s server, logging to `log`).

    Raises:
        RuntimeError: `proc` exited first. TimeoutError: nothing listened in time.
    """
    _wait(lambda: _listening(port), f"nothing listens on {port}", proc, log, timeout_s)


def wait_linked(log: Path, proc: subprocess.Popen[bytes] | None = None,
                timeout_s: float = 10.0) -> None:  # fmt: skip
    """Return once the leaf logging to `log` has linked to a hub with JetStream.

    Raises:
        RuntimeError: `proc` exited first. TimeoutError: no link in time.
    """

    def linked() -> bool:
        return log.exists() and "JetStream using domains" in log.read_text()

    _wait(linked, "no leaf link", proc, log, timeout_s)


@dataclass(frozen=True)
class SitePorts:
    """The client ports of `hub_and_leaf`'s servers, and the ports of its leaf link."""

    hub: int
    leaf: int
    link: int
    """The hub's leafnode port."""
    remote: int
    """The port the leaf links to: `link`, or the relay's port."""
    base: Path

    @property
    def hub_url(self) -> str:
        return f"nats://127.0.0.1:{self.hub}"

    @property
    def leaf_url(self) -> str:
        return f"nats://127.0.0.1:{self.leaf}"

    @property
    def leaf_log(self) -> Path:
        return self.base / "leaf.log"


@contextlib.contextmanager
def hub_and_leaf(base: Path, *, relay: bool = False) -> Iterator[SitePorts]:
    """A hub and a leaf without JetStream, both listening (and linked, without `relay`).
    With `relay`, the leaf's remote is a free port nothing listens on: the caller starts a
    relay from it to `SitePorts.link`, then waits with `wait_linked`. Stopped on exit."""
    hub_port, leaf_port, link_port, relay_port = free_ports(4)
    remote = relay_port if relay else link_port
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(serve("hub", hub_conf(base, hub_port, link_port), base))
        wait_listening(hub_port, procs[0], base / "hub.log")
        procs.append(serve("leaf", leaf_conf("leaf", leaf_port, remote), base))
        wait_listening(leaf_port, procs[1], base / "leaf.log")
        if not relay:
            wait_linked(base / "leaf.log", procs[1])
        yield SitePorts(hub_port, leaf_port, link_port, remote, base)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def site_worker(nc: NATS, *, js_domain: str | None = None) -> HookWorker:
    """The worker the site tests decide with (not started): ``security`` on `EVENT`, a
    deny-policy guard that denies ``rm -rf``, and ``asker`` on `ASK_EVENT`, which asks the
    user."""
    worker = HookWorker(nc, js_domain=js_domain)

    @worker.handler(EVENT, name="security", failure_policy="deny")
    async def security(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" in str(data.get("tool_input", {}).get("command", "")):
            return HookResult(action="deny", reason="rm -rf is not allowed")
        return HookResult(action="continue")

    @worker.handler(ASK_EVENT, name="asker")
    async def asker(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user", approval_prompt="Run it?", approval_options=["Allow", "Deny"],
            approval_timeout=15,
        )  # fmt: skip

    return worker


async def hooked_and_resolved(
    d: HookDispatcher, other: HookDispatcher, agent_id: str, timeout_s: float
) -> list[Any]:
    """What ``d.hook("deploy")`` returns once `other` (another process's dispatcher, at
    another site) resolved it for agent `agent_id` with ``{"ok": True}``. A resolution
    that comes first is pre-registered and consumed alike; a write JetStream refuses
    while the sites settle is tried again, within `timeout_s` seconds."""
    got: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            got.append(await d.hook("deploy", timeout_s=timeout_s))

        tg.start_soon(wait)
        with anyio.fail_after(timeout_s):
            while True:
                try:
                    await other.resolve_hook("deploy", {"ok": True}, agent_id=agent_id)
                    break
                except Exception:  # JetStream not answering across the sites yet
                    await anyio.sleep(0.05)
    return got


async def asked_and_allowed(
    d: HookDispatcher, approver: ApprovalsClient, timeout_s: float
) -> HookResult:
    """What ``d.emit(ASK_EVENT)`` decides once `approver` (at another site) answered the
    approval its ``asker`` handler asked for with "Allow": the first record of the approver's
    listing, looked for every 0.05 s within `timeout_s` seconds."""
    out: list[HookResult] = []
    async with anyio.create_task_group() as tg:

        async def ask() -> None:
            out.append(await d.emit(ASK_EVENT, {"tool_name": "bash"}))

        tg.start_soon(ask)
        with anyio.fail_after(timeout_s):
            while not (page := await approver.approval_page()).records:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        record = page.records[0]
        await approver.answer_approval(
            record.label, "Allow", approver="ops", agent_id=record.agent_id
        )
    return out[0]
