"""`EventEnvelope.id` is the emit's own id, fresh for every emit; the agent's idempotency key
travels in `EventEnvelope.idempotency_key`; approvals keep deriving their label from the
key when one is given (a retry finds its approval again), else from the emit's id."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from _serving import serving
from nats.aio.client import Client as NATS

from hookbus.dispatcher import HookDispatcher
from hookbus.dispatcher._call_router import EmitContext
from hookbus.schemas import HookResult, handler_subject

pytestmark = pytest.mark.anyio


def test_the_emit_id_is_fresh_and_the_key_is_its_own_field() -> None:
    keyed = EmitContext("tool:pre", {"agent_id": "a"}, call_id="call-1")
    again = EmitContext("tool:pre", {"agent_id": "b"}, call_id="call-1")
    assert len(keyed.id) == 32 and keyed.id != again.id and keyed.id != "call-1"
    assert keyed.call_id == again.call_id == "call-1"  # the approvals' call id: the key
    env = keyed.envelope({})
    assert (env.id, env.idempotency_key) == (keyed.id, "call-1")
    plain = EmitContext("tool:pre", {})
    assert plain.call_id == plain.id and plain.envelope({}).idempotency_key is None


async def test_two_agents_with_one_key_send_two_ids(nc: NATS, connect: Any, event: str) -> None:
    seen: list[dict[str, Any]] = []

    async def spy(msg: Any) -> None:
        seen.append(json.loads(msg.data))

    async def allow(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="continue")

    await nc.subscribe(handler_subject(event, "guard"), cb=spy)  # no queue group: hears all
    async with (
        serving(await connect(), (event, allow, {"name": "guard"})),
        HookDispatcher(await connect(), agent_id="a1") as a1,
        HookDispatcher(await connect(), agent_id="a2") as a2,
    ):
        with anyio.fail_after(10):
            while not all(d.list_handlers(event)[event] == ["guard"] for d in (a1, a2)):  # noqa: ASYNC110
                await anyio.sleep(0.01)
        for d in (a1, a2, a1):
            assert (await d.emit(event, {}, idempotency_key="same-key")).action == "continue"
        await nc.flush()
        with anyio.fail_after(10):
            while len(seen) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    assert [e["idempotency_key"] for e in seen] == ["same-key"] * 3
    assert [e["agent_id"] for e in seen] == ["a1", "a2", "a1"]
    assert len({e["id"] for e in seen}) == 3  # one id per emit, even a retry of one call
