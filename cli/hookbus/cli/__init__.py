"""hookbus.cli: the `hookbus` command and the embedded nats-server. Sits on top of
`hookbus.dispatcher` and `hookbus.workers`."""

from typing import TYPE_CHECKING, Any

from hookbus._core.embedded_server import (
    EmbeddedNatsServer,
    NatsServerNotFoundError,
    find_nats_server,
)

if TYPE_CHECKING:  # loaded on first use: see __getattr__
    from ._connect import ConnectionSettings

__all__ = [
    "ConnectionSettings",
    "EmbeddedNatsServer",
    "NatsServerNotFoundError",
    "find_nats_server",
]


def __getattr__(name: str) -> Any:
    """`ConnectionSettings` loads on first use: it needs the ``cli`` extra (click), which
    ``import hookbus.cli`` must not (the embedded server and the Claude Code hook work
    without it)."""
    if name == "ConnectionSettings":
        from ._connect import ConnectionSettings

        return ConnectionSettings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
