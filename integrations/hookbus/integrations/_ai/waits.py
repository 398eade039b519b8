"""One ``ai.hook`` call answered from the suspensions bucket: the store's wait on the
record, ``ai``'s ``HookEvent``s on the run's stream, what ``ai.resolve_hook`` /
``ai.cancel_hook`` / ``ai.defer_hook`` did to the run's registry carried to the record,
and a tool approval's proofs applied while it waits (its timeout ends it with the
default)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ai
import pydantic
from ai.agents import runtime as ai_runtime
from ai.types import messages as ai_messages
from ai.types import tools as ai_tools
from nats.errors import Error as NatsError

from hookbus._core.deadlines import Deadline
from hookbus._core.tasks import stop_task
from hookbus.dispatcher import RunScope
from hookbus.dispatcher.tracing import created_by, creating_traceparent
from hookbus.schemas import (
    AlreadySettledError,
    HookbusError,
    ResolutionRejectedError,
    SuspensionAbortedError,
    SuspensionCancelledError,
    SuspensionNotFoundError,
    SuspensionTimeoutError,
)
from hookbus.schemas import telemetry as tn

from .labels import AI_METADATA_KEY, AI_TRACE_KEY, HooksSettings, M, as_json, is_tool_approval, log
from .proofs import ToolApprovalProofs
from .run_claims import RunClaims, run_in_progress
from .tool_approvals import TIMED_OUT

__all__ = ["AIHookWaits"]

_SETTLE_S = 5.0
"""Seconds a timed-out tool approval waits for the answer that won the race against its
close (it returns at once: the answer is stored)."""

_ABORT_POLL_S = 0.02
_ABORT_DEADLINE_S = 15.0


class _Wait:
    """One hook this process waits on. ``abort`` gets the exception to raise instead of
    the resolution (None: ``ai.HookDeferredException`` for the pending part)."""

    __slots__ = ("abort",)

    def __init__(self) -> None:
        self.abort: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )


class AIHookWaits:
    """The hooks this process waits on for the `HookbusHooks` whose settings are
    `settings` (see `HookbusHooks.hook`), and the exceptions to raise in the next ones."""

    def __init__(
        self, settings: HooksSettings, proofs: ToolApprovalProofs, claims: RunClaims
    ) -> None:
        self._settings = settings
        self._proofs = proofs
        self._claims = claims
        self._waits: dict[str, _Wait] = {}
        self._stashed: dict[str, BaseException] = {}

    @property
    def labels(self) -> list[str]:
        """The labels this process waits on now."""
        return list(self._waits)

    def __contains__(self, label: object) -> bool:
        """Whether this process waits on `label` now."""
        return label in self._waits

    def raise_instead(self, label: str, exc: BaseException) -> None:
        """Make the wait on `label` in this process raise `exc` (the record stays pending);
        if nothing waits on it here yet, the next hook of that label raises it."""
        wait = self._waits.get(label)
        if wait is not None and not wait.abort.done():
            wait.abort.set_result(exc)
        else:
            self._stashed[label] = exc

    def abort(self, label: str) -> bool:
        """Stop this process's wait on `label` (``ai.HookDeferredException``); False if
        nothing here waits on it."""
        wait = self._waits.get(label)
        if wait is None or wait.abort.done():
            return False
        wait.abort.set_result(None)
        return True

    async def wait(
        self,
        label: str,
        *,
        payload: type[M],
        metadata: dict[str, Any] | None,
        tool_call_id: str | None,
        registry: ai.HookRegistry | None,
        timeout_s: float | None,
    ) -> M:
        """``ai.hook(label, payload=...)`` answered from the record; see `HookbusHooks.hook`
        (the same errors)."""
        store = self._settings.suspensions
        metadata = dict(metadata or {})
        stashed = self._stashed.pop(label, None)
        if stashed is not None:
            raise stashed
        if registry is not None:  # pre-registered the ai way: into the run's registry
            local = registry._pending_resolutions.pop(label, None)
            if isinstance(local, BaseException):
                raise local
            if local is not None:
                with contextlib.suppress(AlreadySettledError):  # a resolution there wins
                    await store.resolve_hook(label, as_json(local))
        part: ai_messages.HookPart[Any] = ai_messages.HookPart(
            hook_id=label,
            hook_type=payload.__name__,
            status="pending",
            metadata=metadata,
            tool_call_id=tool_call_id,
        )
        stored = {
            **metadata,
            AI_METADATA_KEY: {"hook_type": payload.__name__, "tool_call_id": tool_call_id},
        }
        run = RunScope.current()
        if run is not None:  # never take a hook over from a live process running this run
            found = await store.get(label)
            owner = None if found is None else await self._claims.live_owner(found[0], run.run_id)
            if owner is not None:
                raise run_in_progress(run.run_id, label, owner)
        approval = is_tool_approval(label, payload)
        if approval:  # a proof written before the hook: pre-registered, taken at once
            try:
                await self._proofs.apply(label)
            except (HookbusError, NatsError) as exc:
                log.info("tool approval %r: proofs not read (%r)", label, exc)
        found = await store.get(label)
        waiting_value = (
            found is not None and found[0].status == "resolved" and not found[0].consumed
        )
        # the run (or emit) that created the suspension: kept with the record, so a wait
        # resumed later (another run, another process) links to it
        creator = _creator(found) or creating_traceparent()
        if creator is not None:
            stored[AI_METADATA_KEY][AI_TRACE_KEY] = creator
        run_id = run.run_id if run is not None else None
        span_attributes = {  # shared by the run and a run resuming it: found by attribute
            tn.GEN_AI_AGENT_ID: store.agent_id,
            tn.RUN_ID: run_id,
            tn.GEN_AI_CONVERSATION_ID: self._settings.session_id or run_id,
        }
        return await self._wait(
            part, metadata, payload, stored, registry, timeout_s, approval=approval,
            announce=not waiting_value, creator=creator, span_attributes=span_attributes,
        )  # fmt: skip

    async def _wait(
        self,
        part: ai_messages.HookPart[Any],
        metadata: dict[str, Any],
        payload: type[M],
        stored: dict[str, Any],
        registry: ai.HookRegistry | None,
        timeout_s: float | None,
        *,
        approval: bool,
        announce: bool,
        creator: str | None,
        span_attributes: dict[str, Any],
    ) -> M:
        """Wait on the record of `part` (created with the metadata `stored` if absent) until
        it is settled, this wait is aborted, or the run's registry settles it; ``pending``
        on the run's stream once others can resolve it (`announce`: no resolution is
        waiting already). The store's wait links to the run that created the record
        (`creator`, a ``traceparent``)."""
        label = part.hook_id
        rt = _runtime()
        wait = _Wait()
        self._waits[label] = wait
        local_future: asyncio.Future[dict[str, Any]] | None = None
        if registry is not None and rt is not None:  # ai.resolve_hook & co. find it
            local_future = asyncio.get_running_loop().create_future()
            registry._live_hooks[label] = (local_future, metadata, rt)
        with created_by(creator):  # the wait's span links to the creator (the task copies it)
            kv = asyncio.ensure_future(
                self._settings.suspensions.hook(
                    label,
                    payload=None if approval else payload,
                    metadata=stored,
                    timeout_s=timeout_s,
                    schema=payload.model_json_schema() if approval else None,
                    span_attributes=span_attributes,
                )
            )
        pump = asyncio.ensure_future(self._proofs.pump(label)) if approval else None
        instead: BaseException | None = None  # what an abort raises
        cancelled_locally = False
        announced = False  # pending was emitted (ai: not for a resolution already there)
        try:
            if announce and rt is not None and await self._until_waiting(label, kv):
                await rt.put_hook(part)  # once other services can resolve it
                announced = True
            sources: set[asyncio.Future[Any]] = {kv, wait.abort}
            if local_future is not None:
                sources.add(local_future)
            done, _ = await asyncio.wait(sources, return_when=asyncio.FIRST_COMPLETED)
            if kv not in done:
                if local_future is not None and local_future in done:
                    instead, cancelled_locally = await self._carry(label, local_future, kv)
                else:
                    instead = wait.abort.result()
                    await self._abort(label, kv)
                await asyncio.wait({kv})
            proven = (
                (lambda value: self._proofs.proven(label, value, payload)) if approval else None
            )
            try:
                return await self._outcome(
                    kv, part, rt if announced else None,
                    instead=instead, cancelled_locally=cancelled_locally, proven=proven,
                )  # fmt: skip
            except SuspensionTimeoutError:
                if not (approval and issubclass(payload, ai_tools.ToolApproval)):
                    raise
                timed_out = (label, payload, part, rt if announced else None, timeout_s)
        finally:
            if pump is not None:
                await stop_task(pump, "a tool approval's proof reads")
            if not kv.done():
                kv.cancel()
                with contextlib.suppress(BaseException):
                    await kv
            if self._waits.get(label) is wait:
                del self._waits[label]
            if registry is not None and local_future is not None:
                live = registry._live_hooks.get(label)
                if live is not None and live[0] is local_future:
                    del registry._live_hooks[label]
        return await self._approval_timed_out(*timed_out)

    async def _approval_timed_out(
        self,
        label: str,
        payload: type[M],
        part: ai_messages.HookPart[Any],
        rt: ai_runtime.Runtime | None,
        timeout_s: float | None,
    ) -> M:
        """End the tool approval `label` that got no answer within `timeout_s` seconds with
        `approval_default`: close its record (cancelled, the reason saying so, so a later
        answer decides nothing) and return ``ToolApproval(granted=..., reason="timed out
        after <s>s; default <deny|allow>")``, which the model reads (a deny is the tool
        result ``"Rejected: timed out ..."``). An answer that won the race decides instead;
        a record that could not be closed (gone, or the store unreachable) is a deny,
        whatever the default: a human's answer may be there unseen."""
        store = self._settings.suspensions
        default = self._settings.approval_default
        why = f"{TIMED_OUT}{timeout_s:g}s; default {default}"
        with contextlib.suppress(HookbusError, NatsError):  # an answer written at the last moment
            await self._proofs.apply(label)
        try:
            await store.cancel_hook(label, reason=f"{why} applied")
        except AlreadySettledError:  # an answer (or a cancel) won: it decides, not the clock
            return await self.wait(
                label, payload=payload, metadata=part.metadata, tool_call_id=part.tool_call_id,
                registry=None, timeout_s=_SETTLE_S,
            )  # fmt: skip
        except (SuspensionNotFoundError, HookbusError, NatsError) as exc:
            # not closed: a human's answer may be there unseen, so the default may not decide
            log.warning("tool approval %r: not closed at its timeout (%r); denied", label, exc)
            granted = False
            reason = f"{why}, but it could not be closed: whether a human answered is unknown"
        else:  # kept past the run's end: a later answer, or a replay, finds it closed
            run = RunScope.current()
            if run is not None:
                run.keep(label)
            log.info("tool approval %r: %s", label, why)
            granted, reason = default == "allow", why
        if rt is not None:
            await rt.put_hook(part.model_copy(update={"status": "cancelled"}))
        return payload.model_validate({"granted": granted, "reason": reason})

    async def _carry(
        self, label: str, local: asyncio.Future[dict[str, Any]], kv: asyncio.Future[Any]
    ) -> tuple[BaseException | None, bool]:
        """Carry what ``ai.resolve_hook`` / ``ai.cancel_hook`` / ``ai.defer_hook`` did to
        the run's registry over to the record; return (exception to raise instead, whether
        ``ai.cancel_hook`` did it: it published its own ``cancelled`` event)."""
        store = self._settings.suspensions
        if local.cancelled():
            reason = _cancel_reason(local)
            with contextlib.suppress(SuspensionNotFoundError, AlreadySettledError):
                await store.cancel_hook(label, reason=reason)
            return None, True
        exc = local.exception()
        if exc is not None:
            await self._abort(label, kv)
            return exc, False
        try:
            await store.resolve_hook(label, as_json(local.result()))
        except AlreadySettledError:
            pass  # another resolution or a cancel won: the waiter reports it
        except ResolutionRejectedError as exc:
            await self._abort(label, kv)
            return exc, False
        return None, False

    async def _until_waiting(self, label: str, kv: asyncio.Future[Any]) -> bool:
        """Wait until the store's wait holds a pending record of `label` (True), or ended
        first (False)."""
        store = self._settings.suspensions
        while not kv.done():
            found = await store.get(label)
            if found is not None:
                record = found[0]
                if record.status == "pending" and record.attached:
                    if record.owner and record.owner == store.waiter_id:
                        return True
            await asyncio.wait({kv}, timeout=_ABORT_POLL_S)
        return False

    async def _abort(self, label: str, kv: asyncio.Future[Any]) -> None:
        """Abort the store's wait on `label` (by its hook id, read from the record once the
        wait has created or attached it); the record stays pending, detached."""
        store = self._settings.suspensions
        loop = asyncio.get_running_loop()
        deadline = Deadline.after(_ABORT_DEADLINE_S, loop.time())
        while not kv.done():
            found = await store.get(label)
            if found is not None and found[0].status == "pending":
                if store.abort_pending_hook(found[0].hook_id):
                    return
            if loop.time() > deadline.when:  # strictly (`passed` counts the deadline)
                kv.cancel()
                return
            await asyncio.sleep(_ABORT_POLL_S)

    async def _outcome(
        self,
        kv: asyncio.Future[M],
        part: ai_messages.HookPart[Any],
        rt: ai_runtime.Runtime | None,
        *,
        instead: BaseException | None,
        cancelled_locally: bool,
        proven: Any = None,
    ) -> M:
        if kv.cancelled():  # an abort that could not reach the store's wait
            raise instead or ai.HookDeferredException(part)
        exc = kv.exception()
        if isinstance(exc, SuspensionAbortedError):
            raise (instead or ai.HookDeferredException(part)) from None
        if isinstance(exc, SuspensionCancelledError):
            if rt is not None and not cancelled_locally:
                await rt.put_hook(part.model_copy(update={"status": "cancelled"}))
            raise asyncio.CancelledError(exc.reason)
        if exc is not None:
            raise exc
        value = kv.result()
        raw = value
        if proven is not None:  # a tool approval: the approver's proof must hold it
            value = await proven(raw)
        if rt is not None:
            resolution = value.model_dump() if isinstance(value, pydantic.BaseModel) else value
            if proven is not None and isinstance(raw, dict) and raw.get("answered_by"):
                if getattr(value, "granted", None) == raw.get("granted"):  # not refused
                    resolution = {**resolution, "answered_by": raw["answered_by"]}
            await rt.put_hook(
                part.model_copy(update={"status": "resolved", "resolution": resolution})
            )
        return value


def _creator(found: Any) -> str | None:
    """The ``traceparent`` of the run that created the record `found` (``(record,
    revision)`` or None; kept in its ``"_ai"`` metadata), or None."""
    extra = None if found is None else found[0].metadata.get(AI_METADATA_KEY)
    value = extra.get(AI_TRACE_KEY) if isinstance(extra, dict) else None
    return value if isinstance(value, str) and value else None


def _runtime() -> ai_runtime.Runtime | None:
    try:
        return ai_runtime.get_runtime()
    except LookupError:
        return None


def _cancel_reason(future: asyncio.Future[Any]) -> str | None:
    try:
        future.result()
    except asyncio.CancelledError as exc:
        return str(exc.args[0]) if exc.args and exc.args[0] is not None else None
    return None  # pragma: no cover - only called on a cancelled future
