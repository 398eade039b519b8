"""Where a request goes: the worker instances a requester knows per handler (`Replicas`).

The first request of a call goes to the handler's queue subject (the queue group picks a
replica). Every reply names the worker instance that sent it, and the requester keeps, per
handler, the instances that answered recently (most recent last; at most
`RECENT_INSTANCES`, forgotten after `RECENT_TTL_S`). A further request goes to the instance
subject (`handler_instance_subject`) of the most recently answering instance this call has
not sent to and that has not refused it: a stalled replica stops answering, drops back in
that order, and the hedge reaches a healthy one instead of a coin toss. With no such
instance it goes to the queue subject. An instance subject with no responders (the
instance is gone) is forgotten and the next request is sent at once.

The queue group cannot be steered: NATS gives a request to a replica in the publisher's
own cluster whenever one is subscribed there, stalled or not, so in a supercluster (or
with one replica per site) a hedge to the queue subject meets the same stalled process.
Two things get around it, both learned from the NATS services API (``$SRV.PING`` of the
worker service, whose metadata lists the handlers each instance serves), never on the
emit's path:

- **discovery**: a hedge that finds no instance to go to, and every call that times out
  with no answer at all, asks the workers once (at most every `DISCOVERY_INTERVAL_S`,
  answers gathered for `DISCOVERY_GATHER_S`); each instance that answers is a hedge target
  of the handlers it serves, after the instances that answered calls (a process answers
  the services API even while one of its handlers hangs);
- **suspicion**: a call that times out with no answer at all marks its queue subject
  suspect until `SUSPECT_S` seconds after the last such call; while it is, a call's
  *first* request goes to an instance that answered a call since the first such call was
  sent, else to one a discovery found since (taken in turn), else to the queue subject;
  one made while a discovery is asking waits for its first answer (at most a quarter of
  its budget). An instance sent a request that timed out unanswered is no longer a
  target. Each request is still sent once: a handler not
  declared retry_safe fails by its policy on the calls that met the stall, and the calls
  after them reach a live instance. A suspect chain subject is not used: its steps are
  called one by one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math

from nats.aio.msg import Msg

from hookbus.schemas import (
    BadRequestError,
    chain_instance_subject,
    handler_instance_subject,
    handler_subject,
    parse_served_handlers,
)

from ._route_table import Route

__all__ = [
    "DISCOVERY_GATHER_S",
    "DISCOVERY_INTERVAL_S",
    "RECENT_INSTANCES",
    "RECENT_TTL_S",
    "SUSPECT_S",
    "Discovery",
    "Replicas",
]

RECENT_INSTANCES = 16
"""Worker instances remembered per handler as hedge targets (the most recent answers)."""
RECENT_TTL_S = 60.0
"""Seconds after its last answer an instance is no longer a hedge target."""

DISCOVERY_INTERVAL_S = 2.0
"""Seconds: the shortest interval between two discoveries of the live worker instances."""
DISCOVERY_GATHER_S = 0.5
"""Seconds a discovery's answers are taken (a scatter has no last answer)."""
SUSPECT_S = 30.0
"""Seconds a queue subject stays suspect after a call on it timed out unanswered."""


class Replicas:
    """What a requester knows of the worker instances serving each handler subject: the
    ones that answered, the ones a discovery found, the subjects suspect of a stalled
    replica, and those found without any (see the module docstring). Times are the event
    loop's (seconds)."""

    __slots__ = (
        "_discovery_at",
        "_found_live",
        "_no_replica",
        "_recent",
        "_suspect",
        "_turn",
        "_wanted",
        "found",
    )

    def __init__(self) -> None:
        self._recent: dict[str, dict[str, float]] = {}
        """Per handler subject: instance id -> loop time of its last answer, oldest first."""
        self._found_live: dict[str, dict[str, float]] = {}
        """Per handler subject: instance id -> loop time a discovery found it serving the
        handler, oldest first. Targets after the instances that answered: a process that
        answers the services API may still have that handler hung."""
        self._suspect: dict[str, tuple[float, float]] = {}
        """Per queue subject: loop times of the first and the last call on it that timed
        out unanswered, while it stays suspect (module docstring)."""
        self.found: asyncio.Future[None] | None = None
        """Done when the discovery in flight learned an instance (or its answers ended)."""
        self._wanted: set[str] = set()
        """Handler subjects a discovery was asked for (recorded even if never answered)."""
        self._discovery_at = -math.inf
        self._turn = itertools.count()
        self._no_replica: dict[str, float] = {}
        """Per handler subject: loop time a rechecked call found no replica subscribed."""

    # -- answers -----------------------------------------------------------------------
    def answered(self, subject: str, instance: str, now: float) -> None:
        """Note that `instance` answered a request on handler `subject` at `now`."""
        _note(self._recent, subject, instance, now)
        self._no_replica.pop(subject, None)

    def forget(self, subject: str, instance: str) -> None:
        """`instance` is no longer a target of handler `subject` (gone, or stalled)."""
        for known in (self._recent, self._found_live):
            instances = known.get(subject)
            if instances is not None:
                instances.pop(instance, None)

    def no_replica_at(self, subject: str) -> float:
        """When a rechecked call last found no replica of `subject` subscribed (-inf:
        never, or one answered since)."""
        return self._no_replica.get(subject, -math.inf)

    def found_no_replica(self, subject: str, now: float) -> None:
        """A rechecked call found no replica of `subject` subscribed at `now`."""
        self._no_replica[subject] = now

    # -- suspicion ---------------------------------------------------------------------
    @property
    def any_suspect(self) -> bool:
        """Whether some subject is suspect (else every first request takes its queue
        subject: nothing to look up)."""
        return bool(self._suspect)

    def suspect(self, subject: str, sent_at: float) -> None:
        """Note that a call on queue subject `subject`, sent at `sent_at` (loop time), timed
        out with no answer at all: until `SUSPECT_S` seconds from now its first requests go
        to instances seen alive since the first such call was sent (the replica that took
        it has answered nothing since)."""
        now = asyncio.get_running_loop().time()
        was = self._suspect.get(subject)
        since = was[0] if was is not None and now - was[1] <= SUSPECT_S else sent_at
        self._suspect[subject] = (since, now)
        if len(self._suspect) > 4096:  # a suspicion is an optimisation: forget the oldest
            del self._suspect[next(iter(self._suspect))]

    def suspected(self, subject: str, now: float) -> float | None:
        """When the suspicion on `subject` began (loop time), or None if it is not suspect."""
        was = self._suspect.get(subject)
        if was is None:
            return None
        if now - was[1] > SUSPECT_S:
            del self._suspect[subject]
            return None
        return was[0]

    # -- targets -----------------------------------------------------------------------
    def first(self, route: Route, avoid: set[str], now: float) -> tuple[str, str]:
        """Subject of a call's first request, and the instance it addresses ("" for the
        queue subject): the queue subject, unless it is suspect and an instance was seen
        alive since (then those instances in turn; the one chosen is added to `avoid`)."""
        if not self._suspect:
            return route.subject, ""
        since = self.suspected(route.subject, now)
        if since is None:
            return route.subject, ""
        alive = _since(self._recent.get(route.subject), since) or _since(
            self._found_live.get(route.subject), since
        )
        if not alive:
            return route.subject, ""
        instance = alive[next(self._turn) % len(alive)]
        try:
            subject = handler_instance_subject(route.event, route.name, instance)
        except BadRequestError:
            return route.subject, ""
        avoid.add(instance)
        return subject, instance

    def target(
        self, route: Route, avoid: set[str], now: float, *, chain: bool = False
    ) -> tuple[str, str]:
        """Subject of a further request, and the instance it addresses ("" for the queue
        subject): the instance subject (`chain`: of the chain subject `route.subject`) of
        the most recently answering instance not in `avoid` (then added to it), else of
        the most recently discovered one, else the queue subject."""
        for known in (self._recent, self._found_live):
            instances = known.get(route.subject)
            if not instances:
                continue
            for instance, seen in reversed(instances.items()):
                if now - seen > RECENT_TTL_S:
                    break  # older still from here on
                if instance in avoid:
                    continue
                try:
                    subject = (
                        chain_instance_subject(route.subject, instance)
                        if chain
                        else handler_instance_subject(route.event, route.name, instance)
                    )
                except BadRequestError:  # not an id we can address: never a target
                    continue
                avoid.add(instance)
                return subject, instance
        return route.subject, ""

    def another(self, route: Route, avoid: set[str], now: float) -> bool:
        """Whether an instance of `route` not in `avoid` is known (`target` would pick one)."""
        for known in (self._recent, self._found_live):
            instances = known.get(route.subject)
            if instances and any(
                now - seen <= RECENT_TTL_S and instance not in avoid
                for instance, seen in instances.items()
            ):
                return True
        return False

    # -- discovery ---------------------------------------------------------------------
    def discovery_due(self, subject: str, now: float) -> bool:
        """Note that handler `subject` wants a discovery; whether one is to be sent now
        (none for `DISCOVERY_INTERVAL_S` seconds: then it is taken as sent)."""
        if len(self._wanted) >= 4096:
            self._wanted.clear()
        self._wanted.add(subject)
        if now - self._discovery_at < DISCOVERY_INTERVAL_S:
            return False
        self._discovery_at = now
        return True

    def discovery_sent(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A discovery was sent: `found`, done at its first useful answer (or its end)."""
        found = self.found = loop.create_future()
        return found

    def discovered(self, instance: str, served: list[tuple[str, str]]) -> None:
        """A discovery's answer: `instance` is alive and serves the handlers `served`."""
        now = asyncio.get_running_loop().time()
        for event, name in served:
            try:
                subject = handler_subject(event, name)
            except BadRequestError:
                continue
            if subject in self._wanted or subject in self._recent:
                _note(self._found_live, subject, instance, now)
                found = self.found
                if found is not None and not found.done():
                    found.set_result(None)


class Discovery:
    """The answers to one ``$SRV.PING`` of the worker service: each instance that answers
    becomes a hedge target of the handlers its metadata lists (those the requester calls)."""

    __slots__ = ("replicas",)

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas

    def put(self, token: str, msg: Msg) -> None:
        try:
            body = json.loads(msg.data)
            instance = str(body["id"])
            served = parse_served_handlers((body.get("metadata") or {}).get("handlers"))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return  # not a services API answer: nothing learned
        self.replicas.discovered(instance, served)


def _note(known: dict[str, dict[str, float]], subject: str, instance: str, now: float) -> None:
    """Record `instance` for handler `subject` at `now` in `known` (most recent last, at
    most `RECENT_INSTANCES` per handler: the least recent one goes)."""
    instances = known.get(subject)
    if instances is None:
        instances = known[subject] = {}
    elif instances.pop(instance, None) is None and len(instances) >= RECENT_INSTANCES:
        del instances[next(iter(instances))]
    instances[instance] = now


def _since(instances: dict[str, float] | None, since: float) -> list[str]:
    """The instances of `instances` recorded at or after `since` (loop time)."""
    return [i for i, seen in instances.items() if seen >= since] if instances else []
