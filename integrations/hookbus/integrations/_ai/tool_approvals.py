"""A tool approval is used once per tool call and run: what a run already decided (and
maybe ran) is not asked again, an approval closed by its timeout keeps its outcome, and a
re-asked turn (the same call under a new tool call id) is decided by the earlier approval.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container
from typing import Any

import msgspec
from ai.types import tools as ai_tools
from nats.errors import Error as NatsError

from hookbus.dispatcher import RunScope, Suspensions
from hookbus.schemas import HookbusError, SuspensionRecord

from .labels import AI_METADATA_KEY, HooksSettings, M, log
from .run_claims import RunClaims

__all__ = ["TIMED_OUT", "ToolApprovals"]

TIMED_OUT = "timed out after "
"""How the reason of a tool approval closed by its timeout starts."""


class ToolApprovals:
    """The tool approvals of the store's runs: which were used, with the tools' results
    kept (``"used_in"`` and ``"ran"`` in the record's ``"_ai"`` metadata), and which tool
    calls of this process were granted (their results are kept when they have run)."""

    def __init__(self, settings: HooksSettings, claims: RunClaims) -> None:
        self._settings = settings
        self._claims = claims
        self._granted: dict[str, str] = {}  # tool call id -> its approval's label

    @property
    def suspensions(self) -> Suspensions:
        """The store of the hooks served (read at each use)."""
        return self._settings.suspensions

    async def ask(
        self, call: Any, wait: Callable[[str], Awaitable[M]], waiting: Container[str]
    ) -> M:
        """Answer the tool approval ``ai.hook`` call `call` (``ai``'s ``HookCall``): what
        this run decided for it already, else `wait` on its label (or on the earlier
        approval that decides it, see `earlier`; this process waits on the labels in
        `waiting`), its resolution then kept as used in this run."""
        label = call.label
        decided = await self._decided(label, call.payload)
        if decided is not None:
            self._note_decided(call.tool_call_id, label, decided)
            return decided
        label = await self.earlier(label, call.metadata, call.tool_call_id, waiting)
        value = await wait(label)
        await self.mark_used(label, ran=None)
        self._note_decided(call.tool_call_id, label, value)
        return value

    async def _decided(self, label: str, payload: type[M]) -> M | None:
        """What the current run already decided for the tool approval `label`: the
        resolution it used (the same tool call replayed), or the default of its timeout;
        None: it is to be asked (or waited on)."""
        used = await self._used(label)
        if used is not None:  # this tool call was decided (and maybe ran): not asked again
            return payload.model_validate(used.resolution)
        return await self._timed_out(label, payload)  # its default, never a question again

    async def _used(self, label: str) -> SuspensionRecord | None:
        """The record of the tool approval `label` if this run already used its resolution
        (kept after the run's end with ``"used_in": <run id>`` in its ``"_ai"`` metadata),
        else None."""
        run = RunScope.current()
        if run is None:
            return None
        found = await self.suspensions.get(label)
        if found is None:
            return None
        record = found[0]
        extra = record.metadata.get(AI_METADATA_KEY)
        if record.status != "resolved" or not record.consumed:
            return None
        if not isinstance(extra, dict) or extra.get("used_in") != run.run_id:
            return None
        run.keep(label)  # for a later retry
        return record

    async def _timed_out(self, label: str, payload: type[M]) -> M | None:
        """The outcome of the tool approval `label` if it was closed by its timeout (kept,
        cancelled, with ``"timed out after ..."`` as its reason), else None."""
        if not issubclass(payload, ai_tools.ToolApproval):
            return None
        found = await self.suspensions.get(label)
        record = None if found is None else found[0]
        if record is None or record.status != "cancelled":
            return None
        why = (record.reason or "").removesuffix(" applied")
        if not why.startswith(TIMED_OUT):
            return None
        return payload.model_validate({"granted": why.endswith("default allow"), "reason": why})

    def _note_decided(self, tool_call_id: str, label: str, value: Any) -> None:
        """Note the outcome `value` of the tool call's approval `label`: a granted call's
        results are kept once it has run (`take_granted`)."""
        if getattr(value, "granted", False):
            self._granted[tool_call_id] = label

    def take_granted(self, tool_call_id: str) -> str | None:
        """The label of the approval that granted the tool call `tool_call_id` (once)."""
        return self._granted.pop(tool_call_id, None)

    async def ran(self, label: str) -> list[Any] | None:
        """The results kept of the tool whose approval is `label` (``ToolResultPart``
        JSON), or None."""
        found = await self.suspensions.get(label)
        extra = None if found is None else found[0].metadata.get(AI_METADATA_KEY)
        ran = extra.get("ran") if isinstance(extra, dict) else None
        return ran if isinstance(ran, list) and ran else None

    async def earlier(
        self, label: str, metadata: dict[str, Any], tool_call_id: str, waiting: Container[str]
    ) -> str:
        """The label that decides the tool approval `label`: its own if it has a record,
        else that of an earlier approval of this run for the same tool with the same
        arguments (another tool call id: the model re-asked the turn) that is still
        undecided or whose answer is still unused and that nobody live waits on (this
        process waits on the labels in `waiting`)."""
        run = RunScope.current()
        if run is None or not metadata.get("tool"):
            return label
        store = self.suspensions
        if await store.get(label) is not None:
            return label
        for record in await store.list():
            extra = record.metadata.get(AI_METADATA_KEY)
            if record.label == label or record.label in waiting:
                continue
            if record.run_id != run.run_id or record.agent_id != store.agent_id:
                continue
            if not isinstance(extra, dict) or extra.get("tool_call_id") in (None, tool_call_id):
                continue
            if {k: v for k, v in record.metadata.items() if k != AI_METADATA_KEY} != metadata:
                continue
            if record.consumed or record.status == "cancelled":
                continue
            if record.status == "pending" and record.attached and record.owner:
                if record.owner == store.waiter_id or await self._claims.live_owner(
                    record, run.run_id
                ):
                    continue
            log.info(
                "tool approval %r: the same call as %r earlier in run %s (the model re-asked"
                " it with a new tool call id): decided by that one", label, record.label,
                run.run_id,
            )  # fmt: skip
            return record.label
        return label

    async def mark_used(self, label: str, *, ran: list[Any] | None) -> None:
        """Keep the consumed record of the tool approval `label` past the run's end, with
        ``"used_in": <run id>`` (and `ran`, the tool's results) in its ``"_ai"`` metadata:
        a retried resume of the same run gets that resolution (and result) again, never a
        new question or a second run of the tool. Best effort (logged)."""
        store = self.suspensions
        run = RunScope.current()
        try:
            await store.flush_deliveries(timeout_s=store.records.deadline_s)  # its mark first
            for _ in range(5):
                entry = await store.records.read(label)
                record = None if entry is None else entry.record
                if entry is None or record is None or record.status != "resolved":
                    return
                extra = record.metadata.get(AI_METADATA_KEY)
                extra = dict(extra if isinstance(extra, dict) else {})
                if run is not None:
                    extra["used_in"] = run.run_id
                if ran is not None:
                    extra["ran"] = ran
                marked = msgspec.structs.replace(
                    record, metadata={**record.metadata, AI_METADATA_KEY: extra}
                )
                if await store.records.swap(marked, last=entry.revision) is not None:
                    if run is not None:
                        run.keep(label)
                    return
        except (HookbusError, NatsError) as exc:
            log.warning("tool approval %r: its use not recorded (%r)", label, exc)
