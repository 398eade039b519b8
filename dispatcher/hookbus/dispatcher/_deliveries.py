"""Resolutions handed to a waiter before their "consumed" mark is stored.

A waiter whose record was resolved while it held it (the record's ``owner`` is this
process's waiter id, its ``hook_id`` the waiter's) returns the resolution as soon as the
watch delivers it: the resolver's write is the whole wake path. The "consumed" mark
(a compare-and-set on that revision: ``consumed``, detached) is written afterwards, here,
in a background task.

Exactly once still holds, because nobody else may take that resolution meanwhile:

- another process's ``hook(label)`` finds it resolved, unconsumed and attached to a live
  owner, and is refused (`DuplicateSuspensionError`), as it is while the record is pending
  (unless it resumes the same run, which takes over from a run's stopped process);
- this process's next ``hook(label)`` first waits for the mark in flight (`settle`), and
  counts a revision it delivered whose mark could not be stored as consumed (`delivered`);
- a run scope's cleanup and `Suspensions.close` wait for the marks in flight (`flush`).

Only if the process dies between returning the resolution and storing the mark (one KV
write) does the resolution stay unconsumed; once the dead owner's lease expires, the next
``hook(label)`` takes it, like a resolution that arrived after the waiter died.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

__all__ = ["Deliveries"]

log = logging.getLogger("hookbus.dispatcher")

Mark = Callable[[], Awaitable[bool | None]]
"""Store the "consumed" mark: True (stored), False (the record changed first), None
(unknown: JetStream stayed unavailable)."""


class Deliveries:
    """Per process (shared by every per-agent view of a `Suspensions`): the revisions
    handed to waiters, by record key, and their marks in flight."""

    def __init__(self) -> None:
        self._delivered: dict[str, int] = {}
        self._marks: dict[str, asyncio.Task[None]] = {}

    def delivered(self, key: str, revision: int) -> bool:
        """Whether this process handed out `key`'s resolution at `revision` (its mark may
        still be missing: count it as consumed)."""
        return self._delivered.get(key) == revision

    def hand_out(self, key: str, revision: int, mark: Mark) -> None:
        """Record that `key`'s resolution at `revision` was handed to a waiter, and store
        its "consumed" mark in the background (once per key at a time)."""
        self._delivered[key] = revision
        if key in self._marks:
            return
        loop = asyncio.get_running_loop()
        self._marks[key] = loop.create_task(self._mark(key, revision, mark))

    async def _mark(self, key: str, revision: int, mark: Mark) -> None:
        try:
            stored = await mark()
        except Exception as exc:
            stored = None
            log.warning("could not mark %s consumed (%r); it stays handed out here", key[:80], exc)
        finally:
            self._marks.pop(key, None)
        if stored is not None and self._delivered.get(key) == revision:
            del self._delivered[key]  # the record says so now (or changed: not ours to keep)

    async def settle(self, key: str) -> None:
        """Wait for the mark in flight of `key`, if any (never cancels it)."""
        task = self._marks.get(key)
        if task is not None:
            await asyncio.wait({task})

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait (at most `timeout_s` seconds) for every mark in flight."""
        tasks = set(self._marks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
