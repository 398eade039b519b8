"""Consumer slots: a connection scoped to an identity (inbox prefix ``_INBOX_<PUBKEY>``)
creates its JetStream consumers under the identity's few names only, takes the next name
when one is held, says so in one line when all are held and the server refuses any other,
and keeps a slot consumer ordered (a missed message is delivered again).

On the open test server an identity is only an inbox prefix; the refusal of consumers
outside the slots needs permissions, so that test runs a server of its own whose user may
create the slot names only.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, KeyValueConfig

from hookbus._core.consumer_slots import CONSUMER_SLOTS, identity_key, slot_names
from hookbus._core.consumers import (
    ConsumerSlotsExhaustedError,
    KeyWatch,
    SlotConsumer,
    watch_keys,
)
from hookbus._core.kv import release_consumer, subscribe_keys
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HandlerDeclaration, encode, handler_key

pytestmark = pytest.mark.anyio

_B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def _public_key() -> str:
    """A made-up user public key (the shape hookbus reads: U and 55 base32 characters)."""
    return "U" + "".join(secrets.choice(_B32) for _ in range(55))


# -- the data -----------------------------------------------------------------------------


def test_slot_names_are_fixed_distinct_valid_consumer_names() -> None:
    key = _public_key()
    names = slot_names(key)
    assert len(names) == CONSUMER_SLOTS == 8
    assert names == tuple(f"{key}_{i}" for i in range(8))
    assert len(set(names)) == 8
    assert not any(c in name for name in names for c in ".*> \t")
    assert not set(names) & set(slot_names(_public_key()))
    with pytest.raises(ValueError):
        slot_names("")
    with pytest.raises(ValueError):
        slot_names("U.>")


class _Conn:
    def __init__(self, prefix: object) -> None:
        self._inbox_prefix = prefix


@pytest.mark.parametrize("kind", [bytes, bytearray, str])
def test_identity_key_reads_the_identity_inbox_prefix(kind: type) -> None:
    key = _public_key()
    prefix = f"_INBOX_{key}"
    assert identity_key(_Conn(kind(prefix, "ascii") if kind is not str else prefix)) == key


@pytest.mark.parametrize(
    "prefix",
    [b"_INBOX", b"_INBOX_", b"_INBOX_abc", b"_INBOX_" + b"U" * 10, b"\xff\xfe", None, 3,
     "_INBOX_N" + "A" * 55, "x_INBOX_U" + "A" * 55],
)  # fmt: skip
def test_identity_key_is_none_without_the_identity_shape(prefix: object) -> None:
    assert identity_key(_Conn(prefix)) is None
    assert identity_key(object()) is None


# -- slot consumers on the open server ----------------------------------------------------


@pytest.fixture
async def bucket(nats_url: str) -> AsyncIterator[tuple[str, str]]:
    """A fresh bucket and a made-up identity: (bucket name, public key)."""
    name = f"slots_{uuid.uuid4().hex[:10]}"
    admin = await nats.connect(nats_url)
    js = admin.jetstream()
    await js.create_key_value(KeyValueConfig(bucket=name, history=1))
    try:
        yield name, _public_key()
    finally:
        with contextlib.suppress(Exception):
            await js.delete_key_value(name)
        await admin.close()


async def _as(url: str, key: str) -> Any:
    return await nats.connect(url, inbox_prefix=f"_INBOX_{key}")


@dataclass
class Scoped:
    """A connection of `bucket`'s made-up identity (its inbox prefix): its JetStream
    context `js`, the `bucket` name and the identity's public `key`."""

    js: JetStreamContext
    bucket: str
    key: str


@pytest.fixture
async def scoped(nats_url: str, bucket: tuple[str, str]) -> AsyncIterator[Scoped]:
    """`Scoped` on the fresh bucket, its connection closed at the test's end."""
    name, key = bucket
    nc = await _as(nats_url, key)
    try:
        yield Scoped(nc.jetstream(), name, key)
    finally:
        await nc.close()


async def test_a_slot_held_by_another_process_makes_the_next_one_used(
    nats_url: str, bucket: tuple[str, str]
) -> None:
    name, key = bucket
    one, two = await _as(nats_url, key), await _as(nats_url, key)
    try:
        kv1 = await one.jetstream().key_value(name)
        kv2 = await two.jetstream().key_value(name)
        first = await watch_keys(kv1)
        second = await watch_keys(kv2)  # another process of the same identity
        assert isinstance(first, KeyWatch) and isinstance(second, KeyWatch)
        assert (first._sub.name, second._sub.name) == slot_names(key)[:2]
        info = await one.jetstream().consumers_info(f"KV_{name}")
        assert sorted(i.name for i in info) == sorted(slot_names(key)[:2])
        assert all(i.config.inactive_threshold <= 30 for i in info)  # a crash frees it soon
        await first.stop()  # released: the slot is free again, and deleted at once
        third = await watch_keys(kv2)
        assert third._sub.name == slot_names(key)[0]
        await release_consumer(second._sub)
        await release_consumer(third._sub)
        assert await one.jetstream().consumers_info(f"KV_{name}") == []
    finally:
        await one.close()
        await two.close()


async def test_without_an_identity_consumers_are_made_as_before(
    nats_url: str, bucket: tuple[str, str]
) -> None:
    name, _ = bucket
    nc = await nats.connect(nats_url)
    try:
        kv = await nc.jetstream().key_value(name)

        async def cb(msg: Any) -> None:
            pass

        sub = await subscribe_keys(
            kv, ">", cb=cb, deliver_policy=DeliverPolicy.NEW, inactive_threshold_s=30
        )
        assert not isinstance(sub, SlotConsumer)
        await release_consumer(sub)
        watcher = await watch_keys(kv)
        assert not isinstance(watcher._sub, SlotConsumer)  # nats-py's ordered consumer
        await release_consumer(watcher._sub)
    finally:
        await nc.close()


async def test_past_the_slots_the_open_server_allows_one_more_consumer(scoped: Scoped) -> None:
    """Where the user may create any consumer (the dispatcher service's grants; an open
    server), a watch past the slots still works, on a consumer outside them."""
    js, name, key = scoped.js, scoped.bucket, scoped.key
    for slot in slot_names(key):  # another process holds every slot
        await js.add_consumer(
            f"KV_{name}", name=slot, deliver_subject=f"_INBOX_{key}.held.{slot}",
            filter_subject=f"$KV.{name}.>", inactive_threshold=30,
        )  # fmt: skip
    kv = await js.key_value(name)
    await kv.put("k", b"v")
    watch = await watch_keys(kv)
    assert watch._sub.name not in slot_names(key) and not watch._sub.in_slot
    entry = await watch.updates(timeout=5)
    assert entry is not None and entry.value == b"v"
    await watch.stop()


async def _one_message_dropped(consumer: SlotConsumer, which: int) -> list[int]:
    """Make the consumer's current subscription lose its `which`-th message (1-based),
    as a slow connection's dropped delivery would. Returns the dropped stream sequences."""
    sub = consumer._sub
    deliver = sub._cb
    dropped: list[int] = []
    seen = 0

    async def lossy(msg: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == which:
            dropped.append(int(msg.reply.split(".")[5]))
            return
        await deliver(msg)

    sub._cb = lossy
    return dropped


async def test_a_missed_update_is_delivered_again(scoped: Scoped) -> None:
    kv = await scoped.js.key_value(scoped.bucket)
    watch = await watch_keys(kv)
    assert await watch.updates(timeout=5) is None  # nothing yet
    dropped = await _one_message_dropped(watch._sub, 2)
    for i in range(3):
        await kv.put(f"k{i}", str(i).encode())
    got: dict[str, bytes] = {}
    while len(got) < 3:
        entry = await watch.updates(timeout=5)
        assert entry is not None
        got[entry.key] = entry.value
    assert got == {"k0": b"0", "k1": b"1", "k2": b"2"}
    assert dropped and watch._sub.gaps == 1 and watch._sub.recreated == 1
    assert watch._sub.name == slot_names(scoped.key)[1]  # re-created under the next free name
    await kv.put("k3", b"3")  # and it goes on
    entry = await watch.updates(timeout=5)
    assert entry is not None and (entry.key, entry.value) == ("k3", b"3")
    await watch.stop()


async def test_a_missed_last_update_is_recovered_by_the_check(scoped: Scoped) -> None:
    """A loss with nothing after it (no sequence jump to notice) is found by the periodic
    check: the server delivered more than arrived, and nothing came for a whole period."""
    kv = await scoped.js.key_value(scoped.bucket)
    watch = await watch_keys(kv, check_s=0.2)
    assert await watch.updates(timeout=5) is None
    await _one_message_dropped(watch._sub, 1)
    await kv.put("only", b"1")
    entry = await watch.updates(timeout=10)
    assert entry is not None and (entry.key, entry.value) == ("only", b"1")
    assert watch._sub.recreated == 1
    await watch.stop()


async def test_a_deleted_consumer_is_re_created_by_the_check(scoped: Scoped) -> None:
    kv = await scoped.js.key_value(scoped.bucket)
    watch = await watch_keys(kv, check_s=0.2)
    assert await watch.updates(timeout=5) is None
    await scoped.js.delete_consumer(f"KV_{scoped.bucket}", watch._sub.name)  # a restart, say
    await asyncio.sleep(0.1)
    await kv.put("after", b"1")
    entry = await watch.updates(timeout=10)
    assert entry is not None and entry.key == "after"
    await watch.stop()


async def test_a_dispatcher_of_an_identity_follows_the_registry_without_a_consumer(
    nats_url: str, event: str
) -> None:
    """An identity's dispatcher follows the registry without taking one of its consumer
    slots (the registry's changes are republished), and a handler declared after it
    started is routed."""
    key = _public_key()
    nc = await _as(nats_url, key)
    admin = await nats.connect(nats_url)
    try:
        async with HookDispatcher(nc) as d:
            info = await nc.jetstream().consumers_info("KV_hookbus_handlers")
            assert not [i.name for i in info if i.name.startswith(key)]
            decl = HandlerDeclaration(event=event, name="late")
            kv = await admin.jetstream().key_value("hookbus_handlers")
            await kv.put(handler_key(event, "late"), encode(decl))
            try:
                for _ in range(100):
                    if "late" in d.list_handlers().get(event, []):
                        break
                    await asyncio.sleep(0.05)
                assert "late" in d.list_handlers().get(event, [])
            finally:
                await kv.delete(handler_key(event, "late"))
        info = await admin.jetstream().consumers_info("KV_hookbus_handlers")
        assert not [i.name for i in info if i.name.startswith(key)]  # all released
    finally:
        await nc.close()
        await admin.close()


# -- the refusal past the slots (a server of its own, with permissions) -------------------


@pytest.fixture(scope="module")
def slots_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """A server whose user ``a`` may create consumers on ``KV_tb`` under its 8 slot names
    only: (url, public key, bucket)."""
    key = _public_key()
    folder = tmp_path_factory.mktemp("slots")
    names = ", ".join(f'"$JS.API.CONSUMER.CREATE.KV_tb.{slot}.>"' for slot in slot_names(key))
    (folder / "server.conf").write_text(
        f"""
listen: "127.0.0.1:-1"
jetstream {{ store_dir: "{folder / "js"}" }}
authorization {{
  users = [
    {{ user: admin, password: admin }}
    {{ user: a, password: a, permissions: {{
        publish: {{ allow: ["$JS.API.INFO", "$JS.API.STREAM.INFO.KV_tb", "$KV.tb.>",
                            "$JS.API.DIRECT.GET.KV_tb.>", "$JS.API.CONSUMER.INFO.KV_tb.*",
                            "$JS.API.CONSUMER.DELETE.KV_tb.*", {names}] }}
        subscribe: {{ allow: ["_INBOX_{key}.>"] }}
    }} }}
  ]
}}
"""
    )
    server = EmbeddedNatsServer(folder / "data", config=folder / "server.conf", port=-1)
    server.start()
    try:
        yield server.url, key, "tb"
    finally:
        server.stop()


async def test_all_slots_taken_is_refused_in_one_line(slots_only: tuple[str, str, str]) -> None:
    url, key, bucket = slots_only
    host = url.removeprefix("nats://")
    admin = await nats.connect(f"nats://admin:admin@{host}")
    nc = await nats.connect(f"nats://a:a@{host}", inbox_prefix=f"_INBOX_{key}")
    watches: list[Any] = []
    try:
        await admin.jetstream().create_key_value(KeyValueConfig(bucket=bucket))
        kv = await nc.jetstream(timeout=1.0).key_value(bucket)
        await kv.put("k", b"v")
        for _ in range(CONSUMER_SLOTS):
            watches.append(await watch_keys(kv))
        assert [w._sub.name for w in watches] == list(slot_names(key))
        with pytest.raises(ConsumerSlotsExhaustedError) as caught:
            await watch_keys(kv)
        text = str(caught.value)
        assert "all 8 consumer slots of this identity are in use" in text
        assert "\n" not in text
        await watches.pop().stop()  # one freed: a watch works again, in that slot
        again = await watch_keys(kv)
        assert again._sub.name == slot_names(key)[-1]
        entry = await again.updates(timeout=5)
        assert entry is not None and entry.value == b"v"
        watches.append(again)
    finally:
        for w in watches:
            with contextlib.suppress(Exception):
                await w.stop()
        with contextlib.suppress(Exception):
            await admin.jetstream().delete_key_value(bucket)
        await nc.close()
        await admin.close()
