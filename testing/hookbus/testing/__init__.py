"""hookbus.testing: test a worker's handlers as the bus decides them.

- `HookTestEnv`: emit to a worker's handlers (run as one chain, folded by the dispatcher's
  rules), answer the approvals they ask, resolve suspensions; in process, or against a
  real nats-server with ``with_real=True``.
- A virtual clock (`virtual_clock_loop`, `run_with_virtual_clock`, `VirtualClockLoop`):
  time skips ahead while everything waits, so a 30 s approval timeout takes no real time.
- `WorkerTestKit`: a worker's handlers through an in-process `HookDispatcher`'s own fold
  and request path (no approvals, no chains).
"""

from ._approval_desk import Approval
from ._clock import VirtualClockLoop, run_with_virtual_clock, virtual_clock_loop
from ._env import HookTestEnv
from ._worker_kit import WorkerTestKit

__all__ = [
    "Approval",
    "HookTestEnv",
    "VirtualClockLoop",
    "WorkerTestKit",
    "run_with_virtual_clock",
    "virtual_clock_loop",
]
