"""The ``hookbus`` console script: the Claude Code hook path imports only what it needs.

Claude Code spawns ``hookbus claude-code`` for every hook event, so its start-up is on the
path of every tool call: that path imports the hook command alone (click, nats-py, the wire
types and the Claude Code door), not the whole CLI (the dispatcher, workers, OpenTelemetry
SDK, rich ...). Every other command goes to `hookbus.cli._main`.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_FULL_CLI = frozenset({"settings", "--help", "-h"})
"""``hookbus claude-code`` arguments served by the full CLI (help lists every command)."""


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["claude-code"] and not _FULL_CLI.intersection(args[1:2]):
        from ._claude_code_cmd import run_hook

        sys.exit(run_hook(args[1:]))
    from ._main import main as full_cli

    full_cli()


if __name__ == "__main__":
    main()
