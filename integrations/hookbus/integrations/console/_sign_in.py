"""Sign-in for the approvals console: one shared token, a signed session cookie naming the
approver, and the same-origin checks every state-changing request must pass.

- **The token** is compared in constant time and never logged. A correct token at
  ``POST /api/login`` gets a session cookie; nothing else accepts the token.
- **The session cookie** (`COOKIE`) is ``<payload>.<signature>``: the payload names the
  approver and the expiry (Unix seconds), the signature is HMAC-SHA256 under a key derived
  from the token. It is ``HttpOnly`` (no script reads it), ``SameSite=Strict`` (no other
  site's page sends it) and ``Secure`` when served over HTTPS. It holds no server state:
  it stays valid across console restarts and replicas that share the token, until it
  expires or the token changes.
- **State-changing requests** (every ``POST``) must carry the header `CSRF_HEADER` and a
  JSON body, and, when the browser sends them, an ``Origin`` equal to the console's own and
  ``Sec-Fetch-Site: same-origin``. A page of another origin can send neither the header nor
  a JSON body without a CORS preflight, which the console never grants.

Source: RFC 6265bis (the SameSite attribute), OWASP Cross-Site Request Forgery Prevention
Cheat Sheet (custom request headers, Origin verification, Fetch Metadata).
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

from hookbus._core.approvers import valid_approver
from hookbus._core.base64url import b64url, unb64url

__all__ = [
    "COOKIE",
    "CSRF_HEADER",
    "DEFAULT_SESSION_TTL_S",
    "Session",
    "Signer",
    "cross_origin_problem",
]

COOKIE = "hookbus_console"
"""Name of the session cookie."""

CSRF_HEADER = "X-Hookbus-Console"
"""Header every ``POST`` must carry (any non-empty value; the page sends ``1``)."""

DEFAULT_SESSION_TTL_S = 12 * 3600.0
"""How long a sign-in lasts by default, seconds (12 h)."""

_KEY_CONTEXT = b"hookbus console session v1"


@dataclass(frozen=True, slots=True)
class Session:
    """A signed-in approver: who, and until when (Unix seconds)."""

    approver: str
    expires_at: float


class Signer:
    """Checks the token and issues / verifies session cookies (see the module docstring).

    Args:
        token: the console's token (non-empty).
        ttl_s: how long a session lasts, seconds.
        approver: the approver name bound to the token: every session is this approver,
            and a cookie naming another is refused; None: the name given at sign-in.
    Raises:
        ValueError: an empty token, a `ttl_s` not above 0, or an invalid `approver`.
    """

    def __init__(self, token: str, *, ttl_s: float, approver: str | None = None) -> None:
        if not token or not token.strip():
            raise ValueError("the console token is empty")
        if not ttl_s > 0:
            raise ValueError(f"the session lifetime must be above 0 s, got {ttl_s}")
        if approver is not None:
            problem = valid_approver(approver)
            if problem:
                raise ValueError(problem)
        self._token = token.encode()
        self._key = hmac.new(self._token, _KEY_CONTEXT, hashlib.sha256).digest()
        self.ttl_s = ttl_s
        self.approver = approver

    def token_ok(self, given: str) -> bool:
        """Whether `given` is the token (constant time)."""
        return hmac.compare_digest(given.encode(), self._token)

    def issue(self, approver: str, *, now: float | None = None) -> tuple[str, Session]:
        """A cookie value for `approver`, and its session."""
        expires = int((time.time() if now is None else now) + self.ttl_s)
        payload = b64url(json.dumps({"a": approver, "exp": expires}).encode())
        return f"{payload}.{self._sign(payload)}", Session(approver, float(expires))

    def verify(self, value: str | None, *, now: float | None = None) -> Session | None:
        """The session a cookie value holds; None when it is missing, forged, expired, or
        names another approver than the bound one."""
        if not value or value.count(".") != 1:
            return None
        payload, signature = value.split(".")
        if not hmac.compare_digest(signature, self._sign(payload)):
            return None
        try:
            doc = json.loads(unb64url(payload))
            approver, expires = str(doc["a"]), float(doc["exp"])
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if expires <= (time.time() if now is None else now):
            return None
        if self.approver is not None and approver != self.approver:
            return None
        return Session(approver, expires)

    def _sign(self, payload: str) -> str:
        return b64url(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())


def cross_origin_problem(request: Request) -> str | None:
    """Why a state-changing request may come from another site (None: it is same-origin):
    no `CSRF_HEADER`, a body that is not JSON, an ``Origin`` other than the console's,
    or ``Sec-Fetch-Site`` other than ``same-origin``."""
    if not request.headers.get(CSRF_HEADER):
        return f"the header {CSRF_HEADER} is missing"
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        return "the body must be application/json"
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return f"the request comes from another site (Sec-Fetch-Site: {site})"
    origin = request.headers.get("origin")
    if origin is not None:
        host = request.headers.get("host", "")
        if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
            return "the request's Origin is not this console"
    return None
