"""hookbus.workers: serve hook handlers on NATS, scaled with queue groups."""

from hookbus.schemas import HookResult

from ._spec import HandlerSpec
from ._worker import HookWorker

__all__ = ["HandlerSpec", "HookResult", "HookWorker"]
