"""Durable suspensions: every semantic against a real nats-server.

Each dispatcher has its own connection (one per simulated process). Hook events are read
from the bus; "no such event" is shown with a sentinel event published after flushing
every connection that could have sent one (the server delivers in order to one
subscriber), never with a sleep.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pydantic
import pytest
from _payloads import Budget, Grant
from _sentinel import send_sentinel
from anyio.abc import TaskGroup
from conftest import Connect, connections
from nats.aio.client import Client as NATS

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    SUSPENSIONS_BUCKET,
    AlreadySettledError,
    BadRequestError,
    DuplicateSuspensionError,
    HookbusError,
    HookEvent,
    HookPart,
    ResolutionRejectedError,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionRecord,
    SuspensionTimeoutError,
    label_from_key,
    suspension_key,
)

pytestmark = pytest.mark.anyio


# -- payload types -------------------------------------------------------------------------
class GrantModel(pydantic.BaseModel):
    approved: bool
    limit: int = pydantic.Field(default=0, ge=0)


# -- helpers ---------------------------------------------------------------------------------
class Outcome:
    """What one `hook` call ended with (a value or a hookbus error)."""

    def __init__(self) -> None:
        self.value: Any = None
        self.error: HookbusError | None = None
        self.done = anyio.Event()

    async def wait(self, timeout_s: float = 10) -> Outcome:
        with anyio.fail_after(timeout_s):
            await self.done.wait()
        return self


def spawn_hook(
    tg: TaskGroup, d: HookDispatcher, label: str, payload: Any = None, **kw: Any
) -> Outcome:
    """Start ``d.hook(label, payload, **kw)`` in `tg`; a non-hookbus error fails the test."""
    out = Outcome()

    async def run() -> None:
        try:
            out.value = await d.hook(label, payload, **kw)
        except HookbusError as exc:
            out.error = exc
        finally:
            out.done.set()

    tg.start_soon(run)
    return out


class Events:
    """Every hook event seen on the bus, with lookups by label and status."""

    def __init__(self, d: HookDispatcher, nc: NATS) -> None:
        self._d = d
        self._nc = nc
        self._stream: Any = None
        self.seen: list[HookEvent] = []
        self._taken: set[int] = set()

    async def open(self) -> Events:
        self._stream = await self._d.hook_events()
        return self

    async def close(self) -> None:
        await self._stream.aclose()

    async def next(self, label: str, status: str, timeout_s: float = 10) -> HookPart:
        """The next not yet returned event of `label` with `status`."""
        with anyio.fail_after(timeout_s):
            i = 0
            while True:
                while i < len(self.seen):
                    e = self.seen[i]
                    if i not in self._taken and e.hook.label == label and e.hook.status == status:
                        self._taken.add(i)
                        return e.hook
                    i += 1
                self.seen.append(await self._stream.__anext__())

    async def settle(self, *conns: NATS) -> list[HookEvent]:
        """Read until every event the `conns` sent so far has arrived; return all seen."""
        sentinel = await send_sentinel(self._nc, *conns)
        await self.next(sentinel, "pending")
        return [e for e in self.seen if e.hook.label != sentinel]

    def count(self, label: str, status: str) -> int:
        return sum(1 for e in self.seen if e.hook.label == label and e.hook.status == status)


class World:
    """Two "processes" (a waiter and a resolver), their connections, and the event log."""

    def __init__(self, a: HookDispatcher, b: HookDispatcher, nca: NATS, ncb: NATS, events: Events):
        self.a, self.b, self.nca, self.ncb, self.events = a, b, nca, ncb, events

    async def record(self, label: str) -> SuspensionRecord | None:
        got = await self.b.suspensions.get(label)
        return None if got is None else got[0]


@pytest.fixture
async def world(connect: Connect) -> AsyncIterator[World]:
    nca, ncb = await connect(), await connect()
    a = HookDispatcher(nca, approvals=False)
    b = HookDispatcher(ncb, approvals=False)
    async with a, b:
        events = await Events(b, ncb).open()
        try:
            yield World(a, b, nca, ncb, events)
        finally:
            await events.close()


@pytest.fixture
def label() -> str:
    """A fresh label with characters that keys and subjects cannot hold as they are."""
    return f"test:{uuid.uuid4().hex[:12]} hook.ü"


# -- pre-registered resolutions ------------------------------------------------------------
async def test_preregistered_resolution_is_consumed_by_the_next_hook_exactly_once(
    world: World, label: str
) -> None:
    await world.b.resolve_hook(label, Grant(approved=True, by="ops"))
    pre = await world.record(label)
    assert pre is not None and pre.status == "resolved" and pre.preregistered and not pre.consumed

    assert await world.a.hook(label, Grant) == Grant(approved=True, by="ops")
    consumed = await world.record(label)
    assert consumed is not None and consumed.consumed
    seen = await world.events.settle(world.nca, world.ncb)
    assert [e for e in seen if e.hook.label == label and e.hook.status == "pending"] == [], (
        "a pre-registered resolution returns at once, with no pending event"
    )

    # exactly once: the next hook on the label is a new suspension, not the old value again
    with pytest.raises(SuspensionTimeoutError):
        await world.a.hook(label, Grant, timeout_s=0.5)
    await world.events.next(label, "pending")


async def test_two_hooks_racing_for_one_preregistered_resolution_get_it_once(
    world: World, connect: Connect, label: str
) -> None:
    c = HookDispatcher(await connect(), approvals=False)
    async with c:
        await world.b.resolve_hook(label, Grant(approved=True))
        async with anyio.create_task_group() as tg:
            outs = [spawn_hook(tg, d, label, Grant, timeout_s=1.5) for d in (world.a, c)]
    winners = [o for o in outs if o.error is None]
    assert [o.value for o in winners] == [Grant(approved=True)]
    (loser,) = [o for o in outs if o.error is not None]
    assert isinstance(loser.error, SuspensionTimeoutError | DuplicateSuspensionError), loser.error


async def test_payload_none_takes_any_json(world: World, label: str) -> None:
    value = {"nested": [1, 2.5, None, {"x": "ü"}], "ok": True}
    await world.b.resolve_hook(label, value)
    assert await world.a.hook(label) == value


async def test_preregistered_value_that_does_not_fit_the_payload_is_a_clear_error(
    world: World, label: str
) -> None:
    """No schema is known when a value is pre-registered, so the check happens at the hook:
    a hookbus error (not a raw msgspec one) and the value is not silently used up."""
    await world.b.resolve_hook(label, {"approved": "yes please"})
    with pytest.raises(ResolutionRejectedError, match="approved"):
        await world.a.hook(label, Grant, timeout_s=2)


async def test_a_refused_preregistered_value_can_be_replaced_or_cleared(
    world: World, label: str
) -> None:
    """A value that does not fit stays unconsumed, so it poisoned the label: an operator
    replaces it (``replace=True``) or clears it, and the next hook works."""
    await world.b.resolve_hook(label, {"approved": "yes please"})
    with pytest.raises(ResolutionRejectedError):
        await world.a.hook(label, Grant, timeout_s=2)
    record = await world.record(label)
    assert record is not None and record.status == "resolved" and not record.consumed
    with pytest.raises(AlreadySettledError):  # no silent overwrite without replace
        await world.b.resolve_hook(label, Grant(approved=True))
    await world.b.suspensions.resolve_hook(label, Grant(approved=True, by="fixed"), replace=True)
    assert await world.a.hook(label, Grant, timeout_s=2) == Grant(approved=True, by="fixed")

    cleared = f"{label} cleared"
    await world.b.resolve_hook(cleared, {"approved": 3})
    assert await world.b.suspensions.clear_hook(cleared) is True
    assert await world.record(cleared) is None
    assert await world.b.suspensions.clear_hook(cleared) is False  # nothing left to clear
    with pytest.raises(SuspensionTimeoutError):  # a fresh hook waits instead of being refused
        await world.a.hook(cleared, Grant, timeout_s=0.3)


async def test_a_resolution_the_waiter_refuses_is_not_consumed(world: World, label: str) -> None:
    """A waiter whose schema let a value through that its payload type refuses leaves the
    value unconsumed (it used to be consumed, then refused: lost)."""
    errors: list[HookbusError] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:
                await world.a.suspensions.hook(label, payload=Budget, schema={})
            except HookbusError as exc:
                errors.append(exc)

        tg.start_soon(wait)
        await world.events.next(label, "pending")
        await world.b.resolve_hook(label, {"amount": -1})
    assert [type(e) for e in errors] == [ResolutionRejectedError]
    record = await world.record(label)
    assert record is not None and record.status == "resolved" and not record.consumed
    await world.b.suspensions.resolve_hook(label, Budget(amount=3), replace=True)
    assert await world.a.hook(label, Budget, timeout_s=2) == Budget(amount=3)


async def test_listing_is_paged_and_filtered_by_status(world: World) -> None:
    tag = f"page-{uuid.uuid4().hex[:8]}"
    pending = [f"{tag} pending {i}" for i in range(5)]
    preregistered = [f"{tag} resolved {i}" for i in range(3)]
    async with anyio.create_task_group() as tg:
        for lab in pending:
            spawn_hook(tg, world.a, lab, Grant)
            await world.events.next(lab, "pending")
        for lab in preregistered:
            await world.b.resolve_hook(lab, Grant(approved=True))
        seen: list[str] = []
        pages: list[int] = []
        after = None
        while True:
            page = await world.b.suspensions.page(
                status="pending", prefix=tag, limit=2, after=after
            )
            assert page.total == len(pending) and page.skipped == 0
            seen += [r.label for r in page.records]
            pages.append(len(page.records))
            assert all(r.status == "pending" for r in page.records)
            if page.next is None:
                break
            after = page.next
        assert seen == pending and pages == [2, 2, 1]  # oldest first, each label once
        resolved = await world.b.suspensions.list(status="resolved")
        assert [r.label for r in resolved if r.label.startswith(tag)] == preregistered
        with pytest.raises(BadRequestError):
            await world.b.suspensions.page(after="not a cursor")
        tg.cancel_scope.cancel()


# -- pending, resolve, duplicates ------------------------------------------------------------
async def test_hook_creates_a_pending_record_emits_pending_and_wakes_on_resolve(
    world: World, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant, metadata={"tool_name": "bash", "n": 1})
        part = await world.events.next(label, "pending")
        assert part.label == label and part.hook_id
        assert part.metadata == {"tool_name": "bash", "n": 1}
        record = await world.record(label)
        assert record is not None
        assert record.status == "pending" and record.attached and record.hook_id == part.hook_id
        assert record.payload_type == "Grant"
        assert record.payload_schema == msgspec.json.schema(Grant)
        assert record.metadata == {"tool_name": "bash", "n": 1}

        await world.b.resolve_hook(label, Grant(approved=True, by="alice"))
        await out.wait()
    assert out.error is None and out.value == Grant(approved=True, by="alice")
    resolved = await world.events.next(label, "resolved")
    assert resolved.hook_id == part.hook_id
    assert resolved.resolution == {"approved": True, "by": "alice"}
    # the waiter returned on the resolver's write; its "consumed" mark follows at once
    with anyio.fail_after(5):
        while (record := await world.record(label)) is not None and not record.consumed:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert record is not None and record.status == "resolved" and record.consumed


async def test_a_second_live_hook_with_the_same_label_is_a_clear_error(
    world: World, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        first = spawn_hook(tg, world.a, label, Grant)
        await world.events.next(label, "pending")
        with anyio.fail_after(10):  # an error, not a hang
            with pytest.raises(DuplicateSuspensionError, match="live hook"):
                await world.b.hook(label, Grant)
        assert world.events.count(label, "pending") == 1
        await world.b.resolve_hook(label, Grant(approved=False))  # the first is undisturbed
        await first.wait()
    assert first.value == Grant(approved=False)


async def test_a_second_live_hook_in_the_same_run_and_process_is_a_clear_error(
    world: World, label: str
) -> None:
    """Re-attaching is for resuming a run whose waiter is gone, not for two live waiters."""
    async with world.a.run(f"run-{uuid.uuid4().hex}"), anyio.create_task_group() as tg:
        first = spawn_hook(tg, world.a, label, Grant)
        await world.events.next(label, "pending")
        with pytest.raises(DuplicateSuspensionError):
            await world.a.hook(label, Grant, timeout_s=2)
        await world.b.resolve_hook(label, Grant(approved=True))
        await first.wait()
    assert first.value == Grant(approved=True)


async def test_exactly_one_of_n_concurrent_resolvers_wins(
    world: World, connect: Connect, label: str
) -> None:
    resolvers = [HookDispatcher(await connect(), approvals=False) for _ in range(6)]
    for r in resolvers:
        await r.start()
    try:
        wins: list[int] = []
        losses: list[AlreadySettledError] = []
        go = anyio.Event()

        async def resolve(i: int, d: HookDispatcher) -> None:
            await go.wait()
            try:
                await d.resolve_hook(label, Grant(approved=True, by=f"r{i}"))
                wins.append(i)
            except AlreadySettledError as exc:
                losses.append(exc)

        async with anyio.create_task_group() as tg:
            out = spawn_hook(tg, world.a, label, Grant)
            await world.events.next(label, "pending")
            for i, d in enumerate(resolvers):
                tg.start_soon(resolve, i, d)
            go.set()
            await out.wait()
    finally:
        for r in resolvers:
            await r.close()
    assert len(wins) == 1 and len(losses) == len(resolvers) - 1
    assert all("already resolved" in str(e) for e in losses), [str(e) for e in losses]
    assert out.value == Grant(approved=True, by=f"r{wins[0]}")


# -- schema checks at resolve time -----------------------------------------------------------
async def test_a_value_that_does_not_fit_is_refused_with_the_reason_and_the_record_is_unchanged(
    world: World, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        await world.events.next(label, "pending")
        before = await world.b.suspensions.get(label)

        with pytest.raises(ResolutionRejectedError) as wrong_type:
            await world.b.resolve_hook(label, {"approved": "yes"})
        assert "$.approved" in str(wrong_type.value) and "boolean" in str(wrong_type.value)
        assert isinstance(wrong_type.value, BadRequestError)
        with pytest.raises(ResolutionRejectedError, match="required"):
            await world.b.resolve_hook(label, {"by": "bob"})
        with pytest.raises(ResolutionRejectedError):
            await world.b.resolve_hook(label, "not an object")

        assert await world.b.suspensions.get(label) == before  # same record, same revision
        assert not out.done.is_set()
        await world.b.resolve_hook(label, {"approved": True})
        await out.wait()
    assert out.value == Grant(approved=True)


async def test_constraints_of_a_msgspec_payload_are_checked(world: World, label: str) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Budget)
        await world.events.next(label, "pending")
        with pytest.raises(ResolutionRejectedError, match=r"\$\.amount"):
            await world.b.resolve_hook(label, Budget(amount=-5))
        await world.b.resolve_hook(label, Budget(amount=5))
        await out.wait()
    assert out.value == Budget(amount=5)


async def test_pydantic_model_payload(world: World, label: str) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, GrantModel)
        await world.events.next(label, "pending")
        record = await world.record(label)
        assert record is not None
        assert record.payload_type == "GrantModel"
        assert record.payload_schema == GrantModel.model_json_schema()
        with pytest.raises(ResolutionRejectedError, match=r"\$\.limit"):
            await world.b.resolve_hook(label, {"approved": True, "limit": -1})
        with pytest.raises(ResolutionRejectedError, match=r"\$\.approved"):
            await world.b.resolve_hook(label, {"approved": [1]})
        await world.b.resolve_hook(label, GrantModel(approved=True, limit=3))
        await out.wait()
    assert isinstance(out.value, GrantModel)
    assert out.value == GrantModel(approved=True, limit=3)


async def test_preregistered_pydantic_resolution(world: World, label: str) -> None:
    await world.b.resolve_hook(label, GrantModel(approved=False, limit=7))
    got = await world.a.hook(label, GrantModel)
    assert isinstance(got, GrantModel) and got == GrantModel(approved=False, limit=7)


# -- cancel ------------------------------------------------------------------------------------
async def test_cancel_makes_the_waiter_raise_and_emits_cancelled(world: World, label: str) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        pending = await world.events.next(label, "pending")
        await world.b.cancel_hook(label, reason="no longer needed")
        await out.wait()
    assert isinstance(out.error, SuspensionCancelledError)
    assert out.error.reason == "no longer needed"
    cancelled = await world.events.next(label, "cancelled")
    assert cancelled.hook_id == pending.hook_id and cancelled.reason == "no longer needed"

    with pytest.raises(AlreadySettledError, match="cancelled"):
        await world.b.resolve_hook(label, Grant(approved=True))
    with pytest.raises(AlreadySettledError, match="cancelled"):
        await world.b.cancel_hook(label)
    with pytest.raises(SuspensionCancelledError):  # a later hook on it learns it was cancelled
        await world.a.hook(label, Grant, timeout_s=2)


async def test_cancel_of_an_unknown_label_and_of_a_resolved_hook(world: World, label: str) -> None:
    with pytest.raises(SuspensionNotFoundError, match="no suspension"):
        await world.b.cancel_hook(label)
    await world.b.resolve_hook(label, Grant(approved=True))
    with pytest.raises(AlreadySettledError, match="resolved"):
        await world.b.cancel_hook(label)


async def test_resolve_racing_cancel_ends_in_exactly_one_outcome(
    world: World, connect: Connect
) -> None:
    c = HookDispatcher(await connect(), approvals=False)
    labels = [f"race {uuid.uuid4().hex[:8]} #{i}" for i in range(12)]
    settled: dict[str, list[str]] = {lab: [] for lab in labels}
    async with c:
        go = anyio.Event()

        async def resolve(lab: str) -> None:
            await go.wait()
            try:
                await world.b.resolve_hook(lab, Grant(approved=True))
                settled[lab].append("resolved")
            except AlreadySettledError:
                pass

        async def cancel(lab: str) -> None:
            await go.wait()
            try:
                await c.cancel_hook(lab, reason="race")
                settled[lab].append("cancelled")
            except AlreadySettledError:
                pass

        async with anyio.create_task_group() as tg:
            outs = {lab: spawn_hook(tg, world.a, lab, Grant) for lab in labels}
            for lab in labels:
                await world.events.next(lab, "pending")
                tg.start_soon(resolve, lab)
                tg.start_soon(cancel, lab)
            go.set()
            for out in outs.values():
                await out.wait()
    for lab in labels:
        assert len(settled[lab]) == 1, (lab, settled[lab])
        record = await world.record(lab)
        assert record is not None and record.status == settled[lab][0]
        out = outs[lab]
        if settled[lab] == ["resolved"]:
            assert out.error is None and out.value == Grant(approved=True)
        else:
            assert isinstance(out.error, SuspensionCancelledError) and out.error.reason == "race"


# -- abort and serverless resume --------------------------------------------------------------
async def test_abort_pending_hook_stops_waiting_and_leaves_the_record_pending(
    world: World, connect: Connect, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        part = await world.events.next(label, "pending")
        assert world.a.abort_pending_hook(part) is True
        await out.wait()
    assert isinstance(out.error, SuspensionAbortedError)
    assert world.a.abort_pending_hook(part) is False  # nothing waits on it here any more
    assert world.b.abort_pending_hook(part.hook_id) is False  # nor in another process
    record = await world.record(label)
    assert record is not None and record.status == "pending" and not record.attached
    assert record.hook_id == part.hook_id

    # serverless resume: resolved while nobody waits; a later caller gets it, no new prompt
    await world.b.resolve_hook(label, Grant(approved=True, by="later"))
    c = HookDispatcher(await connect(), approvals=False)
    async with c:
        assert await c.hook(label, Grant) == Grant(approved=True, by="later")
    seen = await world.events.settle(world.nca, world.ncb)
    assert [e.hook.status for e in seen if e.hook.label == label] == ["pending", "resolved"]


async def test_a_detached_hook_is_reattached_by_a_later_hook_and_resolved(
    world: World, label: str
) -> None:
    async with anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        part = await world.events.next(label, "pending")
        assert world.a.abort_pending_hook(part.hook_id)  # by hook id
        await out.wait()
        assert isinstance(out.error, SuspensionAbortedError)

    # nobody waits on it now: a later hook re-attaches and waits (no DuplicateSuspensionError)
    with pytest.raises(SuspensionTimeoutError):
        await world.b.hook(label, Grant, timeout_s=0.5)
    async with anyio.create_task_group() as tg:
        again = spawn_hook(tg, world.b, label, Grant)
        await world.b.resolve_hook(label, Grant(approved=True))
        await again.wait()
    assert again.error is None and again.value == Grant(approved=True)


# -- run scopes ---------------------------------------------------------------------------------
async def test_a_later_run_with_the_same_id_resumes_an_aborted_hook(
    world: World, connect: Connect, label: str
) -> None:
    run_id = f"run-{uuid.uuid4().hex}"
    async with world.a.run(run_id), anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        part = await world.events.next(label, "pending")
        world.a.abort_pending_hook(part)
        await out.wait()
    assert isinstance(out.error, SuspensionAbortedError)
    record = await world.record(label)
    assert record is not None and record.status == "pending", "run exit keeps aborted hooks"

    await world.b.resolve_hook(label, Grant(approved=True, by="human"))
    c = HookDispatcher(await connect(), approvals=False)
    async with c, c.run(run_id):
        assert await c.hook(label, Grant) == Grant(approved=True, by="human")
    assert await world.record(label) is None, "the resumed run's exit removes the used record"


async def test_run_exit_removes_its_live_hooks(world: World, label: str) -> None:
    async with world.a.run() as run:
        async with anyio.create_task_group() as tg:
            spawn_hook(tg, world.a, label, Grant)
            await world.events.next(label, "pending")
            assert await world.record(label) is not None
            tg.cancel_scope.cancel()  # the run gives up while its hook is live
        assert label in run.labels
    assert await world.record(label) is None


async def test_run_exit_removes_unused_preregistered_resolutions_and_used_records(
    world: World, label: str
) -> None:
    unused, used, foreign = f"{label} unused", f"{label} used", f"{label} foreign"
    await world.b.resolve_hook(foreign, Grant(approved=True))  # not this run's label
    async with world.a.run():
        await world.a.resolve_hook(unused, Grant(approved=True))
        await world.a.resolve_hook(used, Grant(approved=False))
        assert await world.a.hook(used, Grant) == Grant(approved=False)
        assert await world.record(unused) is not None
    assert await world.record(unused) is None
    assert await world.record(used) is None
    foreign_record = await world.record(foreign)
    assert foreign_record is not None and foreign_record.preregistered


async def test_run_exit_removes_a_hook_cancelled_in_it(world: World, label: str) -> None:
    async with world.a.run(), anyio.create_task_group() as tg:
        out = spawn_hook(tg, world.a, label, Grant)
        await world.events.next(label, "pending")
        await world.b.cancel_hook(label, reason="stop")
        await out.wait()
    assert isinstance(out.error, SuspensionCancelledError)
    assert await world.record(label) is None


# -- timeout --------------------------------------------------------------------------------------
async def test_a_timeout_gives_a_clear_error_and_leaves_the_hook_resumable(
    world: World, label: str
) -> None:
    with pytest.raises(SuspensionTimeoutError, match=r"no resolution within 0\.3s") as info:
        await world.a.hook(label, Grant, timeout_s=0.3)
    assert isinstance(info.value, TimeoutError)
    assert repr(label) in str(info.value)
    record = await world.record(label)
    assert record is not None and record.status == "pending" and not record.attached
    await world.b.resolve_hook(label, Grant(approved=True))
    assert await world.a.hook(label, Grant, timeout_s=5) == Grant(approved=True)


# -- labels of any text ----------------------------------------------------------------------------
ODD_LABELS = [
    "plain",
    "with space and: colon",
    "dots.and*wild>cards",
    "=3A",  # looks like an encoded ':' but is not one
    ":",
    "ünïcödé 审批 🚦",
    "line\nbreak\ttab/slash\\back",
    "$KV.hookbus_suspensions.x",
    "-",
    "x" * 300,
]


async def test_labels_of_any_text_round_trip(world: World) -> None:
    tag = uuid.uuid4().hex[:8]
    labels = [f"{tag}{lab}" if lab != "x" * 300 else lab + tag for lab in ODD_LABELS]
    labels += [ODD_LABELS[3] + tag, ODD_LABELS[4] + tag]  # ':' and '=3A' right after the tag too
    keys = [suspension_key(lab) for lab in labels]
    assert len(set(keys)) == len(labels)
    assert [label_from_key(k) for k in keys] == labels
    async with anyio.create_task_group() as tg:
        outs = {lab: spawn_hook(tg, world.a, lab, Grant) for lab in labels}
        for lab in labels:
            part = await world.events.next(lab, "pending")  # the event subject decodes back
            assert part.label == lab
        listed = {r.label for r in await world.b.suspensions.list()}
        assert set(labels) <= listed
        for lab in labels:
            record = await world.record(lab)
            assert record is not None and record.label == lab
            await world.b.resolve_hook(lab, Grant(approved=True, by=lab))
        for out in outs.values():
            await out.wait()
    assert {lab: out.value for lab, out in outs.items()} == {
        lab: Grant(approved=True, by=lab) for lab in labels
    }


async def test_an_empty_label_is_refused(world: World) -> None:
    with pytest.raises(BadRequestError):
        await world.a.hook("", Grant, timeout_s=1)


async def test_a_very_long_label_works_or_is_refused_clearly_and_the_connection_survives(
    world: World,
) -> None:
    """A label whose key would not fit a NATS control line must not break the connection."""
    long_label = "审" * 1000 + uuid.uuid4().hex
    try:
        await world.b.resolve_hook(long_label, Grant(approved=True))
        assert await world.a.hook(long_label, Grant, timeout_s=5) == Grant(approved=True)
    except HookbusError:
        pass  # refused with hookbus's own error: fine
    assert world.nca.is_connected and world.ncb.is_connected
    ok = f"after-long {uuid.uuid4().hex}"
    await world.b.resolve_hook(ok, Grant(approved=True))
    assert await world.a.hook(ok, Grant, timeout_s=5) == Grant(approved=True)


# -- TTL -------------------------------------------------------------------------------------------
async def test_records_expire_by_the_bucket_ttl(embedded_server: Any) -> None:
    """A private server: the bucket takes its TTL from the first dispatcher that creates it.
    Expiry lags 2-10 s, so the check polls (bounded) instead of asserting a time."""
    import nats

    nc = await nats.connect(embedded_server.url)
    try:
        d = HookDispatcher(nc, approvals=False, suspension_ttl_s=2)
        async with d:
            await d.resolve_hook("expires", Grant(approved=True))  # pre-registered, never used
            waiter_label = "pending and abandoned"
            with anyio.fail_after(25):
                assert await d.suspensions.get("expires") is not None
                # a waiter on a record that expires is told, instead of waiting forever
                with pytest.raises(SuspensionCancelledError):
                    await d.hook(waiter_label, Grant)
                # max-age removal sends watchers nothing: poll (bounded by the fail_after)
                while await d.suspensions.get("expires") is not None:  # noqa: ASYNC110
                    await anyio.sleep(0.5)
            assert await d.suspensions.get(waiter_label) is None
    finally:
        await nc.close()


async def test_a_listing_reads_every_record_while_others_are_written(world: World) -> None:
    """A listing reads the last value of every key, and ends when it has: records written
    meanwhile (other agents' calls) do not make it stop early or miss older ones."""
    tag = f"many-{uuid.uuid4().hex[:8]}"
    labels = [f"{tag} {i:03d}" for i in range(300)]
    for lab in labels:
        await world.b.resolve_hook(lab, Grant(approved=True))
    busy = f"busy-{uuid.uuid4().hex[:8]}"
    totals: list[int] = []
    async with anyio.create_task_group() as tg:

        async def churn() -> None:
            for i in itertools.count():
                await world.a.suspensions.resolve_hook(
                    f"{busy} {i % 50}", Grant(approved=True), replace=True
                )

        tg.start_soon(churn)
        for _ in range(60):
            totals.append((await world.b.suspensions.page(prefix=tag)).total)
        tg.cancel_scope.cancel()
    assert totals == [len(labels)] * 60


async def test_a_bucket_emptied_by_expiry_or_purge_lists_at_once(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """A bucket whose records are all gone (expired by its TTL, or purged) still has a last
    stream sequence; the listing must not wait to read a message that no longer exists."""
    async with connections(embedded_server.url) as make:
        nc = await make()
        async with HookDispatcher(nc, approvals=False) as d:
            for i in range(3):
                await d.suspensions.resolve_hook(f"gone {i}", Grant(approved=True))
            assert (await d.suspensions.page()).total == 3
            await nc.jetstream().purge_stream(f"KV_{SUSPENSIONS_BUCKET}")
            with anyio.fail_after(5):  # the listing's own deadline is 15 s
                page = await d.suspensions.page()
            assert page.total == 0 and page.records == []
