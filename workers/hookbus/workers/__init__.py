"""hookbus.workers: serve hook handlers on NATS, scaled with queue groups."""

from hookbus.schemas import HookResult

from ._worker import HandlerSpec, HookWorker

__all__ = ["HandlerSpec", "HookResult", "HookWorker"]
