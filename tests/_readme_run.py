"""Running README.md's blocks for real: shell commands as subprocesses, Python blocks in a
subprocess with top-level ``await`` (as ``python -m asyncio`` runs them).

`Shell` runs the commands of shell blocks (`_readme_blocks.commands`) one by one:

- ``hookbus ...`` (or ``.venv/bin/hookbus ...``) is this venv's console script. Commands
  that terminate are run to their end; the services (``server``, ``worker``,
  ``dispatcher``, ``console``, ``gateway``, ``tail``) are started and waited for until
  they print their banner, and stopped with SIGINT by `Shell.stop` or ``kill -INT %N``.
- What the README leaves to the reader is filled in, and only that: a ``nats://`` URL
  becomes the test's server, ``VAR=...`` a generated secret, an HTTP service's port a free
  one (and ``127.0.0.1:<its README port>`` in later commands the port it got), and a
  server the block starts itself gets a free client port.
- ``pip install`` and ``python3 -m venv`` are not run (tests/test_packaging.py installs
  the wheel in clean venvs); ``nats req SUBJECT BODY`` is sent with nats-py (the ``nats``
  CLI is not installed here); ``curl`` is curl. Anything else fails the test.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import nats
from _procs import children_of
from _readme_blocks import Block, Command

HOOKBUS = str(Path(sys.executable).with_name("hookbus"))
"""This venv's console script."""

BANNERS = {
    "server": r"^nats-server .* at (nats|tls)://",
    "worker": r"^hookbus worker: serving",
    "dispatcher": r"^dispatcher serving",
    "console": r"^hookbus console serving (?P<url>\S+)",
    "gateway": r"^hookbus gateway serving (?P<url>\S+)",
    "tail": r"^following the decision audit trail",
}
"""The line each service prints once it serves."""

HTTP_DEFAULT_PORTS = {"console": 8090, "gateway": 8081}
"""The port an HTTP service listens on without --port (its --help says so)."""

NOT_RUN = {
    "pip": "installing: tests/test_packaging.py installs the wheel in clean venvs",
    "venv": "a venv: tests/test_packaging.py makes clean ones",
}


@dataclass
class Result:
    """A command run to its end."""

    argv: list[str]
    code: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"$ {' '.join(self.argv)}\nexit {self.code}\n{self.stdout}{self.stderr}"


@dataclass
class Job:
    """A long-running command: its process, every line it printed, its exit code."""

    argv: list[str]
    proc: asyncio.subprocess.Process
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    url: str = ""
    children: list[int] = field(default_factory=list)
    code: int | None = None
    _pumps: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return " ".join(self.argv[1:3])

    @property
    def output(self) -> str:
        return "".join(self.out) + "".join(self.err)

    async def wait_for(
        self, pattern: str, *, stdout: bool = True, stderr: bool = True, timeout_s: float = 30
    ) -> str:
        """The first line printed (on stdout, stderr or both) matching `pattern`, waiting
        for it.

        Raises:
            AssertionError: the process exited, or `timeout_s` passed, without it.
        """
        with anyio.move_on_after(timeout_s):
            while True:
                for line in (self.out if stdout else []) + (self.err if stderr else []):
                    if re.search(pattern, line):
                        return line
                if self.proc.returncode is not None and all(p.done() for p in self._pumps):
                    break
                await asyncio.sleep(0.05)
        raise AssertionError(f"{self.name}: no line matching {pattern!r}:\n{self.output}")

    async def stop(self, sig: int = signal.SIGINT, timeout_s: float = 30) -> int:
        """Send `sig` (if still running) and wait for the exit; its code."""
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            with anyio.fail_after(timeout_s):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise AssertionError(f"{self.name} did not stop within {timeout_s} s") from None
        with anyio.fail_after(5):
            await asyncio.gather(*self._pumps)
        self.code = code = await self.proc.wait()
        return code


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without NATS_* and HOOKBUS_* (the reader's shell has none), plus
    `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env.update(extra)
    return env


class Shell:
    """Runs README shell commands for real (see the module docstring).

    Args:
        cwd: the folder the commands run in (a fresh temporary one).
        nats_url: what a ``nats://`` URL in a command becomes, and ``NATS_URL`` of every
            hookbus command (none: the block names its own server).
        server_port: the client port of a server the block starts (``hookbus server``,
            ``hookbus auth init``); its ``127.0.0.1:4222`` becomes this port.
    """

    def __init__(self, cwd: Path, nats_url: str | None = None, server_port: int | None = None):
        self.cwd = cwd
        self.nats_url = nats_url
        self.server_port = server_port
        self.jobs: list[Job] = []
        """Background commands (``&``), numbered from 1 for ``kill %N``."""
        self.services: list[Job] = []
        """Every long-running command started, background or not, in order."""
        self.results: dict[str, Result] = {}
        self.not_run: list[tuple[str, str]] = []
        """(command, why) of each command not run."""
        self.secrets: dict[str, str] = {}
        self.http: dict[int, str] = {}
        """README port → the host:port its service got."""

    # -- rewriting ---------------------------------------------------------------------------
    def _hookbus_argv(self, cmd: Command) -> tuple[list[str], str, int | None]:
        """The command's argv, its kind (``server``, ``worker`` ...) and, for an HTTP
        service, the port the README gives it (or its default)."""
        args = [self._address(a) for a in cmd.argv[1:]]
        kind = args[0] if args else ""
        if kind in ("server", "auth") and self.server_port is not None:
            if "--port" not in args and "--config" not in args:
                args.append("--port")
                args.append(str(self.server_port))
        http_port = None
        if kind in HTTP_DEFAULT_PORTS:
            if "--port" in args:
                i = args.index("--port") + 1
                http_port, args[i] = int(args[i]), "0"
            else:
                http_port = HTTP_DEFAULT_PORTS[kind]
                args += ["--port", "0"]
        return [HOOKBUS, *args], kind, http_port

    def _address(self, arg: str) -> str:
        if arg.startswith("nats://"):
            if self.server_port is not None:
                return arg.replace("127.0.0.1:4222", f"127.0.0.1:{self.server_port}")
            assert self.nats_url, f"{arg}: this block has no server to connect to"
            return self.nats_url
        for port, actual in self.http.items():
            arg = arg.replace(f"127.0.0.1:{port}", actual)
        return arg

    def _env(self, cmd: Command) -> dict[str, str]:
        env = clean_env()
        if self.nats_url:
            env["NATS_URL"] = self.nats_url
        for name, value in cmd.env.items():
            if value == "...":  # the reader's own secret
                value = self.secrets.setdefault(name, secrets.token_urlsafe(12))
            env[name] = value
        return env

    # -- running -----------------------------------------------------------------------------
    async def run(self, cmd: Command) -> Result | Job | None:
        """Run one command: a `Result` when it terminates, a `Job` when it serves, None
        when it is not run (installs) or is job control (``kill``).

        Raises:
            AssertionError: a command this shell does not know, or one that printed a
                traceback.
        """
        program = Path(cmd.argv[0]).name
        if program in ("pip", "pip3") or (program.startswith("python") and "venv" in cmd.argv):
            self.not_run.append((cmd.text, NOT_RUN["pip" if "pip" in program else "venv"]))
            return None
        if program == "kill":
            await self._kill(cmd)
            return None
        if program == "nats" and cmd.argv[1:2] == ["req"]:
            return await self._nats_request(cmd)
        if program == "curl":
            return await self._exec(["curl", *map(self._address, cmd.argv[1:])], clean_env())
        assert program == "hookbus", f"README.md:{cmd.line}: no way to run {cmd.text!r}"
        argv, kind, http_port = self._hookbus_argv(cmd)
        if kind in BANNERS or cmd.background:
            return await self._start(argv, kind, self._env(cmd), cmd.background, http_port)
        key = " ".join(argv)
        if key not in self.results:  # the same command in two blocks runs once
            self.results[key] = await self._exec(argv, self._env(cmd))
        return self.results[key]

    async def run_block(self, block: Block) -> list[Result | Job | None]:
        from _readme_blocks import commands

        return [await self.run(cmd) for cmd in commands(block)]

    async def _exec(
        self, argv: list[str], env: dict[str, str], timeout_s: float = 60, shown: str = ""
    ) -> Result:
        """Run `argv` to its end (killed after `timeout_s`); the `Result` names it as
        `shown` if given. Raises AssertionError on a timeout or a traceback."""
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            with anyio.fail_after(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"{' '.join(argv)} ran more than {timeout_s} s") from None
        except BaseException:  # cancelled: the command goes with the test
            if proc.returncode is None:
                proc.kill()
            raise
        result = Result(
            [shown] if shown else argv, proc.returncode or 0, out.decode(), err.decode()
        )
        assert "Traceback" not in result.stderr, str(result)
        return result

    async def _start(
        self, argv: list[str], kind: str, env: dict[str, str], bg: bool, http_port: int | None
    ) -> Job:
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        job = Job(argv, proc)
        assert proc.stdout is not None and proc.stderr is not None
        job._pumps = [asyncio.create_task(_pump(proc.stdout, job.out)),
                      asyncio.create_task(_pump(proc.stderr, job.err))]  # fmt: skip
        self.services.append(job)
        if bg:
            self.jobs.append(job)
        if kind in BANNERS:
            banner = await job.wait_for(BANNERS[kind])
            found = re.search(BANNERS[kind], banner)
            job.url = (found.groupdict().get("url") or "") if found else ""
        if http_port is not None and job.url:
            self.http[http_port] = job.url.split("//", 1)[1].rstrip("/")
        job.children = children_of(proc.pid)
        return job

    async def _kill(self, cmd: Command) -> None:
        sig = signal.SIGTERM
        for word in cmd.argv[1:]:
            if word.startswith("-"):
                sig = signal.Signals[f"SIG{word[1:]}"]
            else:
                assert word.startswith("%"), f"README.md:{cmd.line}: kill {word}: not a job"
                await self.jobs[int(word[1:]) - 1].stop(sig)

    async def _nats_request(self, cmd: Command) -> Result:
        subject, body = cmd.argv[2], cmd.argv[3]
        assert self.nats_url, "nats req: no server"
        nc = await nats.connect(self.nats_url, connect_timeout=5)
        try:
            reply = await nc.request(subject, body.encode(), timeout=10)
        finally:
            await nc.close()
        return Result(cmd.argv, 0, reply.data.decode(), "")

    async def stop(self) -> dict[str, int]:
        """SIGINT every service still running, newest first; each one's exit code, by
        name. Every service's output is checked for tracebacks."""
        codes: dict[str, int] = {}
        for job in reversed(self.services):
            code = job.code if job.code is not None else await job.stop()
            codes[job.name] = code
            assert "Traceback" not in job.output, f"{job.name}:\n{job.output}"
        return codes


async def _pump(stream: asyncio.StreamReader, lines: list[str]) -> None:
    async for line in stream:
        lines.append(line.decode())


_RUNNER = r"""
import ast, asyncio, sys

async def main(groups):
    namespace = {"__name__": "__main__"}

    async def run(path):
        code = compile(open(path).read(), "README.md", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)
        if result is not None:
            await result

    for group in groups:
        await asyncio.gather(*(run(path) for path in group))

groups, group = [], []
for arg in sys.argv[1:]:
    if arg == "--then":
        groups.append(group)
        group = []
    else:
        group.append(arg)
asyncio.run(main(groups + [group]))
"""


@dataclass
class Snippet:
    """Python to run: a README block (its README line numbers kept in tracebacks) or the
    test's own code around it."""

    code: str
    line: int = 0

    @classmethod
    def of(cls, block: Block, *, nats_url: str | None = None) -> Snippet:
        code = block.text
        if nats_url:
            code = code.replace("nats://127.0.0.1:4222", nats_url)
        return cls(code, block.line)


async def run_python(folder: Path, *groups: list[Snippet], timeout_s: float = 60) -> Result:
    """Run the snippets in one Python process sharing one namespace: each group after the
    previous one, the snippets of a group concurrently (asyncio tasks). Top-level
    ``await``, ``async with`` and ``async for`` are allowed."""
    argv = [sys.executable, "-c", _RUNNER]
    for g, group in enumerate(groups):
        if g:
            argv.append("--then")
        for s, snippet in enumerate(group):
            path = folder / f"snippet_{g}_{s}.py"
            path.write_text("\n" * max(snippet.line - 1, 0) + snippet.code)
            argv.append(str(path))
    shown = " then ".join(" + ".join(f"README.md:{s.line}" if s.line else "(the test's code)"
                                     for s in group) for group in groups)  # fmt: skip
    return await Shell(folder)._exec(argv, clean_env(), timeout_s, shown=f"python: {shown}")
