"""hookbus.schemas: the wire contract (types, subjects, codec, event names). No I/O."""

from typing import TYPE_CHECKING, Any

from . import (
    _approvals,
    _audit,
    _bounds,
    _chains,
    _codec,
    _errors,
    _subjects,
    _suspensions,
    _types,
    events,
)
from ._approvals import *  # noqa: F403
from ._audit import *  # noqa: F403
from ._bounds import *  # noqa: F403
from ._chains import *  # noqa: F403
from ._codec import *  # noqa: F403
from ._errors import *  # noqa: F403
from ._subjects import *  # noqa: F403
from ._suspensions import *  # noqa: F403
from ._types import *  # noqa: F403
from .event_data import json_safe
from .events import *  # noqa: F403  (the standard event constants)
from .tool_filter import ToolFilter

if TYPE_CHECKING:  # loaded on first use: see __getattr__
    from ._contract import json_schemas, schema_definitions

__all__ = [  # each module's own face (its `__all__`), and a few names of the others
    *_approvals.__all__,
    *_audit.__all__,  # the decision audit trail
    *_bounds.__all__,
    *_chains.__all__,
    *_codec.__all__,
    *_errors.__all__,
    *_subjects.__all__,  # the subject and key forms the permissions and integrations build on
    *_suspensions.__all__,
    *_types.__all__,
    *events.__all__,
    "ToolFilter",
    "json_safe",
    "json_schemas",
    "schema_definitions",
]


def __getattr__(name: str) -> Any:
    """`json_schemas` and `schema_definitions` load on first use: a process that only
    sends messages (the Claude Code hook path) never pays for the generator."""
    if name in ("json_schemas", "schema_definitions"):
        from . import _contract

        return getattr(_contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
