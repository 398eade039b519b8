"""Tracing for libraries that keep an agent run's hooks in hookbus (the ``ai``
integration): the run's span and the links of a resumed wait to the run that asked.

- `run_span`: an ``invoke_agent <agent>`` span (INTERNAL, OpenTelemetry GenAI) around an
  agent run when no span is current, so the run's ``await`` spans are its children.
- `creating_traceparent`: the W3C ``traceparent`` of the current span, to keep with a
  suspension's record when it is created.
- `created_by`: the ``await`` spans of the waits started inside link to that
  ``traceparent`` (a wait resumed later, in another run or process, finds its creator).

Each does nothing while tracing is off (no tracer provider set). Span and attribute
names are in `hookbus.schemas.telemetry`.
"""

from ._telemetry import created_by, creating_traceparent, run_span

__all__ = ["created_by", "creating_traceparent", "run_span"]
