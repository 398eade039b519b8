"""The long-running commands stop on the first Ctrl-C or SIGTERM and leave nothing behind.

Every command runs as a real subprocess in a process group of its own, as a terminal runs
a foreground job, so "Ctrl-C" is SIGINT to that whole group (``os.killpg``) and SIGTERM is
sent to the process alone, as an orchestrator does. After the exit: no nats-server child
is left (read from ``/proc``), the port it listened on is free, and the temporary data
folder of an embedded server is gone. SIGHUP is not a stop: ``hookbus server`` passes it
to its nats-server, which reads its config again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest
from _procs import alive, descendants
from nats.aio.client import Client as NATS

from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
POLICY = f"{EXAMPLES / 'security_policy.py'}:worker"
EXIT_WITHIN_S = 5.0
"""A command stopped by a signal with nothing in flight exits within this many seconds."""

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env.update(PYTHONUNBUFFERED="1", XDG_CONFIG_HOME=str(home), COLUMNS="200")
    return env


def _ignore_sigint() -> None:
    """How a non-interactive shell starts a background job (``hookbus server &``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Running:
    """A ``hookbus`` subprocess leading a process group of its own; stdout and stderr are
    read by threads as they arrive."""

    def __init__(self, *args: str, home: Path, ignore_sigint: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*HOOKBUS, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(home),
            start_new_session=True,
            preexec_fn=_ignore_sigint if ignore_sigint else None,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in stream:
            into.append(line)

    @property
    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def wait_for(self, needle: str, timeout: float = 30.0) -> str:
        """The first output line holding `needle` (fails if the process ends first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in [*self.out, *self.err]:
                if needle in line:
                    return line
            if self.proc.poll() is not None:
                time.sleep(0.1)  # the readers may still hold the last lines
                if needle in self.output:
                    return next(ln for ln in self.output.splitlines() if needle in ln)
                raise AssertionError(f"exited {self.proc.returncode} before {needle!r}:\n"
                                     f"{self.output}")  # fmt: skip
            time.sleep(0.02)
        raise AssertionError(f"no {needle!r} within {timeout}s:\n{self.output}")

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, within: float = EXIT_WITHIN_S) -> tuple[int, float]:
        """Wait for the exit: (status, seconds it took)."""
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running {within}s after the signal:\n{self.output}"
            ) from None
        for reader in self._readers:
            reader.join(timeout=5)
        return code, time.monotonic() - start

    def kill(self) -> None:
        """Kill it (and its group) if still running; close the pipes."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Any]:
    """Start commands with `running(*args)`; every one still alive is killed at the end."""
    started: list[Running] = []

    def start(*args: str, ignore_sigint: bool = False) -> Running:
        r = Running(*args, home=tmp_path / "config", ignore_sigint=ignore_sigint)
        started.append(r)
        return r

    yield start
    for r in started:
        r.kill()


def port_free(port: int) -> bool:
    """Whether nothing listens on `port` (a connection to it is refused). Not a bind: the
    port comes from the ephemeral range, and another test's client connection may hold it
    as its own local port, which makes a bind fail with nothing listening (seen in CI)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:  # a listener too busy to accept within 2 s is still a listener
        return False


def wait_gone(pid: int, timeout: float = EXIT_WITHIN_S) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def nats_children(r: Running) -> list[int]:
    pids = [p for p in descendants(r.proc.pid) if "nats-server" in _cmdline(p)]
    assert pids, f"no nats-server below {r.proc.pid}"
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


_EMBEDDED = re.compile(r"embedded nats-server at nats://127\.0\.0\.1:(\d+) \(data in (\S+),")


def embedded(r: Running) -> tuple[int, Path]:
    """The port and data folder of the embedded server the command announced."""
    line = r.wait_for("embedded nats-server at")
    match = _EMBEDDED.search(line)
    assert match, line
    return int(match.group(1)), Path(match.group(2))


def assert_clean(r: Running, children: list[int], port: int, folder: Path | None) -> None:
    for pid in children:
        assert not alive(pid), f"nats-server {pid} outlived {r.proc.pid}: {_cmdline(pid)}"
    assert port_free(port), f"port {port} still taken after the exit"
    if folder is not None:
        assert not folder.exists(), f"{folder} left behind"
    assert "Traceback" not in r.output, r.output


# -- hookbus server -------------------------------------------------------------------------
def _server(running: Any, tmp_path: Path, **kw: Any) -> tuple[Running, int]:
    r = running("server", "--port", "-1", "--data-dir", str(tmp_path / "nats"), **kw)
    line = r.wait_for("Ctrl-C stops it")
    return r, int(line.split("nats://127.0.0.1:")[1].split(";")[0])


def test_server_stops_on_ctrl_c(running: Any, tmp_path: Path) -> None:
    r, port = _server(running, tmp_path)
    children = nats_children(r)
    r.ctrl_c()
    code, _took = r.finish()
    assert code == 0, r.output
    assert_clean(r, children, port, None)
    assert "SIGINT: stopping nats-server" in r.output


def test_server_stops_on_ctrl_c_when_started_as_a_background_job(
    running: Any, tmp_path: Path
) -> None:
    """Started with SIGINT ignored (``hookbus server &`` in a script), Ctrl-C still stops
    it: nats-server would ignore nothing, and a hookbus left waiting for a dead child
    would hang."""
    r, port = _server(running, tmp_path, ignore_sigint=True)
    children = nats_children(r)
    r.ctrl_c()
    code, _ = r.finish()
    assert code == 0, r.output
    assert_clean(r, children, port, None)


def test_server_stops_on_sigterm(running: Any, tmp_path: Path) -> None:
    r, port = _server(running, tmp_path)
    children = nats_children(r)
    r.signal(signal.SIGTERM)
    code, _ = r.finish()
    assert code == 0, r.output
    assert_clean(r, children, port, None)


def test_server_killed_takes_its_nats_server_along(running: Any, tmp_path: Path) -> None:
    """Even SIGKILL, which no handler sees, leaves no nats-server on the port."""
    r, port = _server(running, tmp_path)
    (child,) = nats_children(r)
    r.signal(signal.SIGKILL)
    r.finish()
    assert wait_gone(child), f"nats-server {child} orphaned on port {port}"
    deadline = time.monotonic() + EXIT_WITHIN_S
    while not port_free(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert port_free(port)


def test_server_that_cannot_start_says_why(running: Any, tmp_path: Path) -> None:
    r = running("server", "--port", "99999", "--data-dir", str(tmp_path / "nats"))
    code, _ = r.finish(within=15)
    assert code == 1
    assert "invalid port" in r.output and "Traceback" not in r.output


def _connects(url: str, seed: Path) -> bool:
    """Whether the server lets the nkey user of `seed` connect (an authorization
    violation, or any other refusal: False)."""

    async def quiet(exc: Exception) -> None:
        pass

    async def attempt() -> bool:
        nc = NATS()
        try:
            await nc.connect(
                url, nkeys_seed=str(seed), allow_reconnect=False, connect_timeout=5,
                max_reconnect_attempts=0, error_cb=quiet,
            )  # fmt: skip
            return True
        except (nats.errors.Error, OSError, TimeoutError):
            return False
        finally:
            await nc.close()  # a refused one too: its socket is not left to the GC

    return asyncio.run(attempt())


def test_server_reloads_its_config_on_sighup_and_runs_on(running: Any, tmp_path: Path) -> None:
    """``kill -HUP <hookbus server>`` is nats-server's config reload (docs/security.md):
    the same nats-server reads the config again, an identity added since (`hookbus auth
    add`) connects afterwards and not before, one line says so, and the server runs on;
    a config nats-server refuses changes nothing, and that is said too."""
    auth = tmp_path / "auth"
    env = _env(tmp_path / "config")
    made = subprocess.run(
        [*HOOKBUS, "auth", "init", "--out", str(auth), "--no-tls", "--agent", "payments"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    config = str(auth / "server.conf")
    r = running("server", "--config", config, "--port", "-1", "--data-dir", str(tmp_path / "run"))
    line = r.wait_for("Ctrl-C stops it")
    assert f"kill -HUP {r.proc.pid} reloads it" in line, line
    port = int(line.split("nats://127.0.0.1:")[1].split(";")[0])
    url = f"nats://127.0.0.1:{port}"
    (child,) = nats_children(r)
    added = subprocess.run(
        [*HOOKBUS, "auth", "add", "agent", "billing", "--dir", str(auth)],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    billing, payments = auth / "agent-billing.nk", auth / "agent-payments.nk"
    assert _connects(url, payments) and not _connects(url, billing)  # not reloaded yet

    r.signal(signal.SIGHUP)
    said = r.wait_for("hookbus server: SIGHUP:")
    assert said.strip() == f"hookbus server: SIGHUP: nats-server reloaded {config}", said
    assert r.proc.poll() is None and nats_children(r) == [child]  # reloaded, not restarted
    assert _connects(url, billing) and _connects(url, payments)

    good = (auth / "auth.conf").read_text()
    (auth / "auth.conf").write_text(good + "\nnot a config {{{\n")
    r.signal(signal.SIGHUP)
    said = r.wait_for("did not reload")
    assert "runs on as it was" in said and "auth.conf" in said, said
    assert r.proc.poll() is None and nats_children(r) == [child]
    assert _connects(url, billing)  # the config it had

    r.signal(signal.SIGTERM)
    code, _ = r.finish()
    assert code == 0, r.output
    assert_clean(r, [child], port, None)
    assert r.output.count("hookbus server: SIGHUP:") == 2, r.output


def test_the_development_server_runs_on_after_sighup(running: Any, tmp_path: Path) -> None:
    """Without --config there is nothing to reload: one line says so, nothing stops."""
    r, port = _server(running, tmp_path)
    children = nats_children(r)
    r.signal(signal.SIGHUP)
    r.wait_for("the development server has no config file to reload")
    assert r.proc.poll() is None and nats_children(r) == children
    r.signal(signal.SIGTERM)
    code, _ = r.finish()
    assert code == 0, r.output
    assert_clean(r, children, port, None)


# -- worker, dispatcher with --embedded ---------------------------------------------------
SERVING = {
    "worker": ("worker", POLICY),
    "dispatcher": ("dispatcher",),
}
READY = {"worker": "hookbus worker: serving 2 handler(s)", "dispatcher": "dispatcher serving"}


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
@pytest.mark.parametrize("command", sorted(SERVING))
def test_embedded_service_stops_cleanly(running: Any, command: str, how: str) -> None:
    r = running(*SERVING[command], "--embedded")
    port, folder = embedded(r)
    r.wait_for(READY[command])
    children = nats_children(r)
    if how == "ctrl-c":
        r.ctrl_c()
    else:
        r.signal(signal.SIGTERM)
    code, _ = r.finish()
    assert code == 0, r.output
    assert "draining" in r.output
    assert_clean(r, children, port, folder)


def test_worker_on_a_dead_server_stops_on_ctrl_c(running: Any, embedded_server: Any) -> None:
    r = running("worker", POLICY, "--url", embedded_server.url)
    r.wait_for(READY["worker"])
    embedded_server.kill()
    r.wait_for("lost the connection to NATS")
    r.ctrl_c()
    code, _ = r.finish()
    assert code == 0, r.output
    assert "Traceback" not in r.output


def test_worker_gives_up_on_a_dead_server(running: Any, embedded_server: Any) -> None:
    """Bounded reconnection: two attempts 2 s apart, then one error line and exit 1."""
    r = running("worker", POLICY, "--url", embedded_server.url, "--max-reconnects", "2")
    r.wait_for(READY["worker"])
    embedded_server.kill()
    code, _took = r.finish(within=20)
    assert code == 1, r.output
    line = r.wait_for("Error: ")
    assert "gave up on NATS at nats://127.0.0.1:" in line and "2 reconnect attempts" in line
    assert "Traceback" not in r.output


def test_second_ctrl_c_stops_at_once(running: Any, tmp_path: Path, nats_url: str) -> None:
    """A request in flight and a long grace period: the first Ctrl-C drains, the second
    stops at once (exit 130)."""
    event = f"test:{uuid.uuid4().hex[:10]}"
    module = tmp_path / "slow_worker.py"
    module.write_text(
        "import asyncio\nfrom hookbus.workers import HookWorker\nworker = HookWorker()\n\n"
        f"@worker.handler({event!r}, timeout_s=60)\n"
        "async def slow(event, data):\n    print('handling', flush=True)\n"
        "    await asyncio.sleep(60)\n"
    )
    r = running("worker", f"{module}:worker", "--url", nats_url, "--grace-period", "60")
    r.wait_for("serving 1 handler(s)")
    emitter = running("emit", event, "{}", "--url", nats_url)
    r.wait_for("handling")
    r.ctrl_c()
    r.wait_for("draining")
    time.sleep(0.3)
    assert r.proc.poll() is None  # still draining the request in flight
    r.ctrl_c()
    code, _ = r.finish()
    assert code == 130, r.output
    assert "again: stopping at once" in r.output and "Traceback" not in r.output
    emitter.kill()


# -- emit -----------------------------------------------------------------------------------
@pytest.fixture
async def asking_worker(nc: Any) -> Any:
    """A worker whose handler asks for an approval nobody gives; yields (event, called)."""
    event = f"test:{uuid.uuid4().hex[:10]}"
    called = anyio.Event()
    w = HookWorker(nc)

    @w.handler(event)
    async def ask(ev: str, data: dict[str, Any]) -> HookResult:
        called.set()
        return HookResult(
            action="ask_user", approval_prompt="Go?", approval_options=["Yes", "No"],
            approval_allow_options=["Yes"], approval_timeout=120,
        )  # fmt: skip

    async with w:
        yield event, called


@pytest.mark.anyio
@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
async def test_emit_waiting_on_an_approval_stops_at_once(
    running: Any, nats_url: str, asking_worker: Any, sig: int, status: int
) -> None:
    event, called = asking_worker
    r = running("emit", event, '{"tool_name": "deploy"}', "--url", nats_url)
    with anyio.fail_after(30):
        await called.wait()
    await anyio.sleep(1.0)  # the approval is being waited on
    assert r.proc.poll() is None, r.output
    if sig == signal.SIGINT:
        r.ctrl_c()
    else:
        r.signal(sig)
    code, took = await anyio.to_thread.run_sync(r.finish, 3.0)
    assert code == status, r.output
    assert took < 3.0
    assert "Traceback" not in r.output
