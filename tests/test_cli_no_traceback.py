"""No user mistake ends in a traceback: every command and subcommand of the click tree
(walked from `hookbus.cli._command_tree.cli`, so a new command is covered the day it is added),
run as a real subprocess with bad input, exits non-zero with an error line and no
"Traceback" on stdout or stderr, within a bound.

Bad input, per command: an unknown option; no arguments when some are required; a bogus
value for its first typed option (a number, a choice, a duration, a size, a port); and,
for every command that connects, an unreachable ``--url nats://127.0.0.1:1``. Then the
mistakes named one by one: malformed JSON arguments, a worker module with a syntax error
or one that raises on import, output paths that cannot be written, malformed URLs. The
runs go in parallel threads to keep the whole file near half a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from hookbus.cli._command_tree import cli

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEAD_URL = "nats://127.0.0.1:1"
RUN_TIMEOUT_S = 120.0
"""Each run must end within this many seconds (a command that hangs fails here): a hang
guard, wide enough for a Python start and a connect attempt on a machine at load 20."""

# About 125 runs of a fresh interpreter: near half a minute on a quiet machine, above the
# suite's default bound of 180 s at load 16. This bound is a hang guard, not a speed check.
pytestmark = pytest.mark.timeout(1200)

# A plausible value for each required parameter, by name, so that the run reaches the
# part under test (the connection, the value checked).
PLAUSIBLE = {
    "target": f"{EXAMPLES / 'security_policy.py'}:worker",
    "event": "tool:pre",
    "name": "guard",
    "label": "approval-x",
    "value": "{}",
    "choice": "Allow once",
    "approver": "ops",
    "role": "agent",
    "data": "{}",
}
# What some commands need besides their required parameters to reach the connection.
TO_CONNECT = {
    ("approvals", "revoke"): ["--all"],
    ("console",): ["--console-token", "a-token-long-enough-to-be-accepted-0123456789"],
}
# The Claude Code hook answers Claude Code, not a person: a NATS it cannot reach is
# answered by its fallback decision with exit 0 (Claude Code reads exit 2 as "block" and
# anything else as a non-blocking error). Its bad input still exits 1 without a traceback.
HOOK_ANSWERS_BY_FALLBACK = {("claude-code",)}


def walk(
    cmd: click.Command, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if path:
        yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from walk(sub, (*path, name))


COMMANDS = list(walk(cli))


def required_args(cmd: click.Command, tmp: Path) -> list[str]:
    args: list[str] = []
    for p in cmd.params:
        if not p.required:
            continue
        value = PLAUSIBLE.get(p.name or "", str(tmp / f"{p.name}-dir"))
        if isinstance(p, click.Option):
            args += [p.opts[0], value]
        else:
            args.append(value)
    return args


_NOT_TYPED = (
    click.types.StringParamType,
    click.types.BoolParamType,
    click.types.UnprocessedParamType,
)


def typed_option(cmd: click.Command) -> str | None:
    """The first option whose value click checks (not free text, a flag or a path)."""
    for p in cmd.params:
        if not isinstance(p, click.Option) or p.is_flag or p.name == "help":
            continue
        if isinstance(p.type, (*_NOT_TYPED, click.Path, click.File)):
            continue
        return p.opts[0]
    return None


def connects(cmd: click.Command) -> bool:
    return any(p.name == "url" for p in cmd.params)


@dataclass(frozen=True)
class Case:
    id: str
    args: tuple[str, ...]
    expect_exit: tuple[int, ...] = ()
    """Allowed exit codes (default: any but 0)."""
    needle: str = ""
    """Text the output must hold."""


def cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    for path, cmd in COMMANDS:
        name = " ".join(path)
        out.append(Case(f"{name} --no-such-option", (*path, "--no-such-option"), (2,)))
        required = required_args(cmd, tmp)
        if required:
            out.append(Case(f"{name} (no arguments)", path, (2,), "Missing"))
        needed = required + TO_CONNECT.get(path, [])
        option = typed_option(cmd)
        if option is not None:
            out.append(
                Case(f"{name} {option} bogus", (*path, *needed, option, "bogus!value"), (2,))
            )
        if connects(cmd):
            dead = (1, 0) if path in HOOK_ANSWERS_BY_FALLBACK else (1,)
            out.append(Case(f"{name} --url unreachable", (*path, *needed, "--url", DEAD_URL), dead))
    bad_py = tmp / "bad_syntax.py"
    raises = tmp / "raises.py"
    dead = ("--url", DEAD_URL)
    out += [
        Case("emit malformed JSON", ("emit", "tool:pre", "{bad", *dead), (2,), "not valid JSON"),
        Case("emit JSON list", ("emit", "tool:pre", "[1]", *dead), (2,), "must be a JSON object"),
        Case(
            "emit @missing", ("emit", "tool:pre", f"@{tmp / 'no.json'}", *dead), (2,), "cannot read"
        ),
        Case(
            "suspensions resolve bad JSON",
            ("suspensions", "resolve", "x", "{bad", *dead),
            (2,),
            "valid JSON",
        ),
        Case("worker syntax error", ("worker", f"{bad_py}:worker", *dead), (2,), "syntax error in"),
        Case(
            "worker raises", ("worker", f"{raises}:worker", *dead), (2,), "failed to load: Runtime"
        ),
        Case("schema --out no folder", ("schema", "--out", str(tmp / "no" / "x.json")), (1, 2)),
        Case("schema --out a folder", ("schema", "--out", str(tmp)), (1, 2)),
        Case("asyncapi --out no folder", ("asyncapi", "--out", str(tmp / "no" / "x.yaml")), (1, 2)),
        Case(
            "server --port out of range",
            ("server", "--port", "99999", "--data-dir", str(tmp / "srv")),
            (1,),
            "invalid port",
        ),
        Case("server --config missing", ("server", "--config", str(tmp / "none.conf")), (2,)),
        Case(
            "settings --merge not JSON", ("claude-code", "settings", "--merge", str(raises)), (1,)
        ),
        Case("dispatcher --grace-period 0", ("dispatcher", "--grace-period", "0", *dead), (2,)),
        Case("--embedded --url", ("handlers", "--embedded", *dead), (2,), "do not go together"),
        Case(
            "--context missing", ("handlers", "--context", str(tmp / "none.json")), (1,), "context"
        ),
        Case("--log-level bogus", ("--log-level", "loud", "schema"), (2,)),
        Case("dispatcher --url malformed", ("dispatcher", "--url", "not a url"), (2,), "--url"),
        Case(
            "emit --url malformed",
            ("emit", "tool:pre", "{}", "--url", "localhost:4222"),
            (2,),
            "URL",
        ),
        Case("handlers --url malformed", ("handlers", "--url", "nats://a:1,oops"), (2,), "URL"),
        Case(
            "emit --url port not a number",
            ("emit", "tool:pre", "{}", "--url", "nats://host:notaport"),
            (2,),
            "not a NATS URL",
        ),
        Case(
            "emit --url no host", ("emit", "tool:pre", "{}", "--url", "nats://:4222"), (2,), "host"
        ),
        Case("emit --agent-id empty", ("emit", "tool:pre", "{}", "--agent-id", ""), (2,), "empty"),
        Case(
            "auth init --out unwritable",
            ("auth", "init", "--out", "/proc/hookbus-no-such"),
            (1,),
            "cannot write /proc/hookbus-no-such",
        ),
    ]
    return out


@dataclass
class Outcome:
    case: Case
    code: int | None
    out: str
    err: str


def run(case: Case, env: dict[str, str]) -> Outcome:
    try:
        proc = subprocess.run(
            [*HOOKBUS, *case.args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as exc:
        return Outcome(case, None, str(exc.stdout or ""), str(exc.stderr or ""))
    return Outcome(case, proc.returncode, proc.stdout, proc.stderr)


def problem(o: Outcome) -> str | None:
    """Why this outcome fails, or None."""
    text = o.out + o.err
    if o.code is None:
        return f"still running after {RUN_TIMEOUT_S}s"
    if "Traceback" in text:
        return f"a traceback:\n{o.err[-3000:]}"
    allowed = o.case.expect_exit or ()
    if allowed and o.code not in allowed:
        return f"exit {o.code}, expected {allowed}:\n{o.err[-1500:]}"
    if not allowed and o.code == 0:
        return "exit 0"
    if 0 not in allowed and not o.err.strip():
        return f"exit {o.code} with nothing on stderr"
    if o.case.needle and o.case.needle not in text:
        return f"no {o.case.needle!r} in:\n{o.err[-1500:]}"
    return None


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    tmp = tmp_path_factory.mktemp("bad-input")
    (tmp / "bad_syntax.py").write_text("from hookbus.workers import HookWorker\nworker = (\n")
    (tmp / "raises.py").write_text("raise RuntimeError('import-time boom')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env.update(XDG_CONFIG_HOME=str(tmp / "config"), COLUMNS="120")
    todo = cases(tmp)
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda c: run(c, env), todo))


def test_every_command_is_covered(outcomes: list[Outcome]) -> None:
    covered = {o.case.args[: len(p)] for o in outcomes for p, _ in COMMANDS}
    assert len(COMMANDS) >= 30  # the walk reached the subcommands
    for path, _ in COMMANDS:
        assert path in covered, path


def test_bad_input_never_ends_in_a_traceback(outcomes: list[Outcome]) -> None:
    failures = [f"{o.case.id}: {why}" for o in outcomes if (why := problem(o))]
    assert not failures, "\n\n".join(failures)
