"""amplifier-core's hook API under amplifier-core's own names, served by hookbus.

The one-line switch for code written against amplifier-core 2.0.2::

    from amplifier_core.hooks import HookRegistry        # before
    from hookbus.amplifier import HookRegistry           # after

`HookRegistry` (and its 2.0.2 name `RustHookRegistry`) is `hookbus.dispatcher.HookDispatcher`:
made with no connection it is amplifier-core's registry, result for result; given a NATS
connection it also calls handlers anywhere on the bus. `HookResult` and `ContextInjection`
are hookbus's wire types with amplifier-core's fields, names and defaults. The event
constants are `amplifier_core.events`' (names and strings), with ``ALL_EVENTS``.
"""

from __future__ import annotations

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import ContextInjection, HookResult
from hookbus.schemas.events import *  # noqa: F403  (amplifier-core's event constants)
from hookbus.schemas.events import __all__ as _event_names

HookRegistry = HookDispatcher
"""amplifier-core's `amplifier_core.hooks.HookRegistry`."""

RustHookRegistry = HookDispatcher
"""amplifier-core 2.0.2's name of the same class (`amplifier_core._engine`)."""

__all__ = [
    "ContextInjection",
    "HookRegistry",
    "HookResult",
    "RustHookRegistry",
    *(n for n in _event_names if n not in ("STANDARD_EVENTS", "StandardEvents")),
]
