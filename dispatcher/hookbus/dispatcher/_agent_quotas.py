"""Each agent's bounds on one dispatcher service replica (`AgentQuotas`): requests in
flight, and a token bucket of requests per second.

An agent is the agent token of a request's subject (``hookbus.v1.emit.<agent>.<event>``).
A request on the no-agent subject ``=`` names no one to bound: only the replica's own
concurrency bound applies to it. Agents with nothing in flight and a full bucket are
forgotten (they are as new), at most once a second and only past 1,024 agents known.
"""

from __future__ import annotations

import contextlib
import math
import time

from hookbus._core.serving import Ticket
from hookbus.schemas import WireError, decode_token

__all__ = ["AgentQuota", "AgentQuotas"]


class AgentQuota(Ticket):
    """One agent's bounds on this replica: requests in flight, and a token bucket; an
    admitted request holds one of its requests in flight while it runs."""

    __slots__ = ("in_flight", "stamp", "tokens")

    def __init__(self, tokens: float, now: float) -> None:
        self.in_flight = 0
        self.tokens = tokens
        self.stamp = now

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


def _agent_label(token: str) -> str:
    """The agent a quota key names, for a refusal's message."""
    with contextlib.suppress(Exception):
        return repr(decode_token(token))
    return repr(token[:80])


class AgentQuotas:
    """The per-agent bounds of one replica.

    Args:
        max_in_flight: requests of one agent served at once; None: no bound.
        rate_per_s: requests per second one agent may send (the bucket's refill rate);
            None: no rate limit.
        burst: the bucket's size (None: the rate rounded up, at least 1).

    Raises:
        ValueError: `max_in_flight` or `burst` below 1, or `rate_per_s` not a finite
            number above 0.
    """

    def __init__(
        self, *, max_in_flight: int | None, rate_per_s: float | None, burst: int | None
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError("agent_max_in_flight must be at least 1 (None: no bound)")
        if rate_per_s is not None and not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise ValueError("agent_rate_per_s must be a finite number above 0 (None: no limit)")
        if burst is not None and burst < 1:
            raise ValueError("agent_burst must be at least 1")
        self.max_in_flight = max_in_flight
        """Requests of one agent served at once (None: no bound)."""
        self.rate_per_s = rate_per_s
        """Requests per second of one agent (None: no limit)."""
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate_per_s or 1)))
        """Requests one agent may send at once after a pause."""
        self._quotas: dict[str, AgentQuota] = {}
        """Per agent token: its requests in flight and its token bucket (idle ones pruned)."""
        self._next_prune = 0.0

    def admit(self, subject: str) -> AgentQuota | WireError | None:
        """The quota of the agent of the request subject `subject` with room for one more
        request (its token taken), the refusal (``busy`` or ``quota``, retryable) when it
        has none, or None when no per-agent bound is set or the subject names no agent."""
        if self.max_in_flight is None and self.rate_per_s is None:
            return None
        parts = subject.split(".", 4)
        token = parts[3] if len(parts) == 5 else "="
        if token == "=":
            return None  # the no-agent subject: no identity to bound (see the module doc)
        now = time.monotonic()
        quota = self._quotas.get(token)
        if quota is None:
            if now >= self._next_prune and len(self._quotas) >= 1024:
                self._prune(now)
            quota = self._quotas[token] = AgentQuota(self.burst, now)
        if self.max_in_flight is not None and quota.in_flight >= self.max_in_flight:
            return WireError(
                code="busy",
                message=f"agent {_agent_label(token)} has {quota.in_flight} requests in flight"
                f" on this replica, its limit (agent_max_in_flight={self.max_in_flight}); send"
                " it again once one is answered",
                retryable=True,
            )
        rate = self.rate_per_s
        if rate is not None:
            quota.tokens = min(self.burst, quota.tokens + (now - quota.stamp) * rate)
            quota.stamp = now
            if quota.tokens < 1.0:
                return WireError(
                    code="quota",
                    message=f"agent {_agent_label(token)} is over its request rate on this"
                    f" replica (agent_rate_per_s={rate:g}, agent_burst={self.burst:g});"
                    f" send it again in {(1.0 - quota.tokens) / rate:.3f} s or later",
                    retryable=True,
                )
            quota.tokens -= 1.0
        return quota

    def _prune(self, now: float) -> None:
        """Forget the agents with nothing in flight and a full bucket (they are as new)."""
        self._next_prune = now + 1.0
        rate = self.rate_per_s or 0.0
        full = self.burst
        for token, quota in list(self._quotas.items()):
            if quota.in_flight == 0 and (
                not rate or quota.tokens + (now - quota.stamp) * rate >= full
            ):
                del self._quotas[token]
