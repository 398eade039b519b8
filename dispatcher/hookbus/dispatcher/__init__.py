"""hookbus.dispatcher: emit events to hook handlers in-process and over NATS."""

from hookbus.schemas import HookResult

from ._dispatcher import HookDispatcher
from ._fold import Fold
from ._routes import Route
from ._service import DispatcherService

__all__ = ["DispatcherService", "Fold", "HookDispatcher", "HookResult", "Route"]
