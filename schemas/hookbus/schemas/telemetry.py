"""Names of every OpenTelemetry span, attribute, event and instrument hookbus records.

Public: dashboards, alerts and tests query by these (``from hookbus.schemas import
telemetry``); a rename is a breaking change, written in the changelog.

Strings only, and `chain_destination` composing one (no OpenTelemetry import): the
dispatcher and the workers trace with these, tests and dashboards query by them. Messaging
names follow the OpenTelemetry messaging semantic conventions (span name ``{operation}
{destination}``; ``messaging.system`` has no registered value for NATS, so it is the plain
string ``"nats"``). GenAI names are plain
strings on purpose: the GenAI constants of ``opentelemetry-semantic-conventions`` are
deprecated and warn when imported.

The span tree of one tool call (service mode; an embedded `HookDispatcher` starts at
``emit``)::

    send emit <event>                         PRODUCER  agent (its own span, named so)
      process emit <event>                    CONSUMER  dispatcher service (queue group)
        emit <event>                          INTERNAL  HookDispatcher.emit: the decision
          send <event> <handler>              PRODUCER  one per remote handler call
            process <event> <handler>         CONSUMER  the worker replica that handled it
          send <event> <h1>,<h2>,<h3>         PRODUCER  one chain request (several handlers)
            process <event> <h1>,<h2>,<h3>    CONSUMER  the worker process that ran it
          handler <h>                         INTERNAL  one per in-process handler call
          await approval                      INTERNAL  an ask_user suspension wait
    emit_and_collect <event>                  INTERNAL
      send <event> collect                    PRODUCER  the one message every handler hears
        process <event> <handler>             CONSUMER  one per worker handling
    process emit_and_collect <event>          CONSUMER  dispatcher service: emit_and_collect

One ``send`` span per message that went over the wire; the whole subject is in
``messaging.destination.name``, and span names hold only low-cardinality parts of it (the
event and handler names, never the agent: the service's span has the subject's agent as
``gen_ai.agent.id``). A chain's span names list its handlers in order, at most
`CHAIN_NAMES_SHOWN` of them, then how many more (``send tool:pre a,b,c +2 more``, see
`chain_destination`); all of them are in ``hookbus.chain.handlers``. Each CONSUMER span is
parented to, and linked with, the context in the W3C ``traceparent`` header of the NATS
message it processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

# -- instrumentation scopes ---------------------------------------------------------------
SCOPE_DISPATCHER: Final = "hookbus.dispatcher"
SCOPE_WORKERS: Final = "hookbus.workers"

# -- span names (prefixes; the subject or event follows) ----------------------------------
SPAN_EMIT: Final = "emit"
"""``emit <event>``: one `HookDispatcher.emit` (INTERNAL)."""
SPAN_EMIT_AND_COLLECT: Final = "emit_and_collect"
"""``emit_and_collect <event>`` (INTERNAL)."""
SPAN_SEND: Final = "send"
"""``send <event> <handler>`` / ``send <event> <h1>,<h2>`` (a chain) / ``send <event>
collect``: a message to workers; ``send emit <event>``: an agent's service request
(PRODUCER, the agent's own span)."""
SPAN_PROCESS: Final = "process"
"""``process <event> <handler>`` / ``process <event> <h1>,<h2>`` (a chain): a worker
handling; ``process emit <event>`` / ``process emit_and_collect <event>``: the dispatcher
service serving (CONSUMER; the subject, with its agent token, is
``messaging.destination.name``)."""
SPAN_HANDLER: Final = "handler"
"""``handler <name>``: an in-process handler call (INTERNAL)."""
SPAN_AWAIT: Final = "await"
"""``await <kind>``: a suspension wait, e.g. ``await approval`` (INTERNAL)."""

# -- messaging semantic conventions -------------------------------------------------------
MESSAGING_SYSTEM: Final = "messaging.system"
MESSAGING_SYSTEM_NATS: Final = "nats"
MESSAGING_DESTINATION_NAME: Final = "messaging.destination.name"
MESSAGING_OPERATION_TYPE: Final = "messaging.operation.type"
MESSAGING_CONSUMER_GROUP_NAME: Final = "messaging.consumer.group.name"
MESSAGING_MESSAGE_ID: Final = "messaging.message.id"
"""The emit's id (`EventEnvelope.id`), shared by every handler call of one emit."""
OPERATION_SEND: Final = "send"
OPERATION_PROCESS: Final = "process"
ERROR_TYPE: Final = "error.type"
"""General semconv attribute: the failure kind or error code when an operation failed."""

# -- hookbus -------------------------------------------------------------------------------
EVENT: Final = "hookbus.event"
HANDLER: Final = "hookbus.handler"
PRIORITY: Final = "hookbus.priority"
ACTION: Final = "hookbus.action"
"""A handler's action (handler spans) or the folded decision (emit spans)."""
REASON: Final = "hookbus.reason"
DECIDED_BY: Final = "hookbus.decided_by"
APPROVED_BY: Final = "hookbus.approved_by"
"""The approver whose answer decided an approval (as its NATS permissions prove it)."""
FAILURE_KIND: Final = "hookbus.failure.kind"
"""``timeout`` | ``no_responders`` | ``error`` | ``bad_reply``."""
FAILURE_POLICY: Final = "hookbus.failure.policy"
"""``ignore`` | ``deny``: on every handler call span (``send <event> <handler>``,
``handler <name>``), the handler's policy, what a failure of it does (applied when
``hookbus.failure.kind`` is set too); on a ``hookbus.handler.failure`` event, the policy
applied."""
FAILED_OPEN: Final = "hookbus.failed_open"
"""True when a failure was ignored (fail open); on emit spans: any handler failed open."""
FAILURE_COUNT: Final = "hookbus.failure.count"
FAILED_OPEN_HANDLERS: Final = "hookbus.failed_open.handlers"
PARALLEL: Final = "hookbus.parallel"
RESPONSE_COUNT: Final = "hookbus.response.count"
"""emit_and_collect: how many responses were collected."""
DROPPED: Final = "hookbus.dropped"
"""Worker: the request's deadline had passed before it started; no answer was sent."""
SUSPENSION_LABEL: Final = "hookbus.suspension.label"
SUSPENSION_KIND: Final = "hookbus.suspension.kind"
"""``suspension`` | ``approval``."""
SUSPENSION_OUTCOME: Final = "hookbus.suspension.outcome"
REQUESTS: Final = "hookbus.requests"
"""On a handler call's ``send`` span: the requests the call sent (more than 1: it was hedged
to another replica, or sent again after a replica refused it)."""
WORKER_INSTANCE: Final = "hookbus.worker.instance"
"""On a ``send`` span (a handler call or a chain): the worker instance whose reply was used
(the services API id of that process; absent when no reply came)."""

# -- one message, several handlers: chains and emit_and_collect ----------------------------
CHAIN_NAMES_SHOWN: Final = 3
"""The most handler names a chain's span name lists (`chain_destination`)."""


def chain_destination(handlers: Sequence[str]) -> str:
    """The destination in a chain's span names (``send <event> <destination>``, ``process
    <event> <destination>``): its handlers in order, comma-separated, at most
    `CHAIN_NAMES_SHOWN`, then how many more: ``guard,audit`` or ``a,b,c +2 more``; ``?``
    for none known. Bounded: a span name stays short however long the chain."""
    if not handlers:
        return "?"
    shown = ",".join(handlers[:CHAIN_NAMES_SHOWN])
    more = len(handlers) - CHAIN_NAMES_SHOWN
    return f"{shown} +{more} more" if more > 0 else shown


COLLECT_DESTINATION: Final = "collect"
"""The destination in an ``emit_and_collect``'s span name: ``send <event> collect``."""
CHAIN_HANDLERS: Final = "hookbus.chain.handlers"
"""On a chain's ``send`` span: the handlers its one message asked to run, in order; on its
``process`` span (worker): the handlers of the steps run, in the order they ended."""
CHAIN_FAILURE_POLICIES: Final = "hookbus.chain.failure_policies"
"""On a chain's ``send`` span: per handler asked (`CHAIN_HANDLERS`), its failure policy
(``ignore`` | ``deny``, as `FAILURE_POLICY` on a call span)."""
CHAIN_OUTCOMES: Final = "hookbus.chain.outcomes"
"""On a chain's ``send`` span: per step the dispatcher folded from the chain's answer, in
order, its action or (a failure) its failure kind; steps the chain did not run (called
alone afterwards, each with a ``send`` span of its own) are not listed. On its ``process``
span: per step run, its action, its error code, or ``dropped``."""
CHAIN_DURATIONS: Final = "hookbus.chain.durations_s"
"""On a chain's ``process`` span: per step run, the handler's own time, seconds."""
CHAIN_REASONS: Final = "hookbus.chain.reasons"
"""On a chain's ``process`` span: per step run, its reason ("" for none); only when a step
gave one."""
COLLECT_ASKED: Final = "hookbus.collect.asked"
"""On an ``emit_and_collect``'s ``send`` span: the remote handlers its one message asked."""
COLLECT_ANSWERED: Final = "hookbus.collect.answered"
"""On an ``emit_and_collect``'s ``send`` span: the answers that came back in time."""

# -- GenAI (plain strings; see the module docstring) ----------------------------------------
GEN_AI_AGENT_ID: Final = "gen_ai.agent.id"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
"""The hookbus ``session_id``; on the ``ai`` integration's ``invoke_agent`` and ``await``
spans, the run's session (its run id unless a session id was given), shared by a run and
every run resuming it."""
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
RUN_ID: Final = "hookbus.run.id"
"""The ``ai`` integration's run id, on its ``invoke_agent`` and ``await`` spans: the same on
a run and every run resuming it (a span link alone ties those, which not every backend
shows)."""

# -- span events -----------------------------------------------------------------------------
EVENT_HANDLER_FAILURE: Final = "hookbus.handler.failure"
"""On an emit span, one per failed handler (handler, kind, policy, failed_open)."""
SUSPENSION_PENDING: Final = "pending"
SUSPENSION_RESOLVED: Final = "resolved"
SUSPENSION_CANCELLED: Final = "cancelled"
SUSPENSION_TIMED_OUT: Final = "timed_out"
SUSPENSION_ABORTED: Final = "aborted"
SUSPENSION_EVENTS: Final = frozenset(
    {SUSPENSION_PENDING, SUSPENSION_RESOLVED, SUSPENSION_CANCELLED, SUSPENSION_TIMED_OUT,
     SUSPENSION_ABORTED}
)  # fmt: skip

# -- metric instruments (seconds for durations) ------------------------------------------------
METRIC_EMIT_DURATION: Final = "hookbus.emit.duration"
"""Histogram, s: one emit, by event and decision (action)."""
METRIC_HANDLER_DURATION: Final = "hookbus.handler.duration"
"""Histogram, s: one handler call as the dispatcher saw it (round trip for remote ones)."""
METRIC_DECISIONS: Final = "hookbus.decisions"
"""Counter: emits by event and folded action."""
METRIC_FAILURES: Final = "hookbus.handler.failures"
"""Counter: handler failures by event, handler, kind and policy."""
METRIC_FAIL_OPENS: Final = "hookbus.handler.fail_opens"
"""Counter: failures ignored by policy (the call went on without the handler)."""
METRIC_SUSPENSIONS_PENDING: Final = "hookbus.suspensions.pending"
"""UpDownCounter: suspension waits in progress in this process, by kind."""
METRIC_PROCESS_DURATION: Final = "messaging.process.duration"
"""Histogram, s (messaging semconv): one handling in a worker."""
METRIC_AUDIT_DROPPED: Final = "hookbus.audit.dropped"
"""Counter: decision audit records not stored, by `AUDIT_DROP_REASON`."""
AUDIT_DROP_REASON: Final = "hookbus.audit.drop_reason"
"""``queue_full`` | ``unavailable`` (no ack until the retries ran out) | ``refused`` (JetStream
answered an error) | ``closed`` (the log closed first) | ``error``."""

DURATION_BUCKETS_S: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075,
    0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
"""Histogram bucket boundaries in seconds: the messaging semconv advice, extended below 5 ms
(an in-process handler takes microseconds, a NATS round trip about half a millisecond)."""
