"""The HTTP gateway: hookbus's doors over HTTP, as one ASGI app (Starlette).

`gateway_app(emit)` answers:

==============================================  ============================================
route                                           what
==============================================  ============================================
``POST /claude-code``                           a Claude Code HTTP hook, any event: the event
                                                is the body's ``hook_event_name``
``POST /claude-code/{hook_event_name}``         the same, one URL per event; a body naming
                                                another event is a non-blocking error
``POST /aos``                                   an OWASP AOS guardian request (JSON-RPC 2.0);
                                                a notification is answered 204
``GET /healthz``                                liveness: 200 while the process serves
``GET /readyz``                                 readiness: 200 when `ready()` says so (NATS
                                                connected), else 503
==============================================  ============================================

Each door maps its protocol to a hookbus event, calls `emit` and maps the folded result back
(`hookbus.integrations.claude_code`, `hookbus.integrations.aos`); the gateway adds only HTTP:

- **auth**: with a `token`, every door route needs ``Authorization: Bearer <token>``
  (compared in constant time); otherwise 401 with ``WWW-Authenticate: Bearer`` and a JSON
  error (RFC 6750). The probes stay open. The token is never logged. Client certificates
  (mTLS) are the server's business (``hookbus gateway --gateway-client-ca``).
- **body size**: a body over `max_body_bytes` is refused with 413 before it is read: a
  ``Content-Length`` over the limit at once, a chunked body as soon as the count passes it.
- **trace context**: the W3C ``traceparent`` / ``tracestate`` headers are extracted with
  the global OpenTelemetry propagator; the request's ``SERVER`` span (when an SDK is
  installed) and the emit run under that context, so the dispatcher's spans continue the
  caller's trace.

Error bodies have hookbus's error shape, ``{"error": {"code": ..., "message": ...}}``,
except on ``/aos``: there every answer is a JSON-RPC 2.0 response, the gateway's refusals
included (same HTTP status; ``{"jsonrpc": "2.0", "id": null, "error": {"code": -32600,
"data": {"reason": "payload_too_large", ...}}}``, see `aos.refusal`), and another HTTP
method than POST is answered 405 with such a body too.
Source: Claude Code hooks reference (HTTP hooks: a non-2xx status or a 2xx body that is not
JSON is a non-blocking error), RFC 6750 (bearer tokens), W3C Trace Context.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import Lifespan

from . import aos, claude_code
from ._emit import Emit
from .claude_code import ClaudeCodeOptions

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DOORS", "gateway_app"]

log = logging.getLogger("hookbus.integrations.gateway")

DOORS: frozenset[str] = frozenset({"claude-code", "aos"})
"""The doors `gateway_app` can mount: ``claude-code`` and ``aos``."""

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""Largest request body accepted, bytes (1 MiB); larger ones get 413."""

SCOPE = "hookbus.integrations.gateway"
"""The OpenTelemetry instrumentation scope of the gateway's ``SERVER`` spans."""

JSON = "application/json"

_HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
"""The methods a door route with ``any_method`` takes (all but POST to refuse them)."""

_PREFIX_BYTES = 64 * 1024
"""How much of an oversize body is kept to find which event it was."""

# HTTP semantic conventions (stable): the server span's attributes.
_HTTP_METHOD = "http.request.method"
_HTTP_ROUTE = "http.route"
_HTTP_STATUS = "http.response.status_code"
_URL_PATH = "url.path"
_ERROR_TYPE = "error.type"

Door = Callable[[bytes, Request], Awaitable[tuple[int, bytes, str | None]]]
"""``await door(body, request) -> (status, body, content type or None)``."""

Refusal = Callable[[Request, "_Refused"], Awaitable[Response]]
"""``await refuse(request, refused) -> response``: how a door answers a request the gateway
refused before the door read it (bad token, oversize or unreadable body)."""


class _Refused:
    """A refusal: the HTTP answer the gateway would give, and what it knows of the body."""

    def __init__(
        self, response: Response, code: str, message: str, body: bytes = b"",
        data: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.response, self.code, self.message, self.body = response, code, message, body
        self.data = data or {}
        """What a door may add to its own error body (e.g. ``maxBytes``)."""


async def _http_refusal(request: Request, refused: _Refused) -> Response:
    return refused.response


def error_body(code: str, message: str) -> bytes:
    """``{"error": {"code": code, "message": message}}`` as JSON bytes."""
    return json.dumps({"error": {"code": code, "message": message}}).encode()


class _TooLarge(Exception):
    def __init__(self, prefix: bytes = b"") -> None:
        super().__init__()
        self.prefix = prefix
        """The start of the body read before the limit was passed (empty when
        ``Content-Length`` already said too much)."""


class _BadLength(Exception):
    pass


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused before it is read whole when it is over `limit` bytes.

    Raises:
        _TooLarge: ``Content-Length`` says more than `limit`, or the body streamed so far
            is already longer.
        _BadLength: ``Content-Length`` is not a non-negative integer.
        ClientDisconnect: the client went away.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise _BadLength(declared)
        if int(declared) > limit:
            raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(b"".join(chunks)[:_PREFIX_BYTES])
        chunks.append(chunk)
    return b"".join(chunks)


class _Tracer:
    """The gateway's tracer, rebound when the global tracer provider changes; None while
    no SDK is installed (no span is made then)."""

    def __init__(self) -> None:
        self._provider: object = None
        self._tracer: trace.Tracer | None = None

    def get(self) -> trace.Tracer | None:
        provider = trace.get_tracer_provider()
        if provider is not self._provider:
            self._provider = provider
            off = isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self._tracer = None if off else provider.get_tracer(SCOPE)
        return self._tracer


def _bearer_check(token: str | None) -> Callable[[Request], Response | None]:
    """A check returning None when the request may pass, else the 401 response."""
    expected = token.encode() if token else None

    def check(request: Request) -> Response | None:
        if expected is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, value = header.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            if hmac.compare_digest(value.strip().encode("latin-1"), expected):
                return None
            challenge = 'Bearer realm="hookbus", error="invalid_token"'
            message = "the bearer token is not accepted"
        else:
            challenge = 'Bearer realm="hookbus"'
            message = "this gateway needs a token: send the header Authorization: Bearer <token>"
        client = request.client.host if request.client else "?"
        path = request.url.path
        log.warning("401 for %s %s from %s: %s", request.method, path, client, message)
        return Response(
            error_body("unauthorized", message),
            status_code=401,
            media_type=JSON,
            headers={"WWW-Authenticate": challenge},
        )

    return check


def _door_route(
    path: str,
    name: str,
    door: Door,
    *,
    check: Callable[[Request], Response | None],
    max_body_bytes: int,
    tracer: _Tracer,
    refuse: Refusal = _http_refusal,
    any_method: bool = False,
) -> Route:
    """`any_method`: the route takes every HTTP method and refuses all but POST through
    `refuse` (405), instead of Starlette's plain-text 405."""
    span_name = f"POST {path}"

    async def endpoint(request: Request) -> Response:
        if request.method != "POST":
            message = f"{request.method} is not served here: send the request with POST"
            response = Response(
                error_body("method_not_allowed", message), status_code=405, media_type=JSON,
                headers={"Allow": "POST"},
            )  # fmt: skip
            return await refuse(request, _Refused(response, "method_not_allowed", message))
        denied = check(request)
        if denied is not None:
            body = b""
            with contextlib.suppress(_TooLarge, _BadLength, ClientDisconnect):
                body = await read_body(request, max_body_bytes)
            message = "the gateway's bearer token is missing or not accepted"
            return await refuse(request, _Refused(denied, "unauthorized", message, body))
        try:
            body = await read_body(request, max_body_bytes)
        except _TooLarge as exc:
            message = f"the body is over {max_body_bytes} bytes"
            response = Response(
                error_body("payload_too_large", message),
                status_code=413,
                media_type=JSON,
                headers={"Connection": "close"},
            )
            limit = {"maxBytes": max_body_bytes}
            return await refuse(
                request, _Refused(response, "payload_too_large", message, exc.prefix, limit)
            )
        except _BadLength as exc:
            message = f"Content-Length {exc} is not a number of bytes"
            response = Response(
                error_body("bad_request", message), status_code=400, media_type=JSON
            )
            return await refuse(request, _Refused(response, "bad_request", message))
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        parent = propagate.extract(request.headers)
        t = tracer.get()
        if t is None:
            attached = otel_context.attach(parent)
            try:
                status, payload, media = await _answer(door, body, request, name)
            finally:
                otel_context.detach(attached)
        else:
            attrs = {_HTTP_METHOD: "POST", _HTTP_ROUTE: path, _URL_PATH: request.url.path}
            with t.start_as_current_span(
                span_name, context=parent, kind=trace.SpanKind.SERVER, attributes=attrs
            ) as span:
                status, payload, media = await _answer(door, body, request, name)
                span.set_attribute(_HTTP_STATUS, status)
                if status >= 500:
                    span.set_attribute(_ERROR_TYPE, str(status))
                    span.set_status(trace.StatusCode.ERROR)
        return Response(payload, status_code=status, media_type=media)

    methods = _HTTP_METHODS if any_method else ["POST"]
    return Route(path, endpoint, methods=methods, name=name)


CLIENT_GONE = 499
"""The status of a request whose caller went away before its answer (nginx's "client closed
request"): nobody reads it."""


async def _answer(
    door: Door, body: bytes, request: Request, name: str
) -> tuple[int, bytes, str | None]:
    """The door's answer; a bug in a door is logged and answered 500 with a JSON error
    (never a traceback to the caller). A caller that disconnects first cancels the door's
    decision (`CLIENT_GONE`): a decision nobody reads must not use anything up, such as an
    approval's one-time allow that the caller's retry (on another replica) waits for."""
    decision = asyncio.ensure_future(door(body, request))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({decision, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not decision.done():
            decision.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await decision
            return CLIENT_GONE, b"", None
        return decision.result()
    except asyncio.CancelledError:
        decision.cancel()
        raise
    except Exception:
        log.exception("the %s door failed on %s", name, request.url.path)
        return 500, error_body("internal", f"the {name} door failed; see the gateway's log"), JSON
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the caller has disconnected (the ASGI ``http.disconnect`` message; the
    body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _claude_code_door(emit: Emit, options: ClaudeCodeOptions | None) -> Door:
    async def door(body: bytes, request: Request) -> tuple[int, bytes, str | None]:
        event = request.path_params.get("hook_event_name")
        try:
            reply = await claude_code.answer(body, emit, options, hook_event_name=event)
        except Exception as exc:  # the door never raises; if it did, its fallback answers
            log.exception("the claude-code door failed on %s", request.url.path)
            why = f"the gateway failed: {type(exc).__name__}"
            reply = claude_code.fallback_answer(body, why, options, hook_event_name=event)
        return claude_code.http_reply(reply)

    return door


_EVENT_NAME = re.compile(rb'"hook_event_name"\s*:\s*"([A-Za-z]{1,64})"')


def _claude_code_refusal(options: ClaudeCodeOptions | None) -> Refusal:
    """Refusals on the Claude Code door answer 200 with the event's fallback decision:
    Claude Code runs the tool on any non-2xx answer (see `claude_code.refusal_answer`)."""

    async def refuse(request: Request, refused: _Refused) -> Response:
        event = request.path_params.get("hook_event_name")
        if event is None:
            found = _EVENT_NAME.search(refused.body[:_PREFIX_BYTES])
            event = found.group(1).decode() if found else None
        why = f"{refused.code}: {refused.message}"
        reply = claude_code.refusal_answer(event, why, options)
        status, payload, media = claude_code.http_reply(reply)
        headers = {"Connection": "close"} if refused.code == "payload_too_large" else None
        return Response(payload, status_code=status, media_type=media, headers=headers)

    return refuse


def _aos_door(emit: Emit, max_body_bytes: int, timeout_s: float | None) -> Door:
    async def door(body: bytes, request: Request) -> tuple[int, bytes, str | None]:
        try:
            reply = await aos.answer(body, emit, max_body_bytes=max_body_bytes, timeout_s=timeout_s)
        except Exception:  # `answer` never raises; if it did, still a JSON-RPC answer
            log.exception("the aos door failed on %s", request.url.path)
            detail = "the aos door failed; see the gateway's log"
            return 500, aos.refusal("internal", detail, code=aos.INTERNAL_ERROR), JSON
        if reply is None:  # a notification: no response body
            return 204, b"", None
        return 200, bytes(reply), JSON

    return door


_KEPT_HEADERS = ("www-authenticate", "connection", "allow")


async def _aos_refusal(request: Request, refused: _Refused) -> Response:
    """Refusals on the AOS door keep their HTTP status and headers, with a JSON-RPC error
    response as the body (``id`` null: the request was not read): an AOS SDK reads every
    answer as JSON-RPC."""
    original = refused.response
    detail = refused.message
    with contextlib.suppress(ValueError, KeyError, TypeError):  # the HTTP answer's own words
        detail = json.loads(bytes(original.body))["error"]["message"]
    body = aos.refusal(refused.code, detail, **refused.data)
    headers = {k: original.headers[k] for k in _KEPT_HEADERS if k in original.headers}
    return Response(body, status_code=original.status_code, media_type=JSON, headers=headers)


def gateway_app(
    emit: Emit,
    *,
    doors: Collection[str] = DOORS,
    token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    claude_code_options: ClaudeCodeOptions | None = None,
    aos_timeout_s: float | None = None,
    ready: Callable[[], bool] | None = None,
    lifespan: Lifespan[Starlette] | None = None,
) -> Starlette:
    """The gateway's ASGI app; see the module docstring for the routes.

    Args:
        emit: where every door's event goes (`HookDispatcher.emit` of a dispatcher replica).
        doors: the doors to mount, a subset of `DOORS`; the probes are always there.
        token: the bearer token every door route needs; None: no token (use mTLS, or
            serve on loopback only).
        max_body_bytes: largest request body, bytes (over it: 413).
        claude_code_options: a `ClaudeCodeOptions` for the Claude Code door (None: its
            defaults: no opinion on continue, ask_user asked in Claude Code, PreToolUse
            and PermissionRequest fail closed, 25 s to decide).
        aos_timeout_s: the AOS door's deadline for a decision, seconds (an approval's wait
            included; past it the door denies); None: the handlers' own timeouts only.
        ready: the readiness check of ``GET /readyz`` (e.g. the NATS connection is up);
            None: always ready.
        lifespan: the Starlette lifespan (e.g. draining NATS at shutdown).

    Raises:
        ValueError: an unknown door, no door, an empty token, or `max_body_bytes` < 1.
    """
    unknown = sorted(set(doors) - DOORS)
    if unknown:
        raise ValueError(f"unknown door(s) {', '.join(unknown)}: choose from {sorted(DOORS)}")
    if not doors:
        raise ValueError(f"no door to serve: choose from {sorted(DOORS)}")
    if token is not None and not token.strip():
        raise ValueError("the token is empty")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
    check = _bearer_check(token)
    tracer = _Tracer()
    routes: list[BaseRoute] = []

    def mount(
        path: str, name: str, door: Door, refuse: Refusal = _http_refusal, any_method: bool = False
    ) -> None:
        route = _door_route(
            path, name, door, check=check, max_body_bytes=max_body_bytes, tracer=tracer,
            refuse=refuse, any_method=any_method,
        )  # fmt: skip
        routes.append(route)

    if "claude-code" in doors:
        door = _claude_code_door(emit, claude_code_options)
        refuse = _claude_code_refusal(claude_code_options)
        mount("/claude-code", "claude-code", door, refuse)
        mount("/claude-code/{hook_event_name}", "claude-code", door, refuse)
    if "aos" in doors:
        door = _aos_door(emit, max_body_bytes, aos_timeout_s)
        mount("/aos", "aos", door, _aos_refusal, any_method=True)

    async def healthz(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    async def readyz(request: Request) -> Response:
        if ready is None or ready():
            return Response(b'{"status":"ready"}', media_type=JSON)
        body = {"status": "not ready", "reason": "not connected to NATS"}
        return Response(json.dumps(body).encode(), status_code=503, media_type=JSON)

    routes.append(Route("/healthz", healthz, methods=["GET"]))
    routes.append(Route("/readyz", readyz, methods=["GET"]))
    return Starlette(routes=routes, lifespan=lifespan)
