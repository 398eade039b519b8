"""hookbus.cli: the `hookbus` command and the embedded nats-server. Sits on top of
`hookbus.dispatcher` and `hookbus.workers`."""

from ._connect import ConnectionSettings
from ._server import EmbeddedNatsServer, NatsServerNotFoundError, find_nats_server

__all__ = [
    "ConnectionSettings",
    "EmbeddedNatsServer",
    "NatsServerNotFoundError",
    "find_nats_server",
]
