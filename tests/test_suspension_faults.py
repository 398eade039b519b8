"""Suspensions under faults: lost KV acks, a SIGKILLed waiter, malformed records, scale.

- Lost acks: the KV client is wrapped so that a write is really stored and then the call
  raises nats-py's ``TimeoutError`` (exactly what a lost JetStream ack looks like to the
  client). Each of create, update and delete must still end in the right outcome.
- A waiter process SIGKILLed while it holds a label blocks it for about one lease (a short
  lease bucket on a private server), not for the record's whole TTL; a live waiter still
  gives `DuplicateSuspensionError`.
- Malformed records (bad JSON, invalid UTF-8, wrong types, oversize, a label that is not
  its key) are skipped by listings, the CLI and waiters, and can be replaced or cleared.
- 1,100 concurrent waiters in one process all return after their resolution, through one
  JetStream consumer and one lease; the first waiters of a process, arriving at once, share
  one lease (one waiter id on every record, one heartbeat).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats
import nats.errors
import pytest
from _cli_subprocess import hookbus_cli
from _payloads import Grant  # the same shape as _agent_proc.Grant
from conftest import Connect
from nats.aio.client import Client as NATS

from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    LEASES_BUCKET,
    SUSPENSION_EVENTS_WILDCARD,
    SUSPENSIONS_BUCKET,
    AlreadySettledError,
    DuplicateSuspensionError,
    HookbusError,
    HookEvent,
    SuspensionRecord,
    decode,
    encode,
    suspension_event_subject,
    suspension_key,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def label() -> str:
    return f"faults:{uuid.uuid4().hex[:12]} ✓"


# -- lost acks ---------------------------------------------------------------------------------
class LostAcks:
    """A KV client whose next `lose[op]` writes of kind `op` are stored and then answered
    with ``nats.errors.TimeoutError`` (the ack was lost). Everything else is the real one."""

    def __init__(self, kv: Any, **lose: int) -> None:
        self._kv = kv
        self.lose = dict(lose)
        self.lost: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    async def _lossy(self, op: str, *args: Any, **kwargs: Any) -> Any:
        result = await getattr(self._kv, op)(*args, **kwargs)  # really stored
        if self.lose.get(op, 0) > 0:
            self.lose[op] -= 1
            self.lost.append(op)
            raise nats.errors.TimeoutError
        return result

    async def create(self, *args: Any, **kwargs: Any) -> Any:
        return await self._lossy("create", *args, **kwargs)

    async def update(self, *args: Any, **kwargs: Any) -> Any:
        return await self._lossy("update", *args, **kwargs)

    async def delete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._lossy("delete", *args, **kwargs)


def lose_acks(d: HookDispatcher, **lose: int) -> LostAcks:
    """Wrap `d`'s suspension KV client (works on the record store and on a bare `_kv`)."""
    store = d.suspensions
    holder: Any = getattr(store, "records", store)
    attr = "kv" if hasattr(holder, "kv") else "_kv"
    wrapped = LostAcks(getattr(holder, attr), **lose)
    setattr(holder, attr, wrapped)
    return wrapped


@pytest.fixture
async def pair(connect: Connect) -> AsyncIterator[tuple[HookDispatcher, HookDispatcher, NATS]]:
    nca, ncb = await connect(), await connect()
    a, b = HookDispatcher(nca, approvals=False), HookDispatcher(ncb, approvals=False)
    async with a, b:
        yield a, b, ncb


async def events_of(nc: NATS, label: str) -> Any:
    sub = await nc.subscribe(suspension_event_subject(label, "*"))
    await nc.flush()
    return sub


async def test_a_lost_ack_on_create_does_not_make_hook_a_duplicate_of_itself(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    a, b, ncb = pair
    lossy = lose_acks(a, create=1)
    events = await events_of(ncb, label)
    result: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:
                result.append(await a.hook(label, Grant, timeout_s=20))
            except HookbusError as exc:
                result.append(exc)
            finally:
                tg.cancel_scope.cancel()

        tg.start_soon(wait)
        with anyio.fail_after(10):
            pending = decode((await events.next_msg(timeout=10)).data, HookEvent)
        assert pending.hook.status == "pending"
        await b.resolve_hook(label, Grant(approved=True, by="after a lost create ack"))
        await anyio.sleep_forever()
    assert lossy.lost == ["create"]
    assert result == [Grant(approved=True, by="after a lost create ack")]


async def test_a_lost_ack_on_resolve_still_tells_the_winner_and_publishes_resolved(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    a, b, ncb = pair
    events = await events_of(ncb, label)
    result: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            result.append(await a.hook(label, Grant, timeout_s=20))

        tg.start_soon(wait)
        pending = decode((await events.next_msg(timeout=10)).data, HookEvent)
        assert pending.hook.status == "pending"
        lossy = lose_acks(b, update=1)
        await b.resolve_hook(label, Grant(approved=True, by="winner"))  # no AlreadySettled
        resolved = decode((await events.next_msg(timeout=10)).data, HookEvent)
        assert resolved.hook.status == "resolved"
        assert resolved.hook.resolution == {"approved": True, "by": "winner"}
    assert lossy.lost == ["update"]
    assert result == [Grant(approved=True, by="winner")]
    with pytest.raises(AlreadySettledError):  # a second resolver still loses
        await b.resolve_hook(label, Grant(approved=False))


async def test_a_lost_ack_on_consume_does_not_lose_the_preregistered_resolution(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    a, b, _ = pair
    await b.resolve_hook(label, Grant(approved=True, by="pre-registered"))
    lossy = lose_acks(a, update=1)
    assert await a.hook(label, Grant, timeout_s=5) == Grant(approved=True, by="pre-registered")
    assert lossy.lost == ["update"]
    got = await b.suspensions.get(label)
    assert got is not None and got[0].status == "resolved" and got[0].consumed


async def test_a_lost_ack_on_delete_still_cleans_up_the_run(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    a, b, _ = pair
    lossy = lose_acks(a, delete=1)
    async with a.run():
        await a.resolve_hook(label, Grant(approved=True))  # unused: the run exit removes it
    assert lossy.lost == ["delete"]
    assert await b.suspensions.get(label) is None


async def test_a_lost_race_after_a_lost_ack_is_still_a_lost_race(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    """Reconciling never turns another writer's win into ours."""
    a, b, _ = pair
    await b.resolve_hook(label, Grant(approved=True, by="first"))
    got = await b.suspensions.get(label)
    assert got is not None
    store = b.suspensions.records
    first = await store.swap(msgspec.structs.replace(got[0], consumed=True), last=got[1])
    assert first is not None
    lossy = lose_acks(a)
    assert await a.suspensions.records.swap(got[0], last=got[1]) is None  # stale revision
    assert lossy.lost == []


# -- leases: a SIGKILLed waiter ----------------------------------------------------------------
AGENT = Path(__file__).with_name("_agent_proc.py")


@pytest.mark.faults
async def test_a_sigkilled_waiter_blocks_its_label_for_about_one_lease(
    embedded_server: EmbeddedNatsServer,
) -> None:
    url, label = embedded_server.url, f"killed {uuid.uuid4().hex[:8]}"
    nc = await nats.connect(url)
    try:
        await short_leases(nc, 2.0)
        d = HookDispatcher(nc, approvals=False)
        async with d:
            events = await events_of(nc, label)
            proc = await anyio.open_process(
                [sys.executable, str(AGENT), url, f"run-{uuid.uuid4().hex}", label],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                pending = decode((await events.next_msg(timeout=30)).data, HookEvent)
                assert pending.hook.status == "pending"
                with pytest.raises(DuplicateSuspensionError):  # its owner is alive
                    await d.hook(label, Grant, timeout_s=1)
                proc.kill()  # SIGKILL: no cleanup runs, the record still names it
                await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
            got = await d.suspensions.get(label)
            assert got is not None and got[0].attached, "a killed waiter never detaches"
            # the lease expires by the server's clock (max age 2 s; expiry may lag a few
            # seconds): poll, bounded, far below the record's 7-day TTL
            taken: list[Grant] = []
            with anyio.fail_after(20):
                while not taken:
                    try:
                        async with anyio.create_task_group() as tg:

                            async def take() -> None:
                                taken.append(await d.hook(label, Grant, timeout_s=10))

                            tg.start_soon(take)
                            await _until_owned_by(d, label)
                            await d.resolve_hook(label, Grant(approved=True, by="taken over"))
                    except* DuplicateSuspensionError:
                        await anyio.sleep(0.5)
            assert taken == [Grant(approved=True, by="taken over")]
    finally:
        await nc.close()


async def short_leases(nc: NATS, lease_s: float) -> None:
    """Create the leases bucket with a short lease (first come: the dispatchers use it)."""
    try:
        from hookbus._core.buckets import leases_bucket_config
    except ImportError:  # a tree without leases: nothing to shorten
        return
    await nc.jetstream().create_key_value(config=leases_bucket_config(lease_s=lease_s))


async def _until_owned_by(d: HookDispatcher, label: str) -> None:
    """Wait until `label`'s record names `d`'s process as its owner (or the hook failed)."""
    me = getattr(d.suspensions, "waiter_id", None)
    while True:
        got = await d.suspensions.get(label)
        if me is not None and got is not None and got[0].owner == me:
            return
        await anyio.sleep(0.05)


@pytest.mark.faults
async def test_a_live_waiter_keeps_its_label_past_its_lease(
    embedded_server: EmbeddedNatsServer,
) -> None:
    url, label = embedded_server.url, f"live {uuid.uuid4().hex[:8]}"
    nca, ncb = await nats.connect(url), await nats.connect(url)
    try:
        await short_leases(nca, 1.0)
        a, b = HookDispatcher(nca, approvals=False), HookDispatcher(ncb, approvals=False)
        async with a, b, anyio.create_task_group() as tg:
            events = await events_of(ncb, label)
            result: list[Grant] = []

            async def wait() -> None:
                result.append(await a.hook(label, Grant, timeout_s=30))

            tg.start_soon(wait)
            await events.next_msg(timeout=10)
            for _ in range(4):  # four leases long: the heartbeat keeps it
                with pytest.raises(DuplicateSuspensionError):
                    await b.hook(label, Grant, timeout_s=1)
                await anyio.sleep(1.0)
            await b.resolve_hook(label, Grant(approved=True, by="owner alive"))
        assert result == [Grant(approved=True, by="owner alive")]
    finally:
        await nca.close()
        await ncb.close()


# -- malformed records -------------------------------------------------------------------------
def _bad_values(tag: str) -> dict[str, bytes]:
    """Key label -> a malformed value stored under it."""
    good = SuspensionRecord(label=f"{tag} oversize", status="pending", created_at=1.0)
    big = msgspec.structs.replace(good, metadata={"pad": "x" * 300_000})
    return {
        f"{tag} not json": b"{not json",
        f"{tag} bad utf8": b'{"label": "\xff\xfe", "status": "pending"}',
        f"{tag} wrong types": b'{"label": 5, "status": ["pending"]}',
        f"{tag} bad status": encode({"label": f"{tag} bad status", "status": "maybe"}),
        f"{tag} oversize": encode(big),
        f"{tag} foreign label": encode(
            SuspensionRecord(label="someone else", status="resolved", resolution={"x": 1})
        ),
    }


async def _plant(nc: NATS, values: dict[str, bytes]) -> None:
    kv = await nc.jetstream().key_value(SUSPENSIONS_BUCKET)
    for lab, value in values.items():
        await kv.put(suspension_key(lab), value)


async def test_malformed_records_are_skipped_by_listings_and_reads(
    pair: tuple[HookDispatcher, HookDispatcher, NATS],
) -> None:
    a, b, ncb = pair
    tag = f"bad-{uuid.uuid4().hex[:8]}"
    bad = _bad_values(tag)
    await _plant(ncb, bad)
    await a.resolve_hook(f"{tag} good", Grant(approved=True))
    listed = [r.label for r in await b.suspensions.list() if r.label.startswith(tag)]
    assert listed == [f"{tag} good"]
    page = await b.suspensions.page(prefix=tag)
    assert [r.label for r in page.records] == [f"{tag} good"]
    assert set(bad) <= set(page.skipped_keys) and page.skipped >= len(bad)
    for lab in bad:
        assert await b.suspensions.get(lab) is None


async def test_a_hook_replaces_a_malformed_record_and_a_resolve_preregisters_over_one(
    pair: tuple[HookDispatcher, HookDispatcher, NATS],
) -> None:
    a, b, ncb = pair
    tag = f"bad-{uuid.uuid4().hex[:8]}"
    bad = _bad_values(tag)
    await _plant(ncb, bad)
    waited, preregistered = f"{tag} bad utf8", f"{tag} wrong types"
    await b.resolve_hook(preregistered, Grant(approved=True, by="over a bad record"))
    assert await a.hook(preregistered, Grant, timeout_s=5) == Grant(
        approved=True, by="over a bad record"
    )
    async with anyio.create_task_group() as tg:
        result: list[Grant] = []

        async def wait() -> None:
            result.append(await a.hook(waited, Grant, timeout_s=10))

        events = await events_of(ncb, waited)
        tg.start_soon(wait)
        await events.next_msg(timeout=10)
        await b.resolve_hook(waited, Grant(approved=False, by="fine"))
    assert result == [Grant(approved=False, by="fine")]


async def test_a_waiter_survives_a_malformed_version_of_its_record(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], label: str
) -> None:
    a, b, ncb = pair
    events = await events_of(ncb, label)
    result: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            try:
                result.append(await a.hook(label, Grant, timeout_s=20))
            except Exception as exc:  # the defect: a decode error out of the waiter
                result.append(exc)

        tg.start_soon(wait)
        await events.next_msg(timeout=10)
        await _plant(ncb, {label: b'{"label": "\xff", "status": 1}'})
        assert await b.suspensions.get(label) is None
        await b.resolve_hook(label, Grant(approved=True, by="after garbage"))
    assert result == [Grant(approved=True, by="after garbage")]


async def test_the_cli_skips_and_reports_malformed_records(
    pair: tuple[HookDispatcher, HookDispatcher, NATS], nats_url: str
) -> None:
    _, b, ncb = pair
    tag = f"bad-{uuid.uuid4().hex[:8]}"
    bad = _bad_values(tag)
    await _plant(ncb, bad)
    listed = await hookbus_cli(nats_url, "suspensions", "list", "--json")
    assert listed.returncode == 0, listed.stderr.decode()
    assert "Traceback" not in listed.stderr.decode()
    assert "malformed" in listed.stderr.decode()
    assert not any(r["label"].startswith(tag) for r in msgspec.json.decode(listed.stdout))
    shown = await hookbus_cli(nats_url, "suspensions", "show", f"{tag} bad utf8")
    assert shown.returncode == 1 and "malformed" in shown.stderr.decode()
    assert "Traceback" not in shown.stderr.decode()
    approvals = await hookbus_cli(nats_url, "approvals")
    assert approvals.returncode == 0, approvals.stderr.decode()
    resolved = await hookbus_cli(nats_url, "suspensions", "resolve", f"{tag} not json", "{}")
    assert resolved.returncode == 1 and "Traceback" not in resolved.stderr.decode()
    prereg = await hookbus_cli(
        nats_url, "suspensions", "resolve", "--preregister", f"{tag} not json", '{"approved": true}'
    )
    assert prereg.returncode == 0, prereg.stderr.decode()
    got = await b.suspensions.get(f"{tag} not json")
    assert got is not None and got[0].preregistered
    cleared = await hookbus_cli(nats_url, "suspensions", "clear", f"{tag} oversize")
    assert cleared.returncode == 0, cleared.stderr.decode()
    assert await b.suspensions.records.read(f"{tag} oversize") is None


# -- scale ----------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def waiter_and_resolver(
    url: str,
) -> AsyncIterator[tuple[HookDispatcher, HookDispatcher, Any, NATS]]:
    """Dispatchers ``a`` (whose hooks wait) and ``b`` (which resolves them) on connections
    of their own, a subscription on every suspension event (on ``b``'s), and ``a``'s
    connection."""
    nca, ncb = await nats.connect(url), await nats.connect(url)
    try:
        a, b = HookDispatcher(nca, approvals=False), HookDispatcher(ncb, approvals=False)
        async with a, b:
            pending = await ncb.subscribe(SUSPENSION_EVENTS_WILDCARD)
            await ncb.flush()
            yield a, b, pending, nca
    finally:
        await nca.close()
        await ncb.close()


async def pendings(pending: Any, tag: str, n: int) -> None:
    """Wait for the ``pending`` events of `n` hooks labelled ``<tag> ...``."""
    seen = 0
    with anyio.fail_after(40):
        while seen < n:
            part = decode((await pending.next_msg(timeout=40)).data, HookEvent).hook
            seen += part.status == "pending" and part.label.startswith(tag)


async def test_the_first_waiters_of_a_process_arriving_at_once_share_one_lease(
    embedded_server: EmbeddedNatsServer,
) -> None:
    """50 first hooks at once: every record names the same owner, and the process keeps one
    lease key alive (not one lease, heartbeat and bucket open per early waiter: an owner
    nothing keeps alive lets another process take a live waiter's record)."""
    n, tag = 50, f"first-{uuid.uuid4().hex[:6]}"
    async with waiter_and_resolver(embedded_server.url) as (a, b, pending, nca):
        async with anyio.create_task_group() as tg:
            for i in range(n):
                tg.start_soon(lambda i=i: a.hook(f"{tag} {i}", Grant, timeout_s=60))
            await pendings(pending, tag, n)
            records = (await b.suspensions.page(status="pending", prefix=tag)).records
            lease_keys = await (await nca.jetstream().key_value(LEASES_BUCKET)).keys()
            for i in range(n):
                await b.resolve_hook(f"{tag} {i}", Grant(approved=True))
        assert len(records) == n
        assert {r.owner for r in records} == {a.suspensions.waiter_id}
        assert len(lease_keys) == 1


@pytest.mark.faults
async def test_1100_concurrent_waiters_in_one_process_all_return(
    embedded_server: EmbeddedNatsServer,
) -> None:
    n, tag = 1100, f"many-{uuid.uuid4().hex[:6]}"
    async with waiter_and_resolver(embedded_server.url) as (a, b, pending, nca):
        results: dict[str, Any] = {}
        labels = [f"{tag} {i}" for i in range(n)]
        async with anyio.create_task_group() as tg:

            async def wait(lab: str) -> None:
                results[lab] = await a.hook(lab, Grant, timeout_s=50)

            for lab in labels:
                tg.start_soon(wait, lab)
            await pendings(pending, tag, n)
            info = await nca.jetstream().stream_info(f"KV_{SUSPENSIONS_BUCKET}")
            assert info.state.consumer_count <= 2  # a's one shared watch (+ b's listing)
            assert a.suspensions.watch.consumers == 1
            limit = anyio.Semaphore(64)

            async def resolve(lab: str) -> None:
                async with limit:
                    await b.resolve_hook(lab, Grant(approved=True, by=lab))

            async with anyio.create_task_group() as resolvers:
                for lab in labels:
                    resolvers.start_soon(resolve, lab)
        assert results == {lab: Grant(approved=True, by=lab) for lab in labels}
        page = await b.suspensions.page(status="resolved", prefix=tag, limit=500)
        assert (page.total, len(page.records), page.next is not None) == (n, 500, True)
        assert all(r.consumed for r in page.records)
        assert (await b.suspensions.page(status="pending", prefix=tag)).total == 0
