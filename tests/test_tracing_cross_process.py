"""One trace across processes: an agent (this test), a dispatcher service and two workers.

``hookbus dispatcher`` and two ``hookbus worker file.py:worker`` run as separate processes
with ``--otlp-endpoint`` pointing at an OTLP/HTTP receiver this test runs (`OtlpReceiver`).
The test is the agent: it sends the emit request with its own ``traceparent`` and checks
that every process's spans land in that one trace, with the right parent/child tree, kinds,
links and attributes: a deny, a modify chain, a failure under each policy, an approval;
and that an agent whose context is not sampled leaves no span in any process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from _allowing import emitted_allowed
from _otlp_receiver import OtlpReceiver, ReceivedSpan
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanContext, SpanKind

from hookbus.dispatcher import ApprovalsClient
from hookbus.schemas import (
    EmitReply,
    EmitRequest,
    decode,
    emit_service_subject,
    encode,
    handler_subject,
)
from hookbus.schemas import telemetry as tn

pytestmark = pytest.mark.anyio

WORKER_HEAD = """
import os
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

P = os.environ["HOOKBUS_TEST_PREFIX"]
worker = HookWorker()
"""

WORKER_A = (
    WORKER_HEAD
    + """
@worker.handler(f"{P}:deny", priority=1)
async def redact(event, data):
    return HookResult(action="modify", data={**data, "redacted": True})

@worker.handler(f"{P}:chain", priority=1)
async def first(event, data):
    return {"action": "modify", "data": {**data, "trail": [*data.get("trail", []), "a"]}}

@worker.handler(f"{P}:ignore", priority=1, failure_policy="ignore")
async def flaky(event, data):
    raise RuntimeError("database down")

@worker.handler(f"{P}:approval", priority=1)
async def ask(event, data):
    return HookResult(action="ask_user", approval_prompt="Run rm?", approval_timeout=30)

@worker.handler(f"{P}:quiet", priority=1)
async def hush(event, data):
    return None
"""
)

WORKER_B = (
    WORKER_HEAD
    + """
@worker.handler(f"{P}:deny", priority=2)
async def security(event, data):
    if data.get("tool_name") == "bash":
        return HookResult(action="deny", reason="no bash")
    return None

@worker.handler(f"{P}:chain", priority=2)
async def second(event, data):
    return {"action": "modify", "data": {**data, "trail": [*data["trail"], "b"]}}

@worker.handler(f"{P}:ignore", priority=2)
async def fine(event, data):
    return None

@worker.handler(f"{P}:closed", priority=1, failure_policy="deny")
async def broken(event, data):
    raise RuntimeError("policy engine crashed")

@worker.handler(f"{P}:quiet", priority=2)
async def hush_more(event, data):
    return HookResult(action="deny", reason="quiet")
"""
)


class Proc:
    """A ``hookbus`` subprocess whose stderr is read line by line (ready marker, diagnostics)."""

    def __init__(self, args: list[str], env: dict[str, str], ready: str) -> None:
        self.args = args
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._marker = ready
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "hookbus.cli", "--log-level", "info", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stderr is not None
        for line in self.popen.stderr:
            self.lines.append(line.rstrip())
            if self._marker in line:
                self.ready.set()
        self.ready.set()  # exited: wait_ready reports it

    def wait_ready(self, timeout_s: float = 30) -> None:
        if not self.ready.wait(timeout_s) or self.popen.poll() is not None:
            self.stop()
            raise RuntimeError(f"{self.args} did not start:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait(5)
        self._reader.join(5)
        assert self.popen.stderr is not None
        self.popen.stderr.close()
        return code


@dataclass
class Fleet:
    prefix: str
    receiver: OtlpReceiver
    worker_pids: dict[str, int]
    """Worker file stem ("worker_a", "worker_b") -> process id."""
    dispatcher_pid: int


@pytest.fixture(scope="module")
def fleet(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prefix = f"xproc{uuid.uuid4().hex[:8]}"
    folder = tmp_path_factory.mktemp("workers")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        HOOKBUS_TEST_PREFIX=prefix,
        OTEL_BSP_SCHEDULE_DELAY="50",  # ms: spans reach the receiver quickly
        OTEL_METRIC_EXPORT_INTERVAL="300",  # ms
    )
    with OtlpReceiver() as receiver:
        procs: list[Proc] = []
        try:
            pids = {}
            for stem, text in (("worker_a", WORKER_A), ("worker_b", WORKER_B)):
                path = folder / f"{stem}.py"
                path.write_text(text)
                proc = Proc(
                    ["worker", f"{path}:worker", "--url", nats_url,
                     "--otlp-endpoint", receiver.url],
                    env, ready="serving",
                )  # fmt: skip
                procs.append(proc)
                pids[stem] = proc.popen.pid
            for proc in procs:
                proc.wait_ready()  # subscribed and declared: the dispatcher will load them
            dispatcher = Proc(
                ["dispatcher", "--url", nats_url, "--otlp-endpoint", receiver.url],
                env, ready="dispatcher serving",
            )  # fmt: skip
            procs.append(dispatcher)
            dispatcher.wait_ready()
            yield Fleet(prefix, receiver, pids, dispatcher.popen.pid)
        finally:
            codes = {" ".join(proc.args[:2]): proc.stop() for proc in reversed(procs)}
        # SIGTERM drains and flushes: every process exits 0
        assert set(codes.values()) == {0}, codes


@pytest.fixture
def agent_tracer() -> trace.Tracer:
    """The agent's own tracer (a provider of its own: no global state)."""
    return TracerProvider().get_tracer("test-agent")


async def agent_emit(
    nc: Any, tracer: trace.Tracer, event: str, data: dict[str, Any]
) -> tuple[EmitReply, SpanContext]:
    """Emit through the dispatcher service as an agent does: a PRODUCER span, its
    ``traceparent`` in the NATS headers, one request."""
    subject = emit_service_subject(event)
    attrs = {
        tn.MESSAGING_SYSTEM: "nats",
        tn.MESSAGING_DESTINATION_NAME: subject,
        tn.MESSAGING_OPERATION_TYPE: "send",
    }
    name = f"send emit {event}"
    with tracer.start_as_current_span(name, kind=SpanKind.PRODUCER, attributes=attrs) as span:
        headers: dict[str, str] = {}
        propagate.inject(headers)
        body = encode(EmitRequest(data=data, agent_id="agent-1", session_id=f"sess-{event}"))
        msg = await nc.request(subject, body, timeout=20, headers=headers)
    return decode(msg.data, EmitReply), span.get_span_context()


async def trace_of(fleet: Fleet, agent: SpanContext, count: int) -> list[ReceivedSpan]:
    """Wait until `count` spans of the agent's trace have arrived from the processes."""
    trace_id = f"{agent.trace_id:032x}"

    def ready(spans: list[ReceivedSpan]) -> bool:
        return sum(s.trace_id == trace_id for s in spans) >= count

    spans = await anyio.to_thread.run_sync(fleet.receiver.wait_for, ready, 20.0)
    return sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_span_id == parent.span_id]


def check_service_spine(fleet: Fleet, spans: list[ReceivedSpan], agent: SpanContext,
                        event: str) -> ReceivedSpan:  # fmt: skip
    """agent send -> dispatcher process (CONSUMER, parented and linked) -> emit; returns emit."""
    subject = emit_service_subject(event)
    agent_span_id = f"{agent.span_id:016x}"
    (dispatch,) = [s for s in spans if s.name == f"process emit {event}"]
    assert dispatch.kind == "CONSUMER"
    assert dispatch.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert dispatch.parent_span_id == agent_span_id
    assert dispatch.links == [(dispatch.trace_id, agent_span_id)]
    assert dispatch.service == "hookbus-dispatcher"
    assert dispatch.resource["process.pid"] == fleet.dispatcher_pid
    assert dispatch.attributes[tn.MESSAGING_CONSUMER_GROUP_NAME] == "hookbus-dispatcher"
    assert dispatch.attributes[tn.EVENT] == event
    (emit,) = children(spans, dispatch)
    assert emit.name == f"emit {event}" and emit.kind == "INTERNAL"
    assert emit.service == "hookbus-dispatcher"
    assert emit.attributes[tn.GEN_AI_AGENT_ID] == "agent-1"
    assert emit.attributes[tn.GEN_AI_CONVERSATION_ID] == f"sess-{event}"
    return emit


def check_call(fleet: Fleet, spans: list[ReceivedSpan], send: ReceivedSpan, event: str,
               handler: str, worker: str) -> ReceivedSpan:  # fmt: skip
    """A handler call (PRODUCER, dispatcher) and its one handling (CONSUMER, `worker`)."""
    subject = handler_subject(event, handler)
    assert send.name == f"send {event} {handler}" and send.kind == "PRODUCER"
    assert send.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert send.service == "hookbus-dispatcher"
    assert send.attributes[tn.HANDLER] == handler
    (process,) = children(spans, send)
    assert process.name == f"process {event} {handler}" and process.kind == "CONSUMER"
    assert process.attributes[tn.MESSAGING_DESTINATION_NAME] == subject
    assert process.links == [(send.trace_id, send.span_id)]
    assert process.service == "hookbus-worker"
    assert process.resource["process.pid"] == fleet.worker_pids[worker]
    assert process.attributes[tn.MESSAGING_CONSUMER_GROUP_NAME] == handler
    assert process.attributes[tn.HANDLER] == handler
    assert process.attributes[tn.GEN_AI_AGENT_ID] == "agent-1"
    return process


async def test_deny_one_trace_across_agent_dispatcher_and_workers(fleet, nc, agent_tracer) -> None:
    event = f"{fleet.prefix}:deny"
    reply, agent = await agent_emit(nc, agent_tracer, event, {"tool_name": "bash"})
    assert reply.result is not None and reply.result.action == "deny"

    spans = await trace_of(fleet, agent, 6)
    assert len(spans) == 6  # the agent's own span stays in the agent
    emit = check_service_spine(fleet, spans, agent, event)
    assert emit.attributes[tn.ACTION] == "deny"
    assert emit.attributes[tn.DECIDED_BY] == "security"
    assert emit.attributes[tn.REASON] == "no bash"
    assert emit.attributes[tn.GEN_AI_TOOL_NAME] == "bash"
    redact, security = children(spans, emit)
    p1 = check_call(fleet, spans, redact, event, "redact", "worker_a")
    p2 = check_call(fleet, spans, security, event, "security", "worker_b")
    assert (redact.attributes[tn.ACTION], p1.attributes[tn.ACTION]) == ("modify", "modify")
    assert (security.attributes[tn.ACTION], p2.attributes[tn.ACTION]) == ("deny", "deny")
    assert security.attributes[tn.PRIORITY] == 2 and p2.attributes[tn.REASON] == "no bash"
    assert redact.end_ns <= security.start_ns  # in priority order, one after the other


async def test_modify_chain_across_two_workers(fleet, nc, agent_tracer) -> None:
    event = f"{fleet.prefix}:chain"
    reply, agent = await agent_emit(nc, agent_tracer, event, {"tool_name": "edit"})
    assert reply.result is not None and reply.result.action == "continue"
    assert reply.result.data is not None and reply.result.data["trail"] == ["a", "b"]

    spans = await trace_of(fleet, agent, 6)
    emit = check_service_spine(fleet, spans, agent, event)
    assert emit.attributes[tn.ACTION] == "continue"
    first, second = children(spans, emit)
    check_call(fleet, spans, first, event, "first", "worker_a")
    check_call(fleet, spans, second, event, "second", "worker_b")
    assert first.attributes[tn.ACTION] == second.attributes[tn.ACTION] == "modify"
    assert first.end_ns <= second.start_ns


async def test_failure_under_ignore_fails_open_in_the_trace(fleet, nc, agent_tracer) -> None:
    event = f"{fleet.prefix}:ignore"
    reply, agent = await agent_emit(nc, agent_tracer, event, {"tool_name": "bash"})
    assert reply.result is not None and reply.result.action == "continue"
    assert [f.handler for f in reply.result.failures] == ["flaky"]

    spans = await trace_of(fleet, agent, 6)
    emit = check_service_spine(fleet, spans, agent, event)
    assert emit.attributes[tn.FAILED_OPEN] is True
    assert emit.attributes[tn.FAILED_OPEN_HANDLERS] == ("flaky",)
    assert [(n, a[tn.HANDLER], a[tn.FAILURE_POLICY]) for n, a in emit.events] == [
        (tn.EVENT_HANDLER_FAILURE, "flaky", "ignore")
    ]
    flaky, fine = children(spans, emit)
    flaky_process = check_call(fleet, spans, flaky, event, "flaky", "worker_a")
    check_call(fleet, spans, fine, event, "fine", "worker_b")
    assert flaky.status == "ERROR"
    assert flaky.attributes[tn.FAILURE_KIND] == "error"
    assert flaky.attributes[tn.FAILURE_POLICY] == "ignore"
    assert flaky.attributes[tn.FAILED_OPEN] is True
    assert flaky_process.status == "ERROR"
    assert flaky_process.attributes[tn.ERROR_TYPE] == "handler_error"
    assert fine.attributes[tn.FAILED_OPEN] is False and fine.status == "UNSET"


async def test_failure_under_deny_fails_closed_in_the_trace(fleet, nc, agent_tracer) -> None:
    event = f"{fleet.prefix}:closed"
    reply, agent = await agent_emit(nc, agent_tracer, event, {"tool_name": "bash"})
    assert reply.result is not None and reply.result.action == "deny"
    assert reply.result.decided_by == "broken"

    spans = await trace_of(fleet, agent, 4)
    emit = check_service_spine(fleet, spans, agent, event)
    assert emit.attributes[tn.ACTION] == "deny"
    assert emit.attributes[tn.DECIDED_BY] == "broken"
    assert emit.attributes[tn.FAILED_OPEN] is False
    (broken,) = children(spans, emit)
    check_call(fleet, spans, broken, event, "broken", "worker_b")
    assert broken.status == "ERROR"
    assert broken.attributes[tn.FAILURE_KIND] == "error"
    assert broken.attributes[tn.FAILURE_POLICY] == "deny"
    assert broken.attributes[tn.FAILED_OPEN] is False


async def test_approval_wait_in_the_trace(fleet, nc, connect, agent_tracer) -> None:
    """ask_user in a worker -> the dispatcher service waits on an approval -> this test
    approves from another connection: the wait is an ``await approval`` span under the
    emit, with ``pending`` and ``resolved`` events."""
    event = f"{fleet.prefix}:approval"
    async with ApprovalsClient(await connect()) as approver:
        stream = await approver.events()
        emit = agent_emit(nc, agent_tracer, event, {"tool_name": "rm"})
        reply, agent = await emitted_allowed(emit, event, stream, approver)
    assert reply.result is not None and reply.result.action == "continue"

    spans = await trace_of(fleet, agent, 5)
    emit = check_service_spine(fleet, spans, agent, event)
    ask, wait = children(spans, emit)
    check_call(fleet, spans, ask, event, "ask", "worker_a")
    assert ask.attributes[tn.ACTION] == "ask_user"
    assert wait.name == "await approval" and wait.service == "hookbus-dispatcher"
    assert [name for name, _ in wait.events] == ["pending", "resolved"]
    assert wait.attributes[tn.SUSPENSION_OUTCOME] == "resolved"
    assert emit.attributes[tn.ACTION] == "continue"


async def test_metrics_are_exported_by_every_process(fleet, nc, agent_tracer) -> None:
    event = f"{fleet.prefix}:deny"
    reply, _ = await agent_emit(nc, agent_tracer, event, {"tool_name": "bash"})
    assert reply.result is not None and reply.result.action == "deny"

    def ready(points: list[Any]) -> bool:
        mine = [p for p in points if p.attributes.get(tn.EVENT) == event
                or p.attributes.get(tn.HANDLER) == "security"]  # fmt: skip
        names = {(p.resource.get("service.name"), p.name) for p in mine}
        return names >= {
            ("hookbus-dispatcher", tn.METRIC_DECISIONS),
            ("hookbus-dispatcher", tn.METRIC_EMIT_DURATION),
            ("hookbus-dispatcher", tn.METRIC_HANDLER_DURATION),
            ("hookbus-worker", tn.METRIC_PROCESS_DURATION),
        }

    points = await anyio.to_thread.run_sync(fleet.receiver.wait_for_metrics, ready, 20.0)
    denies = [p for p in points if p.name == tn.METRIC_DECISIONS
              and p.attributes == {tn.EVENT: event, tn.ACTION: "deny"}]  # fmt: skip
    assert denies and denies[-1].value >= 1  # cumulative


async def test_an_unsampled_agent_leaves_no_span_in_any_process(fleet, nc, agent_tracer) -> None:
    """The agent's ``traceparent`` says "not sampled": the dispatcher service and both
    workers (the SDK's default parent-based sampler) record nothing for that emit, and it
    is decided all the same."""
    quiet = f"{fleet.prefix}:quiet"
    unsampled = TracerProvider(sampler=ALWAYS_OFF).get_tracer("unsampled-agent")
    reply, agent = await agent_emit(nc, unsampled, quiet, {"tool_name": "bash"})
    assert reply.result is not None and reply.result.action == "deny"
    assert reply.result.decided_by == "hush_more"
    assert not agent.trace_flags.sampled and agent.is_valid

    # a sampled emit afterwards, through the same processes: once its spans are in, any
    # span of the unsampled one would be too (each process exports its spans in order)
    event = f"{fleet.prefix}:chain"
    _, sampled = await agent_emit(nc, agent_tracer, event, {"tool_name": "edit"})
    await trace_of(fleet, sampled, 6)
    quiet_trace = f"{agent.trace_id:032x}"
    leaked = [
        s for s in fleet.receiver.spans
        if s.trace_id == quiet_trace or s.attributes.get(tn.EVENT) == quiet
        or s.attributes.get(tn.HANDLER) in ("hush", "hush_more")
    ]  # fmt: skip
    assert leaked == []
