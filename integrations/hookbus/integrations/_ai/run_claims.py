"""One live run per run id: the run's claim in the leases bucket, and the hooks of the run
that another live process waits on."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

from hookbus.dispatcher import Leases, Suspensions
from hookbus.schemas import DuplicateSuspensionError, SuspensionRecord, run_claim_key

from .labels import HooksSettings

__all__ = ["RunClaims", "RunInProgressError", "refusal_unwrapped", "run_in_progress"]


class RunInProgressError(DuplicateSuspensionError):
    """Another live process runs this run id: it holds the run's claim (from entering
    `HookbusHooks.run` until leaving it, rewritten by its waiter lease's heartbeat), or
    waits on one of the run's hooks with its waiter lease alive. Its run is left alone; a
    process that died gives the run up when its claim and lease lapse (one lease after its
    last heartbeat, about 15 s)."""


def run_in_progress(run_id: str, label: str, owner: str) -> RunInProgressError:
    """The error for a run `run_id` whose hook `label` the live waiter `owner` waits on."""
    return RunInProgressError(
        f"run {run_id!r} is live in another process (waiter {owner}, waiting on hook"
        f" {label!r}): not started here. If that process died, resume once its lease lapses"
        " (about 15 s)"
    )


class RunClaims:
    """The claims of the runs of the store's agent, and who waits on their hooks."""

    def __init__(self, settings: HooksSettings) -> None:
        self._settings = settings

    @property
    def suspensions(self) -> Suspensions:
        """The store of the hooks served (read at each use)."""
        return self._settings.suspensions

    async def _leases(self) -> Leases:
        return await self.suspensions.ensure_leases()  # opened with the first waiter, kept alive

    async def claim(self, run_id: str) -> tuple[Leases, str]:
        """Claim `run_id` for this process (see `HookbusHooks.run`): its leases and claim
        key, to release when the run ends.

        Raises:
            RunInProgressError: another live process holds the claim.
            HookbusTimeoutError: the leases bucket stayed unavailable for one lease.
        """
        key = run_claim_key(self.suspensions.agent_id, run_id)
        leases = await self._leases()
        owner = await leases.claim(key)
        if owner is not None:
            raise RunInProgressError(
                f"run {run_id!r} is live in another process (waiter {owner} holds its claim):"
                f" not started here. If that process died, start it again once its claim"
                f" lapses (about {leases.lease_s:g} s)"
            )
        return leases, key

    @contextlib.asynccontextmanager
    async def held(self, run_id: str | None) -> AsyncIterator[None]:
        """Hold the claim of `run_id` (None: a run nobody else can know, nothing claimed)
        while the block runs, released when it is left (even by cancellation).

        Raises:
            RunInProgressError: another live process holds the claim, or waits on one of
                the run's hooks.
            HookbusTimeoutError: the leases bucket stayed unavailable for one lease.
        """
        if run_id is None:
            yield
            return
        leases, key = await self.claim(run_id)
        try:
            await self.refuse_a_live_run(run_id)  # a hook waited on elsewhere (kept: harmless)
            yield
        finally:
            await leases.release(key)  # runs to its end even when cancelled

    async def live_owner(self, record: SuspensionRecord, run_id: str) -> str | None:
        """The waiter id of another live process that waits on `record` for the run
        `run_id`, else None."""
        store = self.suspensions
        if record.status != "pending" or not record.attached or record.run_id != run_id:
            return None
        if record.agent_id != store.agent_id:
            return None
        if not record.owner or record.owner == store.waiter_id:
            return None
        leases = await self._leases()
        return record.owner if await leases.alive(record.owner) else None

    async def refuse_a_live_run(self, run_id: str) -> None:
        """Raise `RunInProgressError` if another live process waits on a hook of `run_id`."""
        for record in await self.suspensions.list(status="pending"):
            owner = await self.live_owner(record, run_id)
            if owner is not None:
                raise run_in_progress(run_id, record.label, owner)


@contextlib.contextmanager
def refusal_unwrapped() -> Iterator[None]:
    """Raise a `RunInProgressError` that ends ``ai``'s run (inside its task group, so in a
    `BaseExceptionGroup`) plainly."""
    try:
        yield
    except BaseExceptionGroup as group:
        refused = group.subgroup(RunInProgressError)
        if refused is None:
            raise
        while isinstance(refused, BaseExceptionGroup):
            refused = refused.exceptions[0]
        raise refused from None
