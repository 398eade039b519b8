"""The ``hookbus`` console script: the Claude Code hook path imports only what it needs.

Claude Code spawns ``hookbus claude-code`` for every hook event, so its start-up is on the
path of every tool call: that path imports the hook command alone (click, nats-py, the wire
types and the Claude Code door), not the whole CLI (the dispatcher, workers, OpenTelemetry
SDK, rich ...). Every other command goes to `hookbus.cli._command_tree`.

Without the ``cli`` extra (``pip install hookbus`` is the library alone) the command prints
one line naming the extra and exits 2, instead of an import traceback; ``hookbus
--version`` still says which hookbus is installed. The hook path
answers instead, as the Claude Code door does when hookbus cannot decide: the event's
fallback (`hookbus.integrations.claude_code.fallback_answer`: ``PreToolUse`` and
``PermissionRequest`` denied, every other event let through, the reason naming the missing
extra). Exit status 2 would be Claude Code's "block" on every event, a session's ``Stop``
and prompts included.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from ._extras import extra_of, install_hint

__all__ = ["full_cli", "main"]

_FULL_CLI = frozenset({"settings", "--help", "-h"})
"""``hookbus claude-code`` arguments served by the full CLI (help lists every command)."""

EXIT_MISSING = 2
"""Exit status when the command cannot start for want of an extra (or of a package)."""


@contextlib.contextmanager
def _importing_the_command(hook: bool = False) -> Iterator[None]:
    """Turn a missing package while importing the command into one line and exit 2 (with
    `hook`: the Claude Code hook's fallback answer instead, see the module docstring)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        extra = extra_of(exc.name)
        if extra is not None:  # the cli extra's packages (click, rich, ...)
            line = install_hint("the hookbus command", extra)
        else:  # a core package is gone: the installation is broken
            line = (
                f"the hookbus command cannot start: {exc} (a broken installation?"
                " pip install --force-reinstall 'hookbus[cli]')"
            )
        if hook:
            sys.exit(_hook_fallback(line))
        sys.stderr.write(line + "\n")
        sys.exit(EXIT_MISSING)


def _hook_fallback(why: str) -> int:
    """Answer the Claude Code hook on stdin with its event's fallback (`why`: the reason);
    the exit status. Exit 1 (a non-blocking error: Claude Code goes on, or blocks where the
    settings say ``"onFailure": "block"``) when even that cannot be done."""
    try:
        from hookbus.integrations.claude_code import fallback_answer  # stdlib + schemas
    except ImportError as exc:
        sys.stderr.write(f"{why}; and the Claude Code door cannot load: {exc}\n")
        return 1
    answer = fallback_answer(sys.stdin.buffer.read(), f"hookbus cannot run the hook: {why}")
    sys.stdout.write(answer.stdout)
    sys.stderr.write(answer.stderr + ("\n" if answer.stderr else ""))
    sys.stdout.flush()
    return answer.exit_code


def _version() -> str:
    """``hookbus, version X``, as the full CLI's ``--version`` says it (click's format)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"hookbus, version {version('hookbus')}"
    except PackageNotFoundError:
        return "hookbus, version unknown (not installed as a distribution)"


def main() -> None:
    """The ``hookbus`` console script: ``hookbus claude-code`` (the hook) goes straight to
    its command, everything else to the whole CLI (`full_cli`)."""
    args = sys.argv[1:]
    if args[:1] == ["claude-code"] and not _FULL_CLI.intersection(args[1:2]):
        with _importing_the_command(hook=True):
            from ._claude_code_cmd import run_hook
        sys.exit(run_hook(args[1:]))
    full_cli()


def full_cli() -> None:
    """The whole ``hookbus`` CLI (``python -m hookbus.cli``); ``--version`` alone answers
    before it is imported (the cli extra or not)."""
    if sys.argv[1:] == ["--version"]:
        sys.stdout.write(_version() + "\n")
        sys.exit(0)
    with _importing_the_command():
        from ._command_tree import main as run
    run()


if __name__ == "__main__":
    main()
