import pytest

from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio


async def test_remote_deny(nc, connect, event):
    w = HookWorker(nc)

    @w.handler(event)
    async def deny(ev, data):
        return HookResult(action="deny", reason="no")

    async with w, HookDispatcher(await connect()) as d:
        r = await d.emit(event, {"a": 1})
    assert r.action == "deny" and r.decided_by == "deny" and r.chained_data["a"] == 1
