"""Per-agent bounds of the dispatcher service: an agent over its requests in flight is
answered ``busy``, over its rate ``quota``, both at once and naming the agent and the
limit, without running a handler; another agent's emits keep being answered meanwhile."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from hookbus.dispatcher import DispatcherService, HookDispatcher
from hookbus.schemas import WIRE_ERROR_CODES, EmitReply, HookResult, decode, emit_service_subject

pytestmark = pytest.mark.anyio


async def _emit(
    nc: Any, event: str, agent: str | None, data: dict[str, Any], timeout_s: float | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"data": data}
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    msg = await nc.request(
        emit_service_subject(event, agent), json.dumps(body).encode(), timeout=10
    )
    decode(msg.data, EmitReply)  # the documented wire type
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


def _code(reply: dict[str, Any]) -> str:
    return str(reply["error"]["code"]) if "error" in reply else "ok"


@pytest.fixture
async def held(connect: Any, event: str) -> Any:
    """A service whose handler holds every emit with ``{"hold": true}`` until `gate` opens:
    (service, dispatcher connection, gate, how many handler calls ran)."""
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    gate = asyncio.Event()
    calls: list[str] = []

    async def handler(ev: str, data: dict[str, Any]) -> HookResult:
        calls.append(str(data.get("agent_id")))
        if data.get("hold"):
            await gate.wait()
        return HookResult(action="continue")

    d.register(event, handler, name="h")
    return d, snc, gate, calls


async def test_an_agent_over_its_in_flight_limit_is_refused_busy_while_another_is_served(
    connect: Any, event: str, held: Any
) -> None:
    d, snc, gate, calls = held
    service = DispatcherService(d, snc, max_concurrency=50, agent_max_in_flight=3)
    await service.start()
    flooder, other = await connect(), await connect()
    try:
        holding = [
            asyncio.create_task(_emit(flooder, event, "flooder", {"hold": True})) for _ in range(3)
        ]
        for _ in range(200):  # the three are being served
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        refused = await asyncio.gather(
            *(_emit(flooder, event, "flooder", {"hold": True}) for _ in range(20))
        )  # answered while the three still hold (the gate is closed)
        served = [await _emit(other, event, "other", {}) for _ in range(10)]
        assert [_code(r) for r in refused] == ["busy"] * 20
        error = refused[0]["error"]
        assert error["retryable"] is True
        assert "'flooder'" in error["message"] and "agent_max_in_flight=3" in error["message"]
        assert [_code(r) for r in served] == ["ok"] * 10
        assert calls.count("flooder") == 3  # a refused request never ran a handler
        gate.set()
        assert [_code(r) for r in await asyncio.gather(*holding)] == ["ok"] * 3
        again = await _emit(flooder, event, "flooder", {})  # room again once answered
        assert _code(again) == "ok"
    finally:
        gate.set()
        await service.stop()


async def test_an_agent_over_its_rate_is_refused_quota_while_another_is_served(
    connect: Any, event: str, held: Any
) -> None:
    d, snc, gate, calls = held
    gate.set()
    service = DispatcherService(
        d, snc, agent_max_in_flight=None, agent_rate_per_s=0.1, agent_burst=5
    )
    await service.start()
    flooder, other = await connect(), await connect()
    try:
        # the refusals come after their hold: 0.1 s each here (half the asked timeout_s)
        replies = [await _emit(flooder, event, "flooder", {}, timeout_s=0.2) for _ in range(12)]
        codes = [_code(r) for r in replies]
        # the burst passes; past it, at 0.1/s, at most one more token comes meanwhile
        assert codes[:5] == ["ok"] * 5 and codes.count("quota") >= 6, codes
        quota = next(r["error"] for r in replies if _code(r) == "quota")
        assert quota["retryable"] is True
        assert "'flooder'" in quota["message"] and "agent_rate_per_s=0.1" in quota["message"]
        assert calls.count("flooder") == codes.count("ok")
        others = [_code(await _emit(other, event, "other", {})) for _ in range(5)]
        assert others == ["ok"] * 5  # its own bucket, untouched by the flooder
        # the no-agent subject (open servers only) names no one to bound
        anonymous = [_code(await _emit(other, event, None, {})) for _ in range(8)]
        assert anonymous == ["ok"] * 8
    finally:
        await service.stop()


async def test_a_flood_does_not_stop_another_agents_emits(
    connect: Any, event: str, held: Any
) -> None:
    """An agent sending far past both bounds at once: every request of its answered at
    once (served, busy or quota), and another agent's emits meanwhile all answered."""
    d, snc, gate, _ = held
    service = DispatcherService(
        d, snc, max_concurrency=64, agent_max_in_flight=8, agent_rate_per_s=50, agent_burst=20
    )
    await service.start()
    flooder, other = await connect(), await connect()
    try:
        flood = asyncio.gather(
            *(_emit(flooder, event, "flooder", {"hold": True}) for _ in range(300))
        )
        served = [await _emit(other, event, "other", {}) for _ in range(20)]
        gate.set()
        codes = [_code(r) for r in await flood]
        assert [_code(r) for r in served] == ["ok"] * 20
        assert set(codes) <= {"ok", "busy", "quota"}, set(codes)
        assert "busy" in codes and codes.count("ok") <= 20  # at most its burst was served
    finally:
        gate.set()
        await service.stop()


async def test_the_bounds_are_validated_and_advertised(connect: Any, event: str) -> None:
    snc = await connect()
    d = HookDispatcher(snc, strict_events=True)
    for bad in ({"agent_max_in_flight": 0}, {"agent_rate_per_s": 0}, {"agent_burst": 0},
                {"agent_rate_per_s": float("nan")}):  # fmt: skip
        with pytest.raises(ValueError):
            DispatcherService(d, snc, **bad)
    assert "quota" in WIRE_ERROR_CODES and "busy" in WIRE_ERROR_CODES
    service = DispatcherService(d, snc)
    quotas = service._quotas
    assert (quotas.max_in_flight, quotas.rate_per_s, quotas.burst) == (64, 200.0, 400)


async def test_a_refusal_over_the_agents_bounds_is_held_within_the_requests_time(
    connect: Any, event: str, held: Any
) -> None:
    """A client that sends again as soon as it is refused slows to its bounds: its
    ``quota`` comes after a pause (1 s; half its timeout_s when that is shorter), never
    after the caller gave up; a stopping replica sends the held ones at once."""
    d, snc, gate, _ = held
    gate.set()
    service = DispatcherService(d, snc, agent_max_in_flight=None, agent_rate_per_s=0.1,
                                agent_burst=1)  # fmt: skip
    await service.start()
    nc = await connect()
    try:
        assert _code(await _emit(nc, event, "a", {})) == "ok"
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert _code(await _emit(nc, event, "a", {})) == "quota"
        assert loop.time() - started >= 0.45  # held: AGENT_REFUSAL_HOLD_S["quota"], spread
        started = loop.time()
        assert _code(await _emit(nc, event, "a", {}, timeout_s=0.4)) == "quota"
        assert 0.05 <= loop.time() - started < 0.9  # at most half its own timeout
        pending = asyncio.ensure_future(_emit(nc, event, "a", {}))
        async with asyncio.timeout(5):
            # until its refusal is held, waiting for its time (private state: no event)
            while not service._held:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        started = loop.time()
        await service.stop()
        assert _code(await pending) == "quota" and loop.time() - started < 0.8
    finally:
        await service.stop()


async def test_a_deeply_nested_request_over_the_rate_is_answered_quota(
    connect: Any, event: str, held: Any
) -> None:
    """The refusal path reads only the request's ``timeout_s``: a body nested past any
    decoder's depth is still answered (``quota``), never left without a reply."""
    d, snc, gate, _calls = held
    gate.set()
    service = DispatcherService(
        d, snc, agent_max_in_flight=None, agent_rate_per_s=0.1, agent_burst=1
    )
    await service.start()
    agent = await connect()
    deep = b'{"timeout_s": 0.2, "data": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    try:
        await _emit(agent, event, "deep", {})  # the burst
        for _ in range(5):
            msg = await agent.request(emit_service_subject(event, "deep"), deep, timeout=10)
            assert _code(json.loads(msg.data)) == "quota"
    finally:
        await service.stop()
