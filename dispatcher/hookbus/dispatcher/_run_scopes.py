"""Run scopes: the suspensions of one agent run. ``async with suspensions.run(run_id)``
records the labels the run uses; on exit its live suspensions, unused pre-registered
resolutions and finished (consumed or cancelled) records are removed. Suspensions it
aborted stay, so a later run with the same id (in any process) resumes them. (A *run* is
one agent run, as in the Vercel AI SDK's cleanup of a run's hook labels; see docs/names.md.)
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field

from hookbus.schemas import HookbusError

from ._records import RecordStore

__all__ = ["RunScope", "cleanup", "current_run_scope", "note_label"]

log = logging.getLogger("hookbus.dispatcher")


@dataclass
class RunScope:
    """The labels one agent run used (`run_id` names the run in every process; `aborted`:
    labels left pending for a resume); see `Suspensions.run`."""

    run_id: str
    labels: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)

    @staticmethod
    def current() -> RunScope | None:
        """The run scope of the current task (and of the tasks it started inside it):
        the innermost ``async with Suspensions.run(...)`` block, None outside any."""
        return current_run_scope.get()

    def keep(self, label: str) -> None:
        """Leave `label`'s record in place when the run ends (it is not cleaned up): a
        later run, or a retry of this one, finds it as it was left."""
        self.labels.discard(label)


current_run_scope: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar(
    "hookbus_run_scope", default=None
)
"""The run scope of the current task (None outside ``run``)."""


def note_label(label: str) -> RunScope | None:
    """Record that the current run (if any) used `label`; return that run's scope."""
    run = current_run_scope.get()
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
