"""Bounded logging of what other processes send: a flood of bad requests must not become a
flood of log lines, nor one huge line per request.

`RateLimitedWarning` is shared by the worker (bad handler requests) and the dispatcher
service (refused emits): the first few per interval are logged one by one, the rest
counted. `clip` cuts what a request put in a message (its error text, its subject) to a
bounded size.
"""

from __future__ import annotations

import logging
import time

__all__ = ["LOGGED_TEXT_MAX", "RateLimitedWarning", "clip"]

LOGGED_TEXT_MAX = 200
"""Characters of request-supplied text (an error message, a subject) one log line keeps."""


def clip(text: object, limit: int = LOGGED_TEXT_MAX) -> str:
    """`text` as a string of at most about `limit` characters (cut ones are counted)."""
    s = str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]}... ({len(s) - limit} more characters)"


class RateLimitedWarning:
    """WARNING lines for repeated bad input: the first `burst` per `interval_s` seconds
    one by one (one line each, no traceback), the rest as one count per interval
    (``N more <what> in the last Ns``, logged with the next line after the interval)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 5,
        interval_s: float = 10.0,
        what: str = "bad request(s)",
    ):
        self._log = logger
        self._burst = burst
        self._interval_s = interval_s
        self._what = what
        self._since = time.monotonic()
        self._logged = 0
        self._suppressed = 0

    def warn(self, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._since >= self._interval_s:
            if self._suppressed:
                self._log.warning(
                    "%d more %s in the last %.0fs (not logged one by one)",
                    self._suppressed,
                    self._what,
                    now - self._since,
                )
            self._since, self._logged, self._suppressed = now, 0, 0
        if self._logged < self._burst:
            self._logged += 1
            self._log.warning(fmt, *args)
        else:
            self._suppressed += 1
