"""hookbus.cli: the `hookbus` command and the embedded nats-server. Sits on top of
`hookbus.dispatcher` and `hookbus.workers`.

Besides the embedded server, the pieces the commands are built of, for an application on
the CLI (the demo): connecting (`ConnectionSettings`, `connect`, `connection_or_embedded`,
`auth_credentials`), running (`run_async`, `load_object`), the dispatcher service's
`service_emit`, the buckets (`provision`) and OpenTelemetry (`otel_session`, `OtelSetup`,
`print_denied_trace`). They load on first use (see `__getattr__`).
"""

import importlib
from typing import TYPE_CHECKING, Any

from hookbus._core.embedded_server import (
    EmbeddedNatsServer,
    NatsServerNotFoundError,
    find_nats_server,
)

if TYPE_CHECKING:  # loaded on first use: see __getattr__
    from ._auth_credentials import auth_credentials
    from ._command_support import connection_or_embedded, load_object
    from ._connect import ConnectionSettings, connect
    from ._lifecycle import run_async
    from ._otel import OtelSetup, otel_session, print_denied_trace
    from ._provision import provision
    from ._service_emit import service_emit

__all__ = [
    "ConnectionSettings",
    "EmbeddedNatsServer",
    "NatsServerNotFoundError",
    "OtelSetup",
    "auth_credentials",
    "connect",
    "connection_or_embedded",
    "find_nats_server",
    "load_object",
    "otel_session",
    "print_denied_trace",
    "provision",
    "run_async",
    "service_emit",
]

_LAZY = {
    "ConnectionSettings": "._connect",
    "connect": "._connect",
    "connection_or_embedded": "._command_support",
    "load_object": "._command_support",
    "auth_credentials": "._auth_credentials",
    "run_async": "._lifecycle",
    "service_emit": "._service_emit",
    "OtelSetup": "._otel",
    "otel_session": "._otel",
    "print_denied_trace": "._otel",
    "provision": "._provision",
}
"""The public names that load on first use, and the module of each."""


def __getattr__(name: str) -> Any:
    """The names of `_LAZY` load on first use: most need the ``cli`` extra (click), which
    ``import hookbus.cli`` must not (the embedded server and the Claude Code hook work
    without it)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
