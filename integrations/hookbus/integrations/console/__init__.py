"""The approvals console: a page in a browser for the human in the loop (``hookbus console``).

`console_app(client, nc, token=...)` is one Starlette app; uvicorn serves it. It shows
the pending approvals (prompt, options, agent, session, handler, tool, the call's data as
the handlers saw it, time left) and answers them as the signed-in approver; the "Allow
always" grants, which it revokes; the most recent decisions of the audit trail (when it is
on and this NATS user may read it); and the declared handlers with their live replicas.

===============================  ==============================================================
route                            what
===============================  ==============================================================
``GET /``                        the page (``static/``: plain HTML, CSS and JavaScript)
``GET /events``                  server-sent events: ``hello``, ``approval``,
                                 ``approval_removed``, ``grant``, ``grant_removed``,
                                 ``decision``, ``resync``, ``signed_out`` (see `Feed`)
``GET /api/session``             who is signed in (``signed_in``, ``approver``, ``expires_at``,
                                 ``approver_bound``, ``nats_approver``); open
``POST /api/login``              ``{"token", "approver"}``: sets the session cookie (403 when
                                 the name is not the approver the console's NATS
                                 credentials are); open
``POST /api/logout``             clears it
``GET /api/approvals``           ``{"now", "approvals": [...], "skipped"}``, oldest first
``POST /api/approvals/answer``   ``{"label", "agent_id", "choice"}``: answers as the approver
``GET /api/grants``              ``{"grants": [...]}``, each with its ``key``
``POST /api/grants/revoke``      ``{"key"}``: revokes one grant
``GET /api/decisions?limit=N``   ``{"available", "reason"?, "records": [...]}``, oldest first
``GET /api/handlers``            ``{"handlers", "rejected", "live_only"}``
``GET /healthz``                 liveness; open
===============================  ==============================================================

Every route but the open ones needs the session cookie (401 without); every ``POST`` also
needs the header ``X-Hookbus-Console`` and a JSON body, and is refused (403) when the
browser says it comes from another origin (see `hookbus.integrations.console._sign_in`).
Errors have hookbus's shape, ``{"error": {"code": ..., "message": ...}}``: 404 no such
approval, 409 already answered / cancelled / timed out, 422 a choice that is not an
option, 400 bad input, 403 ``not_permitted`` NATS refused it to the console's
credentials, 503 JetStream unavailable.

Source: WHATWG HTML Living Standard, "Server-sent events" (the ``text/event-stream``
format, ``retry``, comments as keep-alives).
"""

from ._app import console_app
from ._feed import Feed, Listener
from ._sign_in import COOKIE, CSRF_HEADER, DEFAULT_SESSION_TTL_S

__all__ = [
    "COOKIE", "CSRF_HEADER", "DEFAULT_SESSION_TTL_S", "Feed", "Listener", "console_app",
]  # fmt: skip
