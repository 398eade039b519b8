"""Run scopes: ``async with suspensions.run(run_id)`` records the labels a run uses; on
exit its live hooks, unused pre-registered resolutions and finished (consumed or
cancelled) records are removed. Hooks it aborted stay, so a later run with the same id
(in any process) resumes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field

from hookbus.schemas import HookbusError

from ._records import RecordStore

__all__ = ["RunScope", "cleanup", "current_run"]

log = logging.getLogger("hookbus.dispatcher")


@dataclass
class RunScope:
    """The labels one run used; see `Suspensions.run`."""

    run_id: str
    labels: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)


current_run: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar(
    "hookbus_run", default=None
)
"""The run scope of the current task (None outside ``run``)."""


def note(label: str) -> RunScope | None:
    """Record that the current run (if any) used `label`; return that run."""
    run = current_run.get()
    if run is not None:
        run.labels.add(label)
    return run


async def cleanup(records: RecordStore, scope: RunScope) -> None:
    """Remove what `scope` leaves behind (see the module docstring). Best effort: a
    record that changed meanwhile or cannot be read is left to the bucket's TTL."""
    for label in sorted(scope.labels - scope.aborted):
        try:
            entry = await records.read(label)
            if entry is None:
                continue
            record = entry.record
            if record is None:  # malformed: it was this run's label; remove it
                await records.delete(label, last=entry.revision)
                continue
            live = record.status == "pending" and record.attached and record.run_id == scope.run_id
            finished = record.consumed or record.status == "cancelled"
            unused_prereg = record.preregistered and not record.consumed
            if live or finished or unused_prereg:
                await records.delete(label, last=entry.revision)
        except HookbusError as exc:
            log.info("run %s: could not remove %r (%s)", scope.run_id, label, exc)
        except Exception as exc:
            with contextlib.suppress(Exception):
                log.info("run %s: could not remove %r (%r)", scope.run_id, label, exc)
