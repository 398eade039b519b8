"""hookbus.dispatcher: emit events to hook handlers in-process and over NATS; durable
suspensions and approvals."""

from hookbus.schemas import HookResult

from ._approvals import (
    APPROVAL_LABEL_PREFIX,
    AnswerNotAppliedError,
    Approvals,
    allows,
    approval_label,
    is_allow,
    joined_decision,
    next_approval_label,
)
from ._approvals_client import ApprovalsClient
from ._audit import DecisionLog
from ._call_router import REMOTE_EMIT_BUDGET_S
from ._dispatcher import HookDispatcher
from ._fold import Fold
from ._liveness import HandlerStatus, LiveReplica, RegistryView, describe_handlers, live_handlers
from ._loopback import route_over
from ._registry_watch import require_handler, unrequire_handler
from ._route_table import Route
from ._service import DispatcherService
from ._services_api import DispatcherEndpoint, DispatcherReplica, live_dispatchers
from ._suspensions import HookEventStream, PendingHook, RunScope, SuspensionPage, Suspensions
from ._waiter import Leases

__all__ = [
    "APPROVAL_LABEL_PREFIX",
    "REMOTE_EMIT_BUDGET_S",
    "AnswerNotAppliedError",
    "Approvals",
    "ApprovalsClient",
    "DecisionLog",
    "DispatcherEndpoint",
    "DispatcherReplica",
    "DispatcherService",
    "Fold",
    "HandlerStatus",
    "HookDispatcher",
    "HookEventStream",
    "HookResult",
    "Leases",
    "LiveReplica",
    "PendingHook",
    "RegistryView",
    "Route",
    "RunScope",
    "SuspensionPage",
    "Suspensions",
    "allows",
    "approval_label",
    "describe_handlers",
    "is_allow",
    "joined_decision",
    "live_dispatchers",
    "live_handlers",
    "next_approval_label",
    "require_handler",
    "route_over",
    "unrequire_handler",
]
