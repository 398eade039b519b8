"""Operations under faults: a draining dispatcher with approvals in flight, SIGTERM on the
`hookbus dispatcher` process, buckets that exist with another config, KV calls through a
paused server. Each test starts its own nats-server (the `embedded_server` fixture)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import uuid
from typing import Any

import anyio
import nats
import nats.js.errors
import pytest
from _procs import thread_states

from hookbus._core.buckets import suspensions_bucket_config
from hookbus._core.nats_guard import order_flushes
from hookbus.cli import EmbeddedNatsServer
from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.schemas import (
    SUSPENSION_EVENTS_WILDCARD,
    EmitReply,
    HookbusTimeoutError,
    HookEvent,
    HookResult,
    decode,
    encode_token,
)
from hookbus.workers import HookWorker

pytestmark = [pytest.mark.anyio, pytest.mark.faults]

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]


def _emit_subject(event: str) -> str:
    return "hookbus.v1.emit.=." + encode_token(event)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "HOOKBUS_TEST_NATS_URL")}
    return {**env, "COLUMNS": "200"}


async def _pending_approvals(nc: Any) -> asyncio.Queue[str]:
    """Labels of approvals that become pending, as their events are published."""
    queue: asyncio.Queue[str] = asyncio.Queue()

    async def on_event(msg: Any) -> None:
        part = decode(msg.data, HookEvent).hook
        if part.status == "pending" and part.label.startswith("approval:"):
            queue.put_nowait(part.label)

    await nc.subscribe(SUSPENSION_EVENTS_WILDCARD, cb=on_event)
    await nc.flush()
    return queue


async def test_drain_aborts_an_approval_wait_and_a_retry_resumes_it(embedded_server, event, caplog):
    """An approval wait in flight when the service stops: the agent gets a retryable
    `unavailable` within the grace, the approval stays pending, and the agent's retry
    with the same idempotency key on a new service finds that approval (no second
    prompt) and gets the human's answer."""
    url = embedded_server.url
    conns = [await nats.connect(url) for _ in range(4)]
    for conn in conns:
        order_flushes(conn)  # a flush below means "it is on the server"
    wnc, snc, agent, approver = conns
    try:
        w = HookWorker(wnc)

        @w.handler(event, failure_policy="deny")
        async def ask(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="ask_user", approval_prompt="run it?", approval_timeout=60)

        pending = await _pending_approvals(approver)
        body = json.dumps(
            {"data": {"tool_name": "bash"}, "session_id": "s1", "idempotency_key": "call-1"}
        ).encode()
        async with w:
            service = DispatcherService(HookDispatcher(snc, strict_events=True), snc)
            await service.start()
            first = asyncio.create_task(agent.request(_emit_subject(event), body, timeout=30))
            asked = asyncio.create_task(pending.get())
            done, _ = await asyncio.wait({first, asked}, timeout=40, return_when="FIRST_COMPLETED")
            if asked not in done:  # say what the emit did instead of asking
                asked.cancel()
                got = decode((await first).data, EmitReply) if first in done else "no reply yet"
                pytest.fail(f"no approval was asked within 40 s; the emit answered: {got}")
            label = asked.result()
            with (
                anyio.fail_after(10),  # the grace, then the abort: well within this
                caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"),
            ):
                await service.stop(grace_s=0.3)
            assert any("1 durable wait(s) aborted" in r.getMessage() for r in caplog.records)
            reply = decode((await first).data, EmitReply)
            assert reply.error is not None, reply
            assert (reply.error.code, reply.error.retryable) == ("unavailable", True)

            other = await nats.connect(url)
            order_flushes(other)
            conns.append(other)
            d2 = HookDispatcher(other, strict_events=True)
            service2 = DispatcherService(d2, other)
            await service2.start()
            approvals = ApprovalsClient.over(d2.approvals)  # the new service's own
            got = await approvals.get_approval(label)
            assert got is not None and got[0].status == "pending"  # left pending by the abort
            retry = asyncio.create_task(agent.request(_emit_subject(event), body, timeout=30))
            await agent.flush()
            # the retry attaches to the same approval: answer it and the retry returns
            with anyio.fail_after(20):
                while True:
                    got = await approvals.get_approval(label)
                    if got is not None and got[0].attached:
                        break
                    await asyncio.sleep(0.05)  # no event marks "re-attached"
            await approvals.answer_approval(label, "Allow", approver="tester", agent_id=None)
            answer = decode((await retry).data, EmitReply)
            await service2.stop()
        assert pending.empty(), "the retry asked again instead of finding its approval"
        assert answer.result is not None, answer
        assert answer.result.action == "continue"
    finally:
        for c in conns:
            await c.close()


async def test_sigterm_drains_the_dispatcher_within_the_grace(embedded_server, event):
    """`hookbus dispatcher --grace-period 1`: on SIGTERM a request stuck in a handler is
    answered `unavailable` (retryable) within the grace and the process exits 0."""
    url = embedded_server.url
    wnc, agent = await nats.connect(url), await nats.connect(url)
    release = asyncio.Event()
    started = asyncio.Event()
    w = HookWorker(wnc)

    @w.handler(event, timeout_s=60)
    async def stuck(ev: str, data: dict[str, Any]) -> HookResult:
        started.set()
        await release.wait()
        return HookResult()

    proc = None
    try:
        async with w:
            proc = await asyncio.create_subprocess_exec(
                *HOOKBUS, "dispatcher", "--url", url, "--grace-period", "1",
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=_env(),
            )  # fmt: skip
            assert proc.stderr is not None
            seen = []
            with anyio.fail_after(30):
                while b"dispatcher serving" not in (line := await proc.stderr.readline()):
                    seen.append(line)
                    assert line, b"".join(seen).decode()  # exited before serving
            request = asyncio.create_task(
                agent.request(_emit_subject(event), b'{"data": {}}', timeout=30)
            )
            with anyio.fail_after(10):
                await started.wait()
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(10):  # grace 1 s, then the answer and the exit
                reply = decode((await request).data, EmitReply)
                code = await proc.wait()
            release.set()
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await wnc.close()
        await agent.close()
    assert reply.error is not None and reply.error.code == "unavailable", reply
    assert reply.error.retryable is True
    assert code == 0


async def test_a_bucket_with_another_config_is_reported(embedded_server, caplog):
    """An existing suspensions bucket with another TTL is used, with a warning naming the
    difference; with strict_buckets the dispatcher refuses to start."""
    nc = await nats.connect(embedded_server.url)
    try:
        await nc.jetstream().create_key_value(config=suspensions_bucket_config(ttl_s=3600))
        with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"):
            async with HookDispatcher(nc, suspension_ttl_s=7200):
                pass
        warned = [r.getMessage() for r in caplog.records if "hookbus_suspensions" in r.getMessage()]
        assert any("ttl: asked 7200 s, bucket has 3600 s" in m for m in warned), warned
        from hookbus.schemas import BucketConfigError  # new: absent from old trees

        with pytest.raises(BucketConfigError, match="ttl: asked 7200 s, bucket has 3600 s"):
            await HookDispatcher(nc, suspension_ttl_s=7200, strict_buckets=True).start()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hookbus.dispatcher"):
            async with HookDispatcher(nc, suspension_ttl_s=3600, strict_buckets=True):
                pass  # as asked: nothing to report
        assert not [r for r in caplog.records if "another config" in r.getMessage()]
    finally:
        await nc.close()


async def test_dispatcher_command_reports_and_refuses_a_bucket_that_differs(embedded_server):
    nc = await nats.connect(embedded_server.url)
    try:
        await nc.jetstream().create_key_value(config=suspensions_bucket_config())  # 7 days
    finally:
        await nc.close()
    text = await _dispatcher_refuses(
        "--url", embedded_server.url, "--suspension-ttl", "1h", "--strict-buckets", env=_env()
    )
    assert "ttl: asked 3600 s, bucket has 604800 s" in text


async def test_bucket_replicas_reach_jetstream(embedded_server):
    """HOOKBUS_BUCKET_REPLICAS=3 is what the dispatcher asks JetStream for (a single
    server refuses R3: a clean error, not a traceback, nor a silent R1)."""
    replicas = {**_env(), "HOOKBUS_BUCKET_REPLICAS": "3"}
    text = await _dispatcher_refuses("--url", embedded_server.url, env=replicas)
    assert "replicas > 1 not supported in non-clustered mode" in text


async def _dispatcher_refuses(*args: str, env: dict[str, str]) -> str:
    """What ``hookbus dispatcher ARGS`` writes to stderr; it must exit with 1 within 30 s,
    without a traceback."""
    proc = await asyncio.create_subprocess_exec(
        *HOOKBUS, "dispatcher", *args,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    with anyio.fail_after(30):
        _, err = await proc.communicate()
    text = err.decode()
    assert proc.returncode == 1, text
    assert "Traceback" not in text
    return text


async def _until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until every thread of `pid` is stopped (a SIGSTOP takes effect per thread, as
    each one next leaves the kernel)."""
    with anyio.fail_after(timeout_s):
        while set(thread_states(pid)) != {"T"}:  # noqa: ASYNC110 - polls /proc: no event
            await asyncio.sleep(0.01)


async def test_kv_retry_rides_out_a_paused_server():
    """A KV read while the server is paused (SIGSTOP, as during a leader election or a
    long GC) succeeds once it is back, within the deadline; past the deadline it fails
    with a hookbus timeout, not a raw nats-py error."""
    from hookbus._core.kv import kv_retry, open_bucket  # new: absent from old trees

    with EmbeddedNatsServer() as server:
        nc = await nats.connect(server.url, max_reconnect_attempts=-1)
        try:
            kv = await open_bucket(nc, suspensions_bucket_config())
            key = f"k{uuid.uuid4().hex}"
            await kv.put(key, b"v")
            pid = server._proc.pid  # type: ignore[union-attr]  # the test pauses the process
            os.kill(pid, signal.SIGSTOP)
            try:
                await _until_stopped(pid)
                with pytest.raises(HookbusTimeoutError) as info:
                    await kv_retry(lambda: kv.get(key), deadline_s=1.0, what="read")
                assert isinstance(info.value, TimeoutError)
                loop = asyncio.get_running_loop()
                loop.call_later(2.0, os.kill, pid, signal.SIGCONT)  # the pause lasts ~2 s
                entry = await kv_retry(lambda: kv.get(key), deadline_s=15.0, what="read")
            finally:
                os.kill(pid, signal.SIGCONT)
            assert entry.value == b"v"
            with pytest.raises(nats.js.errors.KeyNotFoundError):  # not retried: not transient
                await kv_retry(lambda: kv.get(key + "-none"), deadline_s=5.0)
        finally:
            await nc.close()
