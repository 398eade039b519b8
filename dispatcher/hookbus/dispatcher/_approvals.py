"""Approvals: a handler's ``ask_user`` result becomes a durable approval suspension.

amplifier-core's `HookResult` carries the question (`approval_prompt`), the choices
(`approval_options`, default ``["Allow", "Deny"]``), how long to wait (`approval_timeout`,
seconds) and what to do then (`approval_default`). hookbus turns that into a suspension
whose metadata carries them; the emit waits for an `ApprovalAnswer` and returns continue or
deny.

**Which answers allow.** The options a handler lists in `approval_allow_options` (hookbus's
field), else those starting with "allow" (any case); every other option denies. A question
whose options offer no allowing answer is denied without asking anyone (the reason says so,
and a warning is logged): a made-up refusal is never reported as a human's.

**Every asker is asked.** When several handlers answer ``ask_user`` for one call, each
handler's question is asked (or allowed by that handler's own grant), one after the other in
priority order: the first refusal denies, and the call goes on only when every question was
allowed (`joined_decision`).

**What ends a wait.** The approval's own `approval_timeout` applies `approval_default` and
closes the approval. The caller's deadline (``emit(..., timeout_s=...)``) ending the wait
first is not the human's silence: the call is denied and the approval stays pending, so a
retry of the call (same idempotency key) gets its answer.

**One approval per call and asker.** The label is derived from the call: event, agent, session,
handler, the call's id (the caller's idempotency key, else the emit's own random id) and
its data (without the timestamp). A retry of the same call (same key, e.g. after a lost
reply or a dispatcher restart) finds its approval and its answer and is never asked twice;
a new call, even an identical one, asks anew; a decided approval (answered, cancelled,
timed out) never decides another call, and a key reused for other data does not reuse the
answer. An answer that won the compare-and-set is applied whatever the clock says: on
timeout the approval is cancelled, and if that cancel loses to an answer, the answer wins.

**"Allow always"** stores an `ApprovalGrant` in `APPROVALS_BUCKET` under `grant_key`
(agent, session, event, handler, tool). It allows every later call of that tool **with any
input** by the same agent in the same session when the same handler asks (another
handler's question about the same call is still asked), until the bucket's TTL (24 h by
default) or until revoked (`Approvals.revoke_grants`, ``hookbus approvals revoke``). Only
an "Allow always" that allows stores one. A call without a session id is never remembered:
"Allow always" then allows that call only, and the reason says so.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import time
from typing import Any, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from hookbus.schemas import (
    APPROVAL_DEFAULT_OPTIONS,
    AlreadySettledError,
    ApprovalAnswer,
    ApprovalGrant,
    BadRequestError,
    HookbusError,
    HookResult,
    ResolutionRejectedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionRecord,
    SuspensionTimeoutError,
    approval_answer_key,
    approvals_bucket_config,
    decode,
    encode,
    grant_key,
    parse_grant_key,
)
from hookbus.schemas import _telemetry_names as tn

from ._consumers import watch_keys
from ._kv import kv_retry, open_bucket, release_consumer
from ._suspensions import Suspensions

__all__ = [
    "APPROVAL_LABEL_PREFIX",
    "ApprovalGrant",
    "Approvals",
    "Grants",
    "allowing_options",
    "allows",
    "approval_label",
    "is_allow",
    "joined_decision",
]

log = logging.getLogger("hookbus.dispatcher")

T = TypeVar("T")

APPROVAL_LABEL_PREFIX = "approval:"
"""Every approval suspension's label starts with this (``hookbus approvals`` lists them)."""

_MIN_READ_S = 0.5
"""A grant read gets at least this many seconds, even for an approval with a shorter timeout."""

_TIMED_OUT = "timed out after "
"""How the cancel reason of an approval closed by its timeout starts."""

NO_ALLOWING_OPTION = "offer no allowing answer"
"""Words of the reason of a deny decided because none of a question's options allows."""

CALLERS_DEADLINE = "the caller's deadline ended the wait before an answer"
"""How the reason of a deny decided by the caller's deadline (not the approval's own
timeout) starts; the approval stays pending."""


def is_allow(choice: str) -> bool:
    """Whether an approval choice allows the call by the default rule: it starts with
    "allow", any case ("Allow", "Allow once", "Allow always"). A handler's
    `HookResult.approval_allow_options` replaces this rule for its question."""
    return choice.strip().lower().startswith("allow")


def allows(choice: str, allow_options: list[str] | None) -> bool:
    """Whether `choice` allows the call: it is one of `allow_options` (exact text), or,
    when those are None, it passes `is_allow`."""
    return is_allow(choice) if allow_options is None else choice in allow_options


def allowing_options(options: list[str], allow_options: list[str] | None) -> list[str]:
    """The offered `options` that allow (see `allows`), in their order; empty when no
    answer could allow."""
    return [o for o in options if allows(o, allow_options)]


def _is_always(choice: str) -> bool:
    return choice.strip().lower() == "allow always"


MAX_APPROVAL_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest approval wait, in seconds (a handler's `approval_timeout` is clamped to it)."""


def _clamp(timeout_s: float | None) -> float | None:
    """A handler's `approval_timeout` within [0, `MAX_APPROVAL_TIMEOUT_S`] (NaN: 0)."""
    if timeout_s is None:
        return None
    if not timeout_s >= 0:  # negative or NaN
        return 0.0
    return min(float(timeout_s), MAX_APPROVAL_TIMEOUT_S)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def approval_label(event: str, data: dict[str, Any], handler: str, *, call_id: str) -> str:
    """The label of the approval of one call: ``approval:<32 hex digits>``.

    A digest of the event, ``data["agent_id"]``, ``data["session_id"]``, the handler, the
    call's id (`call_id`: the caller's idempotency key, else the emit's own id) and the
    data without ``timestamp``. Same call (a retry) -> same label; another call id or
    other data -> another label.
    """
    stable = {k: v for k, v in data.items() if k != "timestamp"}
    agent, session = _text(data.get("agent_id")), _text(data.get("session_id"))
    digest = hashlib.sha256(encode([event, agent, session, handler, call_id, stable]))
    return f"{APPROVAL_LABEL_PREFIX}{digest.hexdigest()[:32]}"


class Grants:
    """The "Allow always" grants in `APPROVALS_BUCKET` (see the module docstring)."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def find(
        self, agent_id: str | None, session_id: str, event: str, handler: str, tool: str | None,
        *, budget_s: float,
    ) -> ApprovalGrant | None:  # fmt: skip
        """The grant for this scope, or None (none, or a value that does not match its key).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
            BadRequestError: the scope cannot be a key (too long).
        """
        key = grant_key(agent_id, session_id, event, handler, tool)

        async def get() -> bytes | None:
            try:
                entry = await self._kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # also deleted (revoked)
                return None
            return entry.value or None

        value = await kv_retry(get, deadline_s=budget_s, what=f"reading grant {key}")
        return None if value is None else self._valid(key, value)

    async def put(self, grant: ApprovalGrant, *, budget_s: float) -> None:
        """Store `grant` (idempotent).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
            BadRequestError: no session id, or the scope is too long for a key.
        """
        key = self.key(grant)
        await kv_retry(
            lambda: self._kv.put(key, encode(grant)), deadline_s=budget_s, what=f"storing {key}"
        )

    @staticmethod
    def key(grant: ApprovalGrant) -> str:
        """The `grant_key` of `grant`."""
        return grant_key(grant.agent_id, grant.session_id, grant.event, grant.handler, grant.tool)

    async def list(
        self, *, agent_id: str | None = None, session_id: str | None = None,
        event: str | None = None, handler: str | None = None, tool: str | None = None,
        budget_s: float = 15.0,
    ) -> builtins.list[ApprovalGrant]:  # fmt: skip
        """Every live grant matching the filters (None matches anything), oldest first.

        A value that does not decode or does not match its key is skipped and logged.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
        """
        wanted = {"agent_id": agent_id, "session_id": session_id, "event": event,
                  "handler": handler, "tool": tool}  # fmt: skip
        grants = [
            g for g in await kv_retry(self._read_all, deadline_s=budget_s, what="listing grants")
            if all(v is None or getattr(g, k) == v for k, v in wanted.items())
        ]  # fmt: skip
        return sorted(grants, key=lambda g: g.granted_at)

    async def revoke(self, grant: ApprovalGrant | str, *, budget_s: float = 15.0) -> None:
        """Revoke one grant (an `ApprovalGrant` or its key); revoking none is no error.

        Raises:
            BadRequestError: `grant` is a string that is not a grant key.
            HookbusTimeoutError: JetStream stayed unavailable for `budget_s` seconds.
        """
        key = grant if isinstance(grant, str) else self.key(grant)
        parse_grant_key(key)  # a foreign key is refused, not deleted
        await kv_retry(lambda: self._kv.delete(key), deadline_s=budget_s, what=f"revoking {key}")

    async def _read_all(self) -> builtins.list[ApprovalGrant]:
        watcher = await watch_keys(self._kv, ">", ignore_deletes=True)
        out: builtins.list[ApprovalGrant] = []
        try:
            while True:
                entry = await watcher.updates(timeout=5)
                if entry is None:
                    return out
                if entry.value:
                    grant = self._valid(entry.key, entry.value)
                    if grant is not None:
                        out.append(grant)
        finally:
            await release_consumer(watcher._sub)

    @classmethod
    def _valid(cls, key: str, value: bytes) -> ApprovalGrant | None:
        try:
            grant = decode(value, ApprovalGrant)
            if cls.key(grant) == key:
                return grant
            problem = "it does not match its key"
        except HookbusError as exc:
            problem = str(exc)
        log.warning("ignoring the grant under %r in the approvals bucket: %s", key[:200], problem)
        return None


class Approvals:
    """Turns ``ask_user`` results into answers, through `Suspensions` (see the module
    docstring). Made by `HookDispatcher.start`.

    Args:
        suspensions: the suspension store the approvals wait in.
        grants: the grants bucket.
        grant_read_s: longest time, in seconds, a grant read or write retries through a
            JetStream leader election (a read: never longer than the approval's own
            timeout, but at least 0.5 s); after that the human is asked (a read) or the
            grant is not stored and the reason says so (a write).
    """

    def __init__(
        self, suspensions: Suspensions, grants: KeyValue, *, grant_read_s: float = 15.0
    ) -> None:
        self._suspensions = suspensions
        self.grants = Grants(grants)
        """The "Allow always" grants: list, revoke."""
        self._grant_read_s = grant_read_s

    @classmethod
    async def open(cls, nc: NATS, suspensions: Suspensions, *, replicas: int = 1) -> Approvals:
        """Open (create if absent) the grants bucket."""
        kv = await open_bucket(nc, approvals_bucket_config(replicas=replicas))
        return cls(suspensions, kv)

    async def decide(
        self, event: str, result: HookResult, *, call_id: str, wait_s: float | None = None
    ) -> HookResult:
        """Ask, wait, and fold the answer into `result`: continue or deny.

        Args:
            event: the emitted event.
            result: one folded ``ask_user`` result (``decided_by`` is the asking handler).
            call_id: the call's id: the caller's idempotency key, else the emit's own id.
            wait_s: seconds the caller still waits (its deadline), None: no deadline. When it
                ends the wait before the approval's own timeout, the call is denied and the
                approval stays pending; it never applies `approval_default`.
        Returns:
            `result` with ``action`` continue or deny and the ``reason``: a grant, the
            human's choice, the timeout's `approval_default`, a cancel (deny), options that
            offer no allowing answer (deny, nobody asked) or the caller's deadline (deny).
        Raises:
            SuspensionAbortedError: the wait was aborted (a draining dispatcher); the approval
                stays pending and a retry with the same call id resumes it.
            HookbusError: the suspension store failed (e.g. `HookbusTimeoutError`: JetStream
                stayed unavailable); a grant store failure only means the human is asked.
        """
        started = time.monotonic()
        handler = result.decided_by or "?"
        result = msgspec.structs.replace(result, approval_timeout=_clamp(result.approval_timeout))
        options = list(result.approval_options or APPROVAL_DEFAULT_OPTIONS)
        allowing = allowing_options(options, result.approval_allow_options)
        if not allowing:
            return self._no_allowing_option(event, result, handler, options)
        budget = min(
            x for x in (self._grant_read_s, result.approval_timeout, wait_s) if x is not None
        )
        granted = await self._granted(event, result, handler, budget_s=max(budget, _MIN_READ_S))
        if granted is not None:
            return granted
        data = _call_data(result)
        store = self._suspensions.for_agent(_text(data.get("agent_id")))
        label = approval_label(event, data, handler, call_id=call_id)
        got = await store.get(label)  # a retry of this call finds its approval
        if got is not None:
            decided = await self._from_record(result, got[0], options, store)
            if decided is not None:
                return decided
        remaining = _approval_left(result.approval_timeout, started, got[0] if got else None)
        caller_left = None if wait_s is None else max(0.0, wait_s - (time.monotonic() - started))
        cut = caller_left is not None and (remaining is None or caller_left < remaining)
        metadata = _metadata(event, result, handler, options, allowing)
        try:
            answer = await self._wait(store, label, metadata, caller_left if cut else remaining)
        except SuspensionTimeoutError:
            if cut:
                return await self._callers_deadline(result, label, options, store)
            return await self._timed_out(result, label, options, store)
        except SuspensionCancelledError as exc:
            return self._cancelled(result, exc.reason)
        return await self._answered(result, answer, options, store, label)

    def _no_allowing_option(
        self, event: str, result: HookResult, handler: str, options: list[str]
    ) -> HookResult:
        """The deny of a question none of whose `options` allows (nobody is asked: every
        answer would deny, and a human's refusal must not be made up); logged as a warning."""
        allow_options = result.approval_allow_options
        rule = (
            "none starts with 'allow' and no approval_allow_options were given"
            if allow_options is None
            else f"none is in approval_allow_options {allow_options}"
        )
        log.warning(
            "handler %r asked about %r with options %s, which %s (%s): denied without asking",
            handler, event, options, NO_ALLOWING_OPTION, rule,
        )  # fmt: skip
        return self._answer(
            result, allow=False,
            reason=f"handler {handler!r} asked with options {options}, which"
            f" {NO_ALLOWING_OPTION} ({rule}): denied without asking anyone",
        )  # fmt: skip

    async def _granted(
        self, event: str, result: HookResult, handler: str, *, budget_s: float
    ) -> HookResult | None:
        """The allow of an "Allow always" grant for this handler's question, or None (no
        session, no grant, or the grants bucket failed: then the human is asked)."""
        data = _call_data(result)
        tool = _text(data.get("tool_name"))
        session, agent = _text(data.get("session_id")), _text(data.get("agent_id"))
        if session is None:
            return None
        try:
            grant = await self.grants.find(agent, session, event, handler, tool, budget_s=budget_s)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            # unavailable or refused: ask the human, never allow by accident
            log.warning("grant read failed (%s); asking instead", exc)
            return None
        if grant is None:
            return None
        return self._answer(
            result, allow=True,
            reason=f"allowed always for {tool or 'this call'} in session {session}"
            f" (granted by {grant.label or 'an earlier approval'})",
        )  # fmt: skip

    @staticmethod
    async def _wait(
        store: Suspensions, label: str, metadata: dict[str, Any], timeout_s: float | None
    ) -> ApprovalAnswer:
        """Create (or take over) the approval `label` and wait `timeout_s` seconds (None:
        no limit) for its answer. Raises as `Suspensions.hook`."""
        options = metadata["options"]
        return await store.hook(
            label,
            payload=ApprovalAnswer,
            metadata=metadata,
            timeout_s=timeout_s,
            schema={
                "type": "object",
                "properties": {"choice": {"enum": options}},
                "required": ["choice"],
            },
            shared=True,  # a retried call (same call id) takes over the same approval
            kind="approval",
            span_attributes={
                tn.HANDLER: metadata["handler"],
                tn.GEN_AI_TOOL_NAME: metadata["tool_name"] or "",
                tn.GEN_AI_CONVERSATION_ID: metadata["session_id"] or "",
            },
        )

    async def _callers_deadline(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """The caller's deadline ended the wait: an answer that landed meanwhile decides;
        otherwise deny and leave the approval pending (never its default: the human was not
        silent for the approval's time), so a retry of the call gets the answer."""
        try:
            got = await store.get(label)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("approval %r could not be read at the caller's deadline (%s)", label, exc)
            got = None
        decided = None if got is None else await self._from_record(result, got[0], options, store)
        if decided is not None:
            return decided
        return self._answer(
            result, allow=False,
            reason=f"{CALLERS_DEADLINE}; the approval stays pending: the same call retried"
            " (same idempotency key) gets its answer",
        )  # fmt: skip

    async def _timed_out(
        self, result: HookResult, label: str, options: list[str], store: Suspensions
    ) -> HookResult:
        """Close the approval; if an answer won the race, it decides, not the clock."""
        reason = f"{_TIMED_OUT}{result.approval_timeout}s; default {result.approval_default}"
        try:
            await store.cancel_hook(label, reason=f"{reason} applied")
        except AlreadySettledError:
            got = await store.get(label)
            decided = (
                None if got is None else await self._from_record(result, got[0], options, store)
            )
            if decided is not None:
                return decided
            log.warning("approval %r settled but unreadable after its timeout", label)
        except SuspensionNotFoundError:
            log.warning("approval %r vanished at its timeout; default applied", label)
        except (HookbusError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning(
                "approval %r could not be closed at its timeout (%s); default %s applied and a"
                " later answer is ignored by this call", label, exc, result.approval_default,
            )  # fmt: skip
        return self._answer(result, allow=result.approval_default == "allow", reason=reason)

    def _cancelled(self, result: HookResult, reason: str | None) -> HookResult:
        if reason is not None and reason.startswith(_TIMED_OUT):  # closed by its own timeout
            return self._answer(
                result,
                allow=result.approval_default == "allow",
                reason=reason.removesuffix(" applied"),
            )
        return self._answer(result, allow=False, reason=f"approval cancelled: {reason}")

    async def _from_record(
        self, result: HookResult, record: SuspensionRecord, options: list[str], store: Suspensions
    ) -> HookResult | None:
        """The decision a settled approval record holds (None while it is pending)."""
        if record.status == "cancelled":
            return self._cancelled(result, record.reason)
        if record.status != "resolved":
            return None
        try:
            answer = msgspec.convert(record.resolution, ApprovalAnswer)
        except msgspec.ValidationError as exc:
            return self._answer(result, allow=False, reason=f"the stored answer is invalid: {exc}")
        return await self._answered(result, answer, options, store, record.label)

    async def _answered(
        self,
        result: HookResult,
        answer: ApprovalAnswer,
        options: list[str],
        store: Suspensions,
        label: str,
    ) -> HookResult:
        choice = answer.choice
        if choice not in options:
            return self._answer(
                result, allow=False, reason=f"answer {choice!r} is not one of the options {options}"
            )
        problem = await self._unproven(answer, store, label)
        if problem is not None:
            log.warning("approval %r: answer refused: %s", label, problem)
            return self._answer(result, allow=False, reason=f"answer refused: {problem}")
        allow = allows(choice, result.approval_allow_options)
        reason = f"{answer.answered_by} chose {choice!r}"
        if allow and _is_always(choice) and _text(_call_data(result).get("session_id")) is None:
            reason += "; allowed this call only: the call has no session id to remember it for"
        decided = self._answer(result, allow=allow, reason=reason)
        return msgspec.structs.replace(decided, approved_by=answer.answered_by)

    async def _unproven(self, answer: ApprovalAnswer, store: Suspensions, label: str) -> str | None:
        """Why `answer` is not an approver's (None: its proof holds the same choice).

        The proof is the key ``<agent>.<label>.<approver>``, which only that approver's
        NATS user may write: a record resolved by anyone else (the agent itself included)
        carries no matching proof and decides nothing.
        """
        if not answer.answered_by:
            return "it names no approver"
        try:
            key = approval_answer_key(label, store.agent_id, answer.answered_by)
        except BadRequestError as exc:
            return str(exc)
        kv = store.records.kv

        async def get() -> bytes | None:
            try:
                return (await kv.get(key)).value or None
            except nats.js.errors.KeyNotFoundError:
                return None

        value = await kv_retry(get, deadline_s=self._grant_read_s, what=f"reading {key[:80]}")
        if value is None:
            return f"no answer of approver {answer.answered_by!r} is on record"
        try:
            proof = decode(value, ApprovalAnswer)
        except HookbusError as exc:
            return f"the answer of approver {answer.answered_by!r} is unreadable: {exc}"
        if proof.choice != answer.choice or proof.answered_by != answer.answered_by:
            return f"{answer.answered_by!r} answered {proof.choice!r}, not {answer.choice!r}"
        return None

    async def answer(
        self, label: str, choice: str, *, agent_id: str | None, approver: str
    ) -> ApprovalAnswer:
        """Answer the pending approval `label` of agent `agent_id` as `approver`.

        First the answer proof is created under ``<agent>.<label>.<approver>`` (the key
        only this approver's NATS user may write), then the approval record is resolved
        with it (compare-and-set: one answer wins). An "Allow always" that won stores the
        grant (agent from the record's key; session, event, handler, tool from the record).

        Returns:
            The answer that decided the approval.
        Raises:
            SuspensionNotFoundError: no approval with this label for this agent.
            AlreadySettledError: it was answered, cancelled or timed out first, or this
                approver already answered it otherwise.
            ResolutionRejectedError: `choice` is not one of its options.
            BadRequestError: `approver` is empty or too long.
            HookbusTimeoutError: JetStream stayed unavailable (or this client's NATS user
                may not write the proof: a refused publish is never acknowledged).
        """
        store = self._suspensions.for_agent(agent_id)
        got = await store.get(label)
        if got is None or got[0].metadata.get("kind") != "approval":
            raise SuspensionNotFoundError(f"no approval {label!r} for agent {agent_id!r}")
        record = got[0]
        if record.status != "pending":
            raise AlreadySettledError(f"approval {label!r} is already {record.status}")
        options = list(record.metadata.get("options") or APPROVAL_DEFAULT_OPTIONS)
        if choice not in options:
            raise ResolutionRejectedError(f"choice {choice!r} is not one of the options {options}")
        answer = ApprovalAnswer(choice=choice, answered_by=approver, answered_at=time.time())
        key = approval_answer_key(label, agent_id, approver)
        kv = store.records.kv

        async def prove() -> None:
            try:
                await kv.create(key, encode(answer))
            except nats.js.errors.KeyWrongLastSequenceError:  # answered before (or a retry)
                earlier = decode((await kv.get(key)).value or b"{}", ApprovalAnswer)
                if earlier.choice != choice:
                    raise AlreadySettledError(
                        f"{approver} already answered {label!r} with {earlier.choice!r}"
                    ) from None

        await kv_retry(prove, deadline_s=self._grant_read_s, what=f"writing {key[:80]}")
        await store.resolve_hook(label, msgspec.to_builtins(answer))
        if _record_allows(record, choice) and _is_always(choice):
            await self._grant(record, answer, agent_id, label)
        return answer

    async def _grant(
        self, record: SuspensionRecord, answer: ApprovalAnswer, agent_id: str | None, label: str
    ) -> None:
        meta = record.metadata
        session = _text(meta.get("session_id"))
        if session is None:
            return  # nothing to remember it for; the dispatcher's reason says so
        grant = ApprovalGrant(
            agent_id=agent_id, session_id=session, event=str(meta.get("event") or "?"),
            handler=str(meta.get("handler") or "?"), tool=_text(meta.get("tool_name")),
            choice=answer.choice, label=label, granted_at=time.time(),
        )  # fmt: skip
        await self.grants.put(grant, budget_s=self._grant_read_s)

    @staticmethod
    def _answer(result: HookResult, *, allow: bool, reason: str) -> HookResult:
        """The decided result: an allow goes on with the call's data (``continue`` with
        the chained data, as a plain continue returns it); a deny keeps the asking
        handler's own data, as a deny does."""
        if not allow:
            return msgspec.structs.replace(result, action="deny", reason=reason)
        return msgspec.structs.replace(
            result, action="continue", reason=reason, data=result.chained_data
        )


def joined_decision(asks: list[HookResult], decisions: list[HookResult]) -> HookResult:
    """One emit's decision from the decisions of its askers' questions.

    Args:
        asks: every ``ask_user`` of the emit, in priority order (`Fold.asks`).
        decisions: the decisions of the first ``len(decisions)`` of them, asked one after
            the other; the last is a deny or every ask was allowed.
    Returns:
        One asker: its decision. Several: amplifier-core's shape, the first ask's fields
        (as amplifier-core returns the first ``ask_user``). A deny: ``decided_by`` the
        handler whose question was refused, `reason` and ``approved_by`` of that refusal,
        the first ask's own data (a deny keeps it). Every question allowed: continue with
        the chained data, ``decided_by`` the first asker, the reasons as ``"<handler>:
        <reason>"`` joined by ``"; "``, ``approved_by`` every approver who allowed one (in
        order, once each, joined by ``", "``; None when grants allowed them all).
    """
    first, last = decisions[0], decisions[-1]
    if len(asks) == 1 or (len(decisions) == 1 and last.action != "continue"):
        return last
    if last.action != "continue":
        return msgspec.structs.replace(
            first, action="deny", data=asks[0].data, reason=last.reason,
            decided_by=last.decided_by, approved_by=last.approved_by, failures=last.failures,
        )  # fmt: skip
    approvers = list(dict.fromkeys(d.approved_by for d in decisions if d.approved_by))
    return msgspec.structs.replace(
        first,
        reason="; ".join(f"{d.decided_by}: {d.reason}" for d in decisions),
        approved_by=", ".join(approvers) or None,
        failures=last.failures,
    )


def _approval_left(
    timeout_s: float | None, started: float, record: SuspensionRecord | None
) -> float | None:
    """Seconds the approval still waits (None: no limit): `timeout_s` from `started` (a
    `time.monotonic` reading), and no longer than a resumed `record`'s own timeout from its
    creation (a retry does not extend the approval it resumes)."""
    if timeout_s is None:
        return None
    left = max(0.0, timeout_s - (time.monotonic() - started))
    if record is not None:
        left = min(left, max(0.0, record.created_at + timeout_s - time.time()))
    return left


def _metadata(
    event: str, result: HookResult, handler: str, options: list[str], allowing: list[str]
) -> dict[str, Any]:
    """The approval record's metadata (an `ApprovalMetadata`, every key written) for the
    question `result` of `handler` (its ``approval_timeout`` already clamped)."""
    data = _call_data(result)
    tool = _text(data.get("tool_name"))
    return {
        "kind": "approval",
        "prompt": result.approval_prompt or f"Allow {tool or 'this call'} ({event})?",
        "options": options,
        "allow_options": allowing,
        "timeout_s": result.approval_timeout,
        "default": result.approval_default,
        "handler": handler,
        "event": event,
        "tool_name": tool,
        "session_id": _text(data.get("session_id")),
        "agent_id": _text(data.get("agent_id")),
        **_shown_data(data),
    }


APPROVAL_DATA_MAX_BYTES = 16 * 1024
"""Largest call data an approval record carries whole (its JSON, bytes); larger data is
shown as the start of its JSON text."""


def _record_allows(record: SuspensionRecord, choice: str) -> bool:
    """Whether `choice` allows by the approval record's ``allow_options`` (a record
    written without them: the default rule, `is_allow`)."""
    allowing = record.metadata.get("allow_options")
    if isinstance(allowing, list):
        return choice in allowing
    return is_allow(choice)


def _shown_data(data: dict[str, Any]) -> dict[str, Any]:
    """What an approval's metadata shows of the call's data (what the handlers saw, after
    any data chaining): ``{"data": data}`` when its JSON is at most
    `APPROVAL_DATA_MAX_BYTES`, else ``{"data": None, "data_preview": <the JSON's first
    APPROVAL_DATA_MAX_BYTES characters>, "data_bytes": <its full size>}``."""
    try:
        text = encode(data)
    except (HookbusError, TypeError):
        return {"data": None}
    if len(text) <= APPROVAL_DATA_MAX_BYTES:
        return {"data": data}
    preview = text[:APPROVAL_DATA_MAX_BYTES].decode("utf-8", "ignore")
    return {"data": None, "data_preview": preview, "data_bytes": len(text)}


def _call_data(result: HookResult) -> dict[str, Any]:
    """The data of the call an ``ask_user`` result is about (the chained data of the emit;
    a result made outside an emit has only its own)."""
    return result.chained_data or result.data or {}
