"""Claude Code command hook benchmark: spawn-to-exit of ``hookbus claude-code``.

    .venv/bin/python benchmarks/claude_code_bench.py            # about 40 s
    .venv/bin/python benchmarks/claude_code_bench.py --runs 15  # fewer samples
    .venv/bin/python benchmarks/claude_code_bench.py --real-cli # the real CLI's turn, ~2 min

Claude Code spawns the hook command for every hook event, so a tool call waits for one
process start, one NATS connection and one emit. This measures, in the same run, the
wall-clock time from spawn to exit (stdin written, stdout read) of:

- ``python -c pass``: the interpreter's own start (the floor of any Python hook);
- ``python -c "import nats.aio.client"``: the start plus nats-py alone (the floor of any
  Python hook that talks to NATS);
- ``hookbus claude-code`` with a ``PreToolUse`` input, against a ``hookbus dispatcher``
  process and a ``hookbus worker`` process (this file, ``:worker``: one ``tool:pre``
  handler that answers continue, or deny for ``rm -rf``), decided "continue" (no output)
  and "deny" (JSON on stdout);
- the same with ``--embedded`` (an in-process dispatcher instead of the service).

Then the import time of the hook's code path (``-X importtime``, cumulative, and the wall
time of the import in a fresh process). Target: the hook's p50 at most 150 ms. A command,
not a test: it exits 0 whether the target is met or not (1 if the run itself failed).
Starts its own nats-server (`hookbus.cli.EmbeddedNatsServer`).

Bytecode: an installed hookbus runs from cached bytecode (``__pycache__``). The rows run
with ``PYTHONPYCACHEPREFIX`` set to a temporary folder and ``PYTHONDONTWRITEBYTECODE``
unset, so they measure that without writing into the source tree; one more row runs the
hook in the caller's environment as it is (with ``PYTHONDONTWRITEBYTECODE=1``, an editable
install compiles hookbus's own sources at every start).

``--real-cli``: what a tool call costs in the real Claude Code CLI (npm
``@anthropic-ai/claude-code``, installed as tests/test_claude_code_real.py installs it). One
headless turn (``claude -p``) against a local fake Anthropic Messages API
(tests/_claude_cli.py) that asks for one ``Bash`` call (``touch ran``, checked after every
turn) and then ends the turn, timed from spawn to exit, rows interleaved: no hooks; the
command door and the HTTP door (``hookbus gateway http``) with the settings
``hookbus claude-code settings`` writes (every event: SessionStart, UserPromptSubmit,
PreToolUse, PostToolUse, Stop, SessionEnd run in such a turn); and each door on
``PreToolUse`` only (``--events PreToolUse``: the hook on the tool call's own path); and
``true`` as the one ``PreToolUse`` command hook, the floor of any command hook (Claude
Code's own cost of running a command, with a hook that does nothing). Each
row's p50/p95 and its p50's difference to and ratio over the no-hooks row of the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler("tool:pre")
async def guard(event: str, data: dict[str, Any]) -> HookResult:
    if "rm -rf" in str(data.get("tool_input", {}).get("command", "")):
        return HookResult(action="deny", reason="destructive command")
    return HookResult(action="continue")


PYTHON = sys.executable
HOOKBUS = str(Path(sys.executable).with_name("hookbus"))
AS_IS = {
    **{k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))},
    "NATS_CONTEXT": "",
}
ENV = {k: v for k, v in AS_IS.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""The rows' environment: bytecode cached (under PYTHONPYCACHEPREFIX, set in `main`)."""
TARGET_MS = 150.0
HOOK_ROW = "hookbus claude-code, continue (service)"


def pre_tool_use(command: str) -> bytes:
    return json.dumps(
        {
            "session_id": "bench",
            "transcript_path": "/tmp/bench.jsonl",
            "cwd": "/tmp",
            "permission_mode": "default",
            "hook_event_name": "PreToolUse",
            "tool_name": "Bash",
            "tool_input": {"command": command},
            "tool_use_id": "toolu_bench",
        }
    ).encode()


def spawn(
    argv: list[str], stdin: bytes = b"", env: dict[str, str] | None = None
) -> tuple[float, subprocess.CompletedProcess[bytes]]:
    start = time.perf_counter()
    done = subprocess.run(argv, input=stdin, capture_output=True, env=env or ENV, timeout=60)
    return time.perf_counter() - start, done


def measure(
    argv: list[str],
    runs: int,
    stdin: bytes = b"",
    expect: bytes | None = None,
    env: dict[str, str] | None = None,
) -> list[float]:
    """Seconds per run (one warm-up run first, not counted). `expect`: b"" for no output,
    else bytes the output must hold; None: not checked."""
    spawn(argv, stdin, env)
    times = []
    for _ in range(runs):
        seconds, done = spawn(argv, stdin, env)
        wrong = expect is not None and (
            done.stdout != b"" if expect == b"" else expect not in done.stdout
        )
        if done.returncode != 0 or wrong:
            raise SystemExit(
                f"{' '.join(argv)} failed: exit {done.returncode}\n"
                f"stdout: {done.stdout!r}\nstderr: {done.stderr.decode()[-2000:]}"
            )
        times.append(seconds)
    return times


def p(times: list[float], q: float) -> float:
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1000


@contextlib.contextmanager
def services(url: str, logs: Path) -> Iterator[None]:
    """The dispatcher service and this file's worker as processes, their output in `logs`
    (the tests' `_procs.processes`: stopped on the way out)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _procs import processes

    with processes(
        [HOOKBUS, "dispatcher", "--url", url, "--grace-period", "1"],
        [HOOKBUS, "worker", f"{Path(__file__).resolve()}:worker", "--url", url],
        env=ENV,
        logs=logs,
    ):
        yield


def wait_ready(url: str) -> None:
    deny = pre_tool_use("rm -rf /")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        _, done = spawn([HOOKBUS, "claude-code", "--url", url], deny)
        if b'"permissionDecision":"deny","permissionDecisionReason":"destructive' in done.stdout:
            return
        time.sleep(0.2)
    raise SystemExit("the dispatcher and worker were not ready within 30 s")


def import_figures() -> tuple[float, float]:
    """(cumulative -X importtime of the hook's module, ms; wall time of its import, ms)."""
    module = "hookbus.cli._claude_code_cmd"
    done = subprocess.run([PYTHON, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, env=ENV, check=True)  # fmt: skip
    line = next(x for x in done.stderr.decode().splitlines() if x.rstrip().endswith(f"| {module}"))
    cumulative = int(re.split(r"\s*\|\s*", line)[1]) / 1000
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    walls = [float(subprocess.run([PYTHON, "-c", code], capture_output=True, env=ENV,
                                  check=True).stdout) for _ in range(9)]  # fmt: skip
    return cumulative, statistics.median(walls) * 1000


@contextlib.contextmanager
def gateway(url: str, logs: Path) -> Iterator[str]:
    """``hookbus gateway http`` on a free port: its Claude Code URL."""
    log_path = logs / "gateway.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([HOOKBUS, "gateway", "http", "--port", "0", "--url", url],
                                env=ENV, stdout=log, stderr=log)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not (m := re.search(r"hookbus gateway serving (\S+)", log_path.read_text())):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"the gateway did not start:\n{log_path.read_text()}")
                time.sleep(0.1)
            yield m.group(1).rstrip("/") + "/claude-code"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def real_cli(runs: int) -> int:
    """The ``--real-cli`` rows (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _claude_cli import FakeMessagesApi, claude_binary, claude_env, run_claude, trust

    from hookbus.cli import EmbeddedNatsServer

    exe, why = claude_binary()
    if exe is None:
        raise SystemExit(f"the real Claude Code CLI is unavailable: {why}")
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                             env={**ENV, "HOME": tempfile.gettempdir()}).stdout.strip()  # fmt: skip
    rows: dict[str, list[float]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        EmbeddedNatsServer() as server,
        FakeMessagesApi(command="touch ran").serving() as api,
    ):
        ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        root = Path(tmp)
        with services(server.url, root), gateway(server.url, root) as gw:
            wait_ready(server.url)
            hook_args = ["--", "--url", server.url]
            http_args = ["--door", "http", "--url", gw]
            noop = {"type": "command", "command": "true"}
            noop_hook = {"PreToolUse": [{"matcher": "*", "hooks": [noop]}]}
            setups: dict[str, list[str] | dict[str, Any] | None] = {
                "no hooks": None,
                "command door, every event": hook_args,
                "HTTP door, every event": http_args,
                "command door, PreToolUse only": ["--events", "PreToolUse", *hook_args],
                "HTTP door, PreToolUse only": ["--events", "PreToolUse", *http_args],
                "`true` as the PreToolUse hook": noop_hook,
            }
            home = root / "home"
            home.mkdir()
            projects = {}
            for i, (label, settings_args) in enumerate(setups.items()):
                project = root / f"project{i}"
                settings = project / ".claude" / "settings.json"
                settings.parent.mkdir(parents=True)
                settings.write_text(json.dumps({"permissions": {"allow": ["Bash"]}}))
                if isinstance(settings_args, dict):  # a hooks block as is
                    settings.write_text(json.dumps({"permissions": {"allow": ["Bash"]},
                                                    "hooks": settings_args}))  # fmt: skip
                elif settings_args is not None:
                    subprocess.run([HOOKBUS, "claude-code", "settings", "--merge",
                                    str(settings), "--write", *settings_args],
                                   env=ENV, check=True, capture_output=True)  # fmt: skip
                trust(home, project)
                projects[label] = project
            env = claude_env(home, api.url, PYTHONPYCACHEPREFIX=ENV["PYTHONPYCACHEPREFIX"])

            def one(label: str) -> float:
                sentinel = projects[label] / "ran"
                sentinel.unlink(missing_ok=True)
                turn = run_claude(exe, projects[label], env, timeout=120)
                if turn.code != 0 or not sentinel.exists():
                    raise SystemExit(
                        f"{label}: the turn failed (exit {turn.code}, tool ran:"
                        f" {sentinel.exists()})\n{turn.stdout}\n{turn.stderr}"
                    )
                return turn.seconds

            for label in setups:  # warm-up, not counted
                one(label)
            for _ in range(runs):  # interleaved, so drift hits every row alike
                for label in setups:
                    rows.setdefault(label, []).append(one(label))
    base = p(rows["no hooks"], 0.5)
    print(f"{version}: one headless turn with one Bash call, spawn to exit, {runs} runs each")
    print(f"  {'(ms)':<32} {'p50':>7} {'p95':>7} {'p50 - no hooks':>15} {'p50 / no hooks':>15}")
    for label, times in rows.items():
        p50 = p(times, 0.5)
        print(f"  {label:<32} {p50:7.1f} {p(times, 0.95):7.1f} {p50 - base:+15.1f}"
              f" {p50 / base:15.2f}")  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="samples per row (default 30)")
    parser.add_argument(
        "--real-cli", action="store_true", help="time the real CLI's one-tool-call turn instead"
    )
    args = parser.parse_args()
    if args.real_cli:
        return real_cli(args.runs)
    from hookbus.cli import EmbeddedNatsServer

    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNatsServer() as server:
        ENV["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        url = server.url
        with services(url, Path(tmp)):
            wait_ready(url)
            hook = [HOOKBUS, "claude-code", "--url", url]
            continue_in, deny_in = pre_tool_use("npm test"), pre_tool_use("rm -rf /tmp/x")
            for _ in range(2):  # interleave, so drift hits every row alike
                for label, argv, stdin, expect, env in (
                    ("python -c pass", [PYTHON, "-c", "pass"], b"", None, ENV),
                    ("python -c 'import nats.aio.client'",
                     [PYTHON, "-c", "import nats.aio.client"], b"", None, ENV),
                    (HOOK_ROW, hook, continue_in, b"", ENV),
                    ("hookbus claude-code, deny (service)", hook, deny_in, b'"deny"', ENV),
                    ("hookbus claude-code --embedded, continue",
                     [*hook, "--embedded"], continue_in, b"", ENV),
                    ("hookbus claude-code, continue, env as is",
                     hook, continue_in, b"", AS_IS),
                ):  # fmt: skip
                    times = measure(argv, args.runs // 2, stdin, expect, env)
                    rows.setdefault(label, []).extend(times)
            cumulative, wall = import_figures()
    print(f"spawn to exit, {args.runs} runs each (ms)                p50     p95")
    for label, times in rows.items():
        print(f"  {label:<50} {p(times, 0.5):6.1f}  {p(times, 0.95):6.1f}")
    hook_p50 = p(rows[HOOK_ROW], 0.5)
    verdict = "MET" if hook_p50 <= TARGET_MS else "MISSED"
    print(f"target: hookbus claude-code p50 <= {TARGET_MS:.0f} ms: {hook_p50:.1f} ms, {verdict}")
    print(f"import hookbus.cli._claude_code_cmd: {cumulative:.1f} ms cumulative (-X importtime),"
          f" {wall:.1f} ms wall (median of 9)")  # fmt: skip
    as_is = AS_IS.get("PYTHONDONTWRITEBYTECODE") or "unset"
    print(f"rows use cached bytecode; 'env as is': PYTHONDONTWRITEBYTECODE={as_is}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
