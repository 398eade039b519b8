"""hookbus.testing: test a worker's handlers as the bus decides them.

`WorkerTestKit` runs a `HookWorker`'s handlers in process, through an in-process
`HookDispatcher`'s fold (no nats-server).
"""

from ._worker_kit import WorkerTestKit

__all__ = ["WorkerTestKit"]
