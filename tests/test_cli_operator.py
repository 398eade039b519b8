"""Rough edges an operator hits running the CLI: a worker started right after its server,
arguments that are easy to get wrong (no JSON, nan, an http:// URL, connection options on
a group), each answered with one clear line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ports import free_port

from hookbus.cli import EmbeddedNatsServer

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WORKER = f"{EXAMPLES / 'security_policy.py'}:worker"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "HOOKBUS_"))}
    env["NATS_CONTEXT"] = ""
    return env


def _run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOOKBUS, *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


# -- the first connect of a long-running command waits for a server starting ---------------
def test_worker_started_before_its_server_waits_for_it(tmp_path: Path) -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    err = tmp_path / "worker.err"
    with err.open("w") as err_file:
        proc = subprocess.Popen(
            [*HOOKBUS, "worker", WORKER, "--url", url, "--grace-period", "1"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            env=_env(),
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 20
            while "waiting up to 10 s for NATS" not in err.read_text():
                assert proc.poll() is None, err.read_text()
                assert time.monotonic() < deadline, err.read_text()
                time.sleep(0.05)
            with EmbeddedNatsServer(port=port):
                while "hookbus worker: serving" not in err.read_text():
                    assert proc.poll() is None, err.read_text()
                    assert time.monotonic() < deadline + 10, err.read_text()
                    time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=15) == 0, err.read_text()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = err.read_text()
    assert text.count("waiting up to") == 1
    assert "Traceback" not in text and "Error" not in text


@pytest.mark.parametrize("command", [["worker", WORKER], ["dispatcher"]], ids=lambda c: c[0])
def test_no_server_within_the_wait_fails_in_one_line(command: list[str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = _run(*command, "--url", url, "--wait-for-server", "1")
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    waiting, error = proc.stderr.strip().splitlines()[-2:]
    assert (
        waiting == f"waiting up to 1 s for NATS at {url} (cannot connect to NATS at {url}:"
        " connection refused)"
    )
    assert error == f"Error: cannot connect to NATS at {url}: connection refused (waited 1 s)"


def test_one_shot_commands_still_fail_fast() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = _run("handlers", "--url", url)
    assert proc.returncode == 1
    assert "waiting" not in proc.stderr
    assert proc.stderr.strip() == f"Error: cannot connect to NATS at {url}: connection refused"


def test_wait_for_server_zero_fails_at_once() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    proc = _run("dispatcher", "--url", url, "--wait-for-server", "0")
    assert proc.returncode == 1
    assert "waiting" not in proc.stderr
    assert proc.stderr.strip().endswith(f"cannot connect to NATS at {url}: connection refused")


# -- emit needs its data --------------------------------------------------------------------
def test_emit_without_data_is_a_usage_error_not_an_empty_call() -> None:
    from click.testing import CliRunner

    from hookbus.cli._command_tree import cli

    result = CliRunner().invoke(cli, ["emit", "tool:pre", "--url", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert (
        "Error: Missing argument 'JSON|-|@FILE'. The event's data: a JSON object ('{}' for"
        " none), - to read it from stdin, or @FILE." in result.output
    )
    assert "emit [OPTIONS] EVENT JSON|-|@FILE" in result.output


# -- float options refuse nan and inf ---------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["emit", "tool:pre", "{}", "--collect", "--timeout"],
        ["handlers", "--ping-timeout"],
        ["services", "--ping-timeout"],
        ["handlers", "require", "tool:pre", "guard", "--timeout"],
        ["dispatcher", "--agent-rate"],
        ["console", "--ping-timeout"],
        ["gateway", "http", "--timeout"],
        ["gateway", "aos", "--timeout"],
        ["worker", WORKER, "--wait-for-server"],
    ],
    ids=lambda a: " ".join(x for x in a if x != WORKER),
)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_float_options_refuse_nan_and_inf(args: list[str], value: str) -> None:
    from click.testing import CliRunner

    from hookbus.cli._command_tree import cli

    result = CliRunner().invoke(cli, [*args, value, "--url", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{args[-1]}'" in result.output
    assert "finite" in result.output


def test_every_float_option_is_finite() -> None:
    """Each float option of the click tree refuses nan: a FiniteFloatRange or a duration."""
    import click

    from hookbus.cli._command_support import Duration, FiniteFloatRange
    from hookbus.cli._command_tree import cli

    def walk(cmd: click.Command, path: str) -> list[tuple[str, click.Parameter]]:
        out = [(path, p) for p in cmd.params]
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                out += walk(sub, f"{path} {name}")
        return out

    loose = [
        f"{path} {param.name}"
        for path, param in walk(cli, "hookbus")
        if isinstance(param.type, click.types.FloatParamType | click.FloatRange)
        and not isinstance(param.type, FiniteFloatRange | Duration)
        and not path.startswith("hookbus claude-code")  # the hook answers its fallback
    ]
    assert not loose


# -- a URL of another protocol is refused, naming the schemes accepted -----------------------
@pytest.mark.parametrize(
    "command",
    [["handlers"], ["emit", "tool:pre", "{}"], ["suspensions", "list"], ["worker", WORKER]],
    ids=lambda c: c[0],
)
@pytest.mark.parametrize("url", ["http://localhost:4222", "https://nats.example.com"])
def test_a_non_nats_url_is_refused_naming_the_schemes(command: list[str], url: str) -> None:
    proc = _run(*command, "--url", url)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "waiting" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]
    scheme = url.partition("://")[0]
    assert error == (
        f"Error: Invalid value for --url: {url!r} is not a NATS URL: {scheme}:// is not a"
        " NATS scheme; use nats://, tls://, ws://, wss://"
    )


def test_a_list_with_one_http_url_is_refused() -> None:
    proc = _run("handlers", "--url", "nats://127.0.0.1:1,http://user:pw@h:80")
    assert proc.returncode == 2
    assert "'http://user:***@h:80' is not a NATS URL" in proc.stderr
    assert "pw" not in proc.stderr


def test_a_websocket_url_without_aiohttp_says_what_it_needs() -> None:
    import importlib.util

    if importlib.util.find_spec("aiohttp") is not None:
        pytest.skip("aiohttp is installed: ws:// connects")
    proc = _run("handlers", "--url", "ws://127.0.0.1:1")
    assert proc.returncode == 2
    assert "NATS over ws:// (websocket) needs the aiohttp package" in proc.stderr


# -- a group's connection options reach its commands -------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ["suspensions", "{url}", "list", "--json"],
        ["suspensions", "{url}"],
        ["approvals", "{url}", "list", "--json"],
    ],
    ids=lambda a: " ".join(x for x in a if x != "{url}"),
)
def test_connection_options_given_to_the_group_are_used(nats_url: str, args: list[str]) -> None:
    proc = _run(*[f"--url={nats_url}" if a == "{url}" else a for a in args])
    assert proc.returncode == 0, proc.stderr
    assert "No such option" not in proc.stderr


def test_handlers_group_url_reaches_its_commands(nats_url: str) -> None:
    proc = _run("handlers", "--url", nats_url, "unrequire", "tool:pre", "no-such-handler")
    assert proc.stderr.strip() == "Error: tool:pre does not require no-such-handler"


def test_a_group_url_is_not_silently_replaced_by_the_default() -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    for args in (["suspensions", "--url", dead, "list"], ["approvals", "--url", dead, "list"]):
        proc = _run(*args)
        assert proc.returncode == 1
        assert proc.stderr.strip() == f"Error: cannot connect to NATS at {dead}: connection refused"


def test_the_commands_own_connection_options_win(nats_url: str) -> None:
    dead = f"nats://127.0.0.1:{free_port()}"
    proc = _run("suspensions", "--url", dead, "list", "--json", "--url", nats_url)
    assert proc.returncode == 0, proc.stderr


# -- --version without the cli extra ----------------------------------------------------------
_LEAN = """
import sys
class _NoCliExtra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("click", "rich"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoCliExtra())
sys.argv = ["hookbus", *sys.argv[1:]]
from hookbus.cli._console_script import main
main()
"""


def test_version_answers_without_the_cli_extra() -> None:
    from importlib.metadata import version

    lean = subprocess.run(
        [sys.executable, "-c", _LEAN, "--version"], capture_output=True, text=True, timeout=30
    )
    assert (lean.returncode, lean.stdout, lean.stderr) == (
        0,
        f"hookbus, version {version('hookbus')}\n",
        "",
    )
    from click.testing import CliRunner

    from hookbus.cli._command_tree import cli

    full = CliRunner().invoke(cli, ["--version"], prog_name="hookbus")
    assert full.output == lean.stdout  # the same line as the full CLI's click option
    assert _run("--version").stdout == lean.stdout  # python -m hookbus.cli
    other = subprocess.run(
        [sys.executable, "-c", _LEAN, "handlers"], capture_output=True, text=True, timeout=30
    )
    assert other.returncode == 2
    assert other.stderr == "the hookbus command needs the cli extra: pip install 'hookbus[cli]'\n"


# -- a long suspension listing is printed in bounded chunks -----------------------------------
def _preregister(url: str, labels: list[str]) -> None:
    import asyncio

    import nats

    from hookbus.dispatcher import HookDispatcher

    async def main() -> None:
        nc = await nats.connect(url)
        try:
            d = HookDispatcher(nc)
            await d.start()
            limit = asyncio.Semaphore(100)

            async def one(label: str) -> None:
                async with limit:
                    await d.suspensions.resolve_hook(label, {"n": label})

            await asyncio.gather(*(one(label) for label in labels))
        finally:
            await nc.close()

    asyncio.run(main())


def test_a_long_suspension_listing_is_printed_in_chunks(
    embedded_server: EmbeddedNatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from click.testing import CliRunner
    from rich.console import Console
    from rich.table import Table

    from hookbus.cli._command_tree import cli
    from hookbus.cli._output import TABLE_CHUNK_ROWS

    count = 2 * TABLE_CHUNK_ROWS + 123
    labels = [f"op-{i:05d}" for i in range(count)]
    _preregister(embedded_server.url, labels)

    printed: list[int] = []
    real_print = Console.print

    def spy(self: Console, *objects: object, **kwargs: object) -> None:
        printed.extend(o.row_count for o in objects if isinstance(o, Table))
        real_print(self, *objects, **kwargs)

    monkeypatch.setattr(Console, "print", spy)
    args = ["suspensions", "list", "--url", embedded_server.url]
    table = CliRunner().invoke(cli, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    # rich lays out a whole table before printing it: never more than a chunk at once
    assert printed == [TABLE_CHUNK_ROWS, TABLE_CHUNK_ROWS, 123]
    shown = [ln for ln in table.output.splitlines() if "op-" in ln]
    listed = [next(w for w in ln.split() if w.startswith("op-")) for ln in shown]
    full = CliRunner().invoke(cli, [*args, "--json"])
    in_order = [r["label"] for r in json.loads(full.stdout)]
    assert sorted(in_order) == labels
    assert listed == in_order  # each once, oldest first, as the JSON listing
    widths = {len(ln) for ln in shown}
    assert len(widths) == 1  # the chunks line up: one table to the eye
    assert table.output.count("suspensions") == 1 and table.output.count(" label ") == 1

    # the same records as the API's listing (its paging: --limit / --after)
    page = CliRunner().invoke(cli, [*args, "--limit", "700", "--json"])
    assert [r["label"] for r in json.loads(page.stdout)] == in_order[:700]
    assert "more: --after" in page.stderr


# -- the demo: its table first, and any offered answer is a right one -------------------------
def _demo(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = _env()
    env.pop("NATS_CONTEXT")
    return subprocess.run(
        [*HOOKBUS, "demo", "--embedded", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=90,
        env={**env, "COLUMNS": "200"},
    )


def test_the_demo_prints_no_bare_warning_before_its_table() -> None:
    proc = _demo()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr and "WARNING" not in proc.stdout
    # the handler that fails on purpose is said in the report, after the table
    table = proc.stdout.index("decisions (in completion order)")
    assert proc.stdout.index("failure policy is deny") > table


@pytest.mark.parametrize(("answer", "action"), [("Deny", "deny"), ("Allow once", "continue")])
def test_an_offered_answer_in_the_interactive_demo_is_no_mismatch(answer: str, action: str) -> None:
    proc = _demo("--interactive", stdin=f"{answer}\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MISMATCH" not in proc.stdout
    (transfer,) = [ln for ln in proc.stdout.splitlines() if "payments:create_transfer" in ln
                   and "tool:pre" in ln and ln.startswith("│")]  # fmt: skip
    cells = [c.strip() for c in transfer.strip("│").split("│")]
    assert cells[5:8] == [action, "transfer_approval", "demo-approver"]
    assert cells[-1] == "ok"
    assert "(1 decided by your answer in the terminal)" in proc.stdout
