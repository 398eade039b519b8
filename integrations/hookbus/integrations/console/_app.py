"""The approvals console's ASGI app (Starlette); see the package docstring for the routes."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Lifespan, Message, Receive, Scope, Send

from hookbus._core.approvers import valid_approver
from hookbus._core.deadlines import Deadline
from hookbus.dispatcher import (
    APPROVAL_LABEL_PREFIX,
    AnswerNotAppliedError,
    ApprovalsClient,
    describe_handlers,
)
from hookbus.schemas import (
    AlreadySettledError,
    BadRequestError,
    HookbusError,
    HookbusTimeoutError,
    NotConnectedError,
    NotPermittedError,
    ResolutionRejectedError,
    SuspensionNotFoundError,
)

from ._feed import Feed
from ._sign_in import COOKIE, DEFAULT_SESSION_TTL_S, Session, Signer, cross_origin_problem
from ._views import approval_item, grant_item, handlers_view, recent_decisions

__all__ = ["console_app"]

log = logging.getLogger("hookbus.integrations.console")

STATIC = Path(__file__).parent / "static"

MAX_BODY_BYTES = 64 * 1024
"""Largest request body the console reads (its bodies are a few hundred bytes)."""

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
"""Sent with every answer: no script, style or connection but the console's own, never in
a frame (an Allow button under someone else's page), no referrer."""

UNREADABLE_RETRY_S = 60.0
"""Seconds the console answers "not readable" for the audit trail, once it was refused,
before it asks JetStream again."""

KEEPALIVE_S = 15.0
"""Seconds between keep-alive comments on an idle event stream."""


class _SecurityHeaders:
    """ASGI middleware adding `SECURITY_HEADERS` to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status, headers={"Cache-Control": "no-store"})


def _error(status: int, code: str, message: str) -> JSONResponse:
    return _json({"error": {"code": code, "message": message}}, status)


class _BadBody(Exception):
    def __init__(self, response: JSONResponse) -> None:
        super().__init__()
        self.response = response


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object body (at most `MAX_BODY_BYTES`).

    Raises:
        _BadBody: with the 400 / 413 answer.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _BadBody(_error(413, "payload_too_large", f"the body is over {MAX_BODY_BYTES} bytes"))
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                message = f"the body is over {MAX_BODY_BYTES} bytes"
                raise _BadBody(_error(413, "payload_too_large", message))
            chunks.append(chunk)
    except ClientDisconnect:
        raise _BadBody(_error(400, "bad_request", "the client went away")) from None
    try:
        value = json.loads(b"".join(chunks))
    except (ValueError, RecursionError):
        raise _BadBody(_error(400, "bad_request", "the body is not valid JSON")) from None
    if not isinstance(value, dict):
        raise _BadBody(_error(400, "bad_request", "the body must be a JSON object"))
    return value


def _text(body: dict[str, Any], name: str, *, optional: bool = False) -> str | None:
    value = body.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        kind = "a string or null" if optional else "a non-empty string"
        raise _BadBody(_error(400, "bad_request", f"{name!r} must be {kind}"))
    return value


def _sse(kind: str, data: Any) -> str:
    """One server-sent event (the JSON has no newline: one ``data`` line)."""
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


_ERRORS: tuple[tuple[type[HookbusError], int, str], ...] = (
    (SuspensionNotFoundError, 404, "not_found"),
    (AlreadySettledError, 409, "already_settled"),
    (ResolutionRejectedError, 422, "rejected"),
    (BadRequestError, 400, "bad_request"),
    (NotPermittedError, 403, "not_permitted"),
    (AnswerNotAppliedError, 504, "not_applied_yet"),
    (HookbusTimeoutError, 503, "unavailable"),
    (NotConnectedError, 503, "unavailable"),
)
"""How a hookbus error is answered (the first class it is an instance of); others: 502."""


def _hookbus_error(exc: HookbusError) -> JSONResponse:
    """A hookbus error as the console's JSON error (the message is hookbus's own)."""
    status, code = next(((s, c) for kind, s, c in _ERRORS if isinstance(exc, kind)),
                        (502, "hookbus_error"))  # fmt: skip
    return _error(status, code, str(exc))


Handler = Callable[[Request, Session], Awaitable[Response]]


def console_app(
    client: ApprovalsClient,
    nc: NATS,
    *,
    token: str,
    approver: str | None = None,
    session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    stopping: Callable[[], bool] | None = None,
    ping_timeout_s: float = 0.5,
    feed: Feed | None = None,
    lifespan: Lifespan[Starlette] | None = None,
    nats_approver: str | None = None,
) -> Starlette:
    """The approvals console's ASGI app; see the package docstring for the routes.

    Args:
        client: what lists and answers approvals and lists and revokes grants, on `nc`: a
            started `ApprovalsClient` (the approvals bucket only).
        nc: its connection (the watches, the audit trail, the handlers' liveness).
        token: what signing in takes (`Signer`); never logged.
        approver: the approver name bound to the token (every answer is recorded as this
            name); None: each person names themselves at sign-in.
        session_ttl_s: how long a sign-in lasts, seconds.
        stopping: tells open event streams to end (e.g. uvicorn's ``should_exit``), so a
            graceful shutdown does not wait on them; None: they end with their client.
        ping_timeout_s: how long ``/api/handlers`` gathers live workers' answers, seconds.
        feed: the live feed (default: a new `Feed` on `nc`, started and closed by the
            app's lifespan).
        lifespan: an outer lifespan (e.g. closing the client at shutdown), entered
            after the feed has started.
        nats_approver: the approver `nc`'s NATS credentials are (a secured server lets
            them answer as that name only): a sign-in naming anyone else is refused, with
            a message saying whom to sign in as; None: any name.
    Raises:
        ValueError: an empty token, an invalid approver name, or a lifetime not above 0.
    """
    signer = Signer(token, ttl_s=session_ttl_s, approver=approver)
    live = feed or Feed(nc)
    is_stopping = stopping or (lambda: False)

    def signed_in(
        handler: Handler, *, post: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            session = signer.verify(request.cookies.get(COOKIE))
            if session is not None and nats_approver not in (None, session.approver):
                session = None  # signed in before the console ran with these credentials
            if session is None:
                return _error(401, "unauthorized", "sign in first")
            if post:
                problem = cross_origin_problem(request)
                if problem is not None:
                    log.warning("console: refused %s %s from %s: %s", request.method,
                                request.url.path, _client(request), problem)  # fmt: skip
                    return _error(403, "forbidden", problem)
            try:
                return await handler(request, session)
            except _BadBody as exc:
                return exc.response
            except HookbusError as exc:
                return _hookbus_error(exc)

        return endpoint

    async def index(request: Request) -> Response:
        return Response((STATIC / "index.html").read_bytes(), media_type="text/html",
                        headers={"Cache-Control": "no-store"})  # fmt: skip

    async def session_info(request: Request) -> Response:
        session = signer.verify(request.cookies.get(COOKIE))
        return _json({
            "signed_in": session is not None,
            "approver": session.approver if session else None,
            "expires_at": session.expires_at if session else None,
            "approver_bound": signer.approver is not None,
            "nats_approver": nats_approver,
        })  # fmt: skip

    async def login(request: Request) -> Response:
        problem = cross_origin_problem(request)
        if problem is not None:
            log.warning("console: refused sign-in from %s: %s", _client(request), problem)
            return _error(403, "forbidden", problem)
        try:
            body = await _body(request)
        except _BadBody as exc:
            return exc.response
        given = body.get("token")
        if not isinstance(given, str) or not signer.token_ok(given):
            log.warning("console: sign-in refused from %s: wrong token", _client(request))
            return _error(401, "unauthorized", "the token is not accepted")
        name = signer.approver
        if name is None:
            raw = body.get("approver")
            name = raw if isinstance(raw, str) else ""
            problem = valid_approver(name)
            if problem is not None:
                return _error(400, "bad_request", problem)
        if nats_approver is not None and name != nats_approver:
            log.warning("console: sign-in as %r refused from %s: the NATS credentials are"
                        " approver %r", name, _client(request), nats_approver)  # fmt: skip
            return _error(
                403, "wrong_approver",
                f"this console's NATS credentials are approver {nats_approver}: answers can"
                f" only be recorded as {nats_approver}, not as {name}; sign in as"
                f" {nats_approver}",
            )  # fmt: skip
        value, session = signer.issue(name)
        log.info("console: %s signed in from %s", name, _client(request))
        response = _json({"approver": name, "expires_at": session.expires_at})
        response.set_cookie(
            COOKIE, value, max_age=int(signer.ttl_s), path="/", httponly=True,
            samesite="strict", secure=request.url.scheme == "https",
        )  # fmt: skip
        return response

    async def logout(request: Request, session: Session) -> Response:
        response = _json({"signed_in": False})
        response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict",
                               secure=request.url.scheme == "https")  # fmt: skip
        return response

    async def approvals(request: Request, session: Session) -> Response:
        page = await client.approval_page(status="pending", prefix=APPROVAL_LABEL_PREFIX)
        items = [approval_item(r) for r in page.records if r.metadata.get("kind") == "approval"]
        return _json({"now": time.time(), "approvals": items, "skipped": page.skipped})

    async def answer(request: Request, session: Session) -> Response:
        body = await _body(request)
        label = _text(body, "label")
        choice = _text(body, "choice")
        agent = _text(body, "agent_id", optional=True)
        assert label is not None and choice is not None
        got = await client.answer_approval(label, choice, approver=session.approver, agent_id=agent)
        log.info("console: %s answered %s of agent %s: %r", session.approver, label, agent,
                 choice)  # fmt: skip
        return _json({"label": label, "agent_id": agent, "choice": got.choice,
                      "answered_by": got.answered_by, "answered_at": got.answered_at})  # fmt: skip

    async def cancel(request: Request, session: Session) -> Response:
        body = await _body(request)
        label = _text(body, "label")
        agent = _text(body, "agent_id", optional=True)
        assert label is not None
        await client.cancel_approval(
            label, reason="on the console", agent_id=agent, approver=session.approver
        )
        reason = f"by {session.approver}: on the console"
        log.info("console: %s cancelled %s of agent %s", session.approver, label, agent)
        return _json({"label": label, "agent_id": agent, "reason": reason})

    async def grants(request: Request, session: Session) -> Response:
        found = await client.approval_grants()
        return _json({"grants": [grant_item(g) for g in found]})

    async def revoke(request: Request, session: Session) -> Response:
        key = _text(await _body(request), "key")
        assert key is not None
        await client.revoke_grant(key)
        log.info("console: %s revoked grant %s", session.approver, key)
        return _json({"revoked": key})

    unreadable: list[tuple[Deadline, dict[str, Any]]] = []  # (until, answer) of the last refusal

    async def decisions(request: Request, session: Session) -> Response:
        raw = request.query_params.get("limit", "50")
        if not raw.isdigit() or not 1 <= int(raw) <= 1000:
            return _error(400, "bad_request", "limit must be a whole number from 1 to 1000")
        if unreadable and not unreadable[0][0].passed(time.monotonic()):
            return _json(unreadable[0][1])  # a user that may not read it waits 5 s to learn
        got = await recent_decisions(nc, limit=int(raw))
        unreadable.clear()
        if got.get("code") == "not_readable":
            unreadable.append((Deadline.after(UNREADABLE_RETRY_S, time.monotonic()), got))
        return _json(got)

    async def handlers(request: Request, session: Session) -> Response:
        view = await describe_handlers(nc, ping_timeout_s=ping_timeout_s)
        return _json(handlers_view(view))

    async def events(request: Request, session: Session) -> Response:
        listener = live.listen()

        async def stream() -> AsyncIterator[str]:
            try:
                yield "retry: 1000\n\n"
                yield _sse("hello", {"approver": session.approver, "now": time.time()})
                keep_alive = Deadline.after(KEEPALIVE_S, time.monotonic())  # due if quiet so long
                while not is_stopping():
                    event = await listener.get(1.0)
                    if time.time() >= session.expires_at:
                        yield _sse("signed_out", {"reason": "the sign-in expired"})
                        return
                    if event is not None:
                        yield _sse(*event)
                        keep_alive = Deadline.after(KEEPALIVE_S, time.monotonic())
                    elif keep_alive.passed(time.monotonic()):
                        yield ": keep-alive\n\n"
                        keep_alive = Deadline.after(KEEPALIVE_S, time.monotonic())
            finally:
                live.unlisten(listener)

        return StreamingResponse(
            stream(), media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )  # fmt: skip

    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"})

    routes: list[BaseRoute] = [
        Route("/", index, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/api/session", session_info, methods=["GET"]),
        Route("/api/login", login, methods=["POST"]),
        Route("/api/logout", signed_in(logout, post=True), methods=["POST"]),
        Route("/api/approvals", signed_in(approvals), methods=["GET"]),
        Route("/api/approvals/answer", signed_in(answer, post=True), methods=["POST"]),
        Route("/api/approvals/cancel", signed_in(cancel, post=True), methods=["POST"]),
        Route("/api/grants", signed_in(grants), methods=["GET"]),
        Route("/api/grants/revoke", signed_in(revoke, post=True), methods=["POST"]),
        Route("/api/decisions", signed_in(decisions), methods=["GET"]),
        Route("/api/handlers", signed_in(handlers), methods=["GET"]),
        Route("/events", signed_in(events), methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def life(app: Starlette) -> AsyncIterator[None]:
        if feed is None:
            await live.start()
        try:
            if lifespan is None:
                yield
            else:
                async with lifespan(app):
                    yield
        finally:
            if feed is None:
                await live.close()

    return Starlette(routes=routes, middleware=[Middleware(_SecurityHeaders)], lifespan=life)
