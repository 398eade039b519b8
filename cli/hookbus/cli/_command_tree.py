"""The `hookbus` command tree (click): the group, its options and every command."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from ._approvals_cmd import approvals
from ._auth_cmd import auth
from ._claude_code_cmd import claude_code
from ._command_support import (
    connection_options,
    setup_logging,
)
from ._console_cmd import console
from ._contract_cmd import asyncapi, schema
from ._decisions_cmd import decisions
from ._emit_cmd import emit
from ._exit_status import run_cli
from ._gateway_cmd import gateway
from ._handlers_cmd import handlers, services
from ._lifecycle import LOOP_CHOICES, LOOP_ENV, loop_choice
from ._otel import otlp_option
from ._provision import provision_cmd
from ._serve_cmds import dispatcher_cmd, server, worker
from ._suspensions_cmd import suspensions
from ._tail_cmd import tail

__all__ = ["cli", "main"]


@click.group()
@click.option(
    "--log-level",
    default="warning",
    show_default=True,
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Logging level.",
)
@click.option(
    "--loop",
    envvar=LOOP_ENV,
    default="auto",
    show_default=True,
    type=click.Choice(LOOP_CHOICES, case_sensitive=False),
    help="Event loop of the long-running commands (env HOOKBUS_LOOP): auto = uvloop when "
    "installed (hookbus[uvloop]), else asyncio's; asyncio opts out; uvloop insists.",
)
@click.version_option(package_name="hookbus")
def cli(log_level: str, loop: str) -> None:
    """hookbus: a distributed hook dispatcher for AI agent fleets, on NATS."""
    setup_logging(log_level)
    loop_choice(loop)  # --loop uvloop without uvloop: one line, now
    os.environ[LOOP_ENV] = loop.lower()  # read by `run_loop`, here and in child processes


def _demo_agents_option(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    """``hookbus demo --agents``: see `hookbus.demo.parse_agents` (imported only when used)."""
    from hookbus.demo import parse_agents

    return parse_agents(ctx, param, value)


@cli.command()
@connection_options
@click.option(
    "--examples-dir",
    type=click.Path(file_okay=False, exists=True),
    default=None,
    help="Folder with the example workers and transcript (default: ./examples, else the "
    "copy installed with hookbus, else the source checkout's).",
)
@click.option("--interactive", is_flag=True, help="Answer approvals in the terminal.")
@click.option(
    "--secure",
    is_flag=True,
    help="Run every process as its own identity from the --auth folder (made with "
    "`hookbus auth init --demo`): workers, approver and agents with their roles' "
    "credentials; the server is --url, else the folder's.",
)
@click.option(
    "--auth",
    "auth_dir",
    envvar="HOOKBUS_AUTH_DIR",
    default="auth",
    show_default=True,
    type=click.Path(file_okay=False),
    help="With --secure: the folder `hookbus auth init` wrote (env HOOKBUS_AUTH_DIR).",
)
@click.option(
    "--agents",
    "agents",
    metavar="NAMES",
    default="",
    callback=_demo_agents_option,
    help="Then also run these framework agents (comma-separated) against the same workers "
    "and approver, with scripted models: pydantic-ai (examples/pydantic_ai_agent.py; needs "
    "hookbus[pydantic-ai]), ai (examples/ai_agent.py on a Python >= 3.12, see --ai-python).",
)
@click.option(
    "--ai-python",
    type=click.Path(dir_okay=False),
    default=None,
    help="With --agents ai: a Python >= 3.12 with hookbus and its ai extra (default: "
    "the venv the ai test builds, ~/.cache/hookbus/venv-py312-*, else $HOOKBUS_PY312, if it"
    " has them).",
)
@click.option(
    "--via",
    type=click.Choice(["direct", "aos"]),
    default="direct",
    show_default=True,
    help="direct: each agent emits its steps; aos: each step is sent as an OWASP AOS "
    "JSON-RPC request through the AOS guardian door (in process, the agent's dispatcher), "
    "and a second table shows each AOS decision.",
)
@otlp_option
def demo(**options: Any) -> None:
    """Run a fleet of agents whose tool calls are decided by remote hook workers; print the
    decision table; exit 1 if any decision differs from the transcript's expectation."""
    from hookbus.demo import run  # the demo application, loaded only to run it

    sys.exit(run(**options))  # the options as `run` takes them


cli.add_command(server)
cli.add_command(worker)
cli.add_command(dispatcher_cmd)
cli.add_command(emit)
cli.add_command(handlers)
cli.add_command(services)
cli.add_command(suspensions)
cli.add_command(approvals)
cli.add_command(decisions)
cli.add_command(tail)
auth.add_command(provision_cmd)
cli.add_command(auth)
cli.add_command(gateway)
cli.add_command(claude_code)
cli.add_command(console)
cli.add_command(schema)
cli.add_command(asyncapi)


def main() -> None:
    run_cli(cli, prog_name="hookbus")


if __name__ == "__main__":
    main()
