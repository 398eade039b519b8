"""How the ``hookbus`` command ends: click's own handling of usage and command errors,
plus a net under it, so that no mistake of the user's ends in a traceback.

- a `click.ClickException` (usage errors: 2; command errors: 1): click's one line;
- a command that needs an extra not installed (`MissingExtraError`): the line naming the
  extra, exit 2;
- Ctrl-C (or SIGTERM) where a command does not handle it: one line, exit 130 (143);
- a closed stdout (``hookbus handlers | head``): exit 1 quietly;
- anything else (a bug): one ``Error:`` line naming the exception, exit 1; the traceback
  is logged at ``--log-level debug``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

import click

from ._extras import MissingExtraError
from ._lifecycle import Interrupted

__all__ = ["run_cli"]

log = logging.getLogger("hookbus.cli")


def run_cli(group: click.Group, prog_name: str = "hookbus") -> NoReturn:
    """Run `group` as the program and exit with its status (see the module docstring)."""
    try:
        rv = group.main(prog_name=prog_name, standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except MissingExtraError as exc:
        click.echo(str(exc), err=True)
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        cause = exc.__cause__ if isinstance(exc, click.exceptions.Abort) else exc
        signum = cause.signum if isinstance(cause, Interrupted) else int(signal.SIGINT)
        click.echo(f"\n{prog_name}: interrupted", err=True)
        sys.exit(128 + signum)
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(1)
    except Exception as exc:
        log.debug("unexpected error", exc_info=True)
        text = str(exc) or "(no message)"
        click.echo(
            f"Error: unexpected {type(exc).__name__}: {text} (run with --log-level debug"
            " for the traceback)",
            err=True,
        )
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


def _quiet_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the exit flush writes nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
