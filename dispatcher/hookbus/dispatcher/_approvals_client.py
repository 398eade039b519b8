"""`ApprovalsClient`: what an approver needs, and nothing more.

An approver answers and cancels approvals, lists the pending ones and lists and revokes
"Allow always" grants. All of it lives in the approvals bucket, so that is all this opens (once, at
`start`, and kept): no handler registry watch, no request inboxes, no suspensions or
leases bucket. An answer (or a cancel) is written as the approver's proof
``<agent>.<label>.<approver>``, which the deciding dispatcher applies (see
`hookbus.dispatcher._approvals`). A dispatcher's approvals are answered through the same
class (`over`).
"""

from __future__ import annotations

import dataclasses

from nats.aio.client import Client as NATS

from hookbus._core.buckets import approvals_bucket_config
from hookbus._core.kv import open_bucket
from hookbus.schemas import (
    ApprovalAnswer,
    ApprovalGrant,
    HookStatus,
    NotConnectedError,
    SuspensionNotFoundError,
    SuspensionRecord,
    suspension_events_subject,
    validate_name,
)

from ._approvals import APPROVAL_LABEL_PREFIX, Approvals
from ._records import SuspensionPage
from ._suspension_events import HookEventStream
from ._suspensions import Suspensions

__all__ = ["ApprovalsClient"]


class ApprovalsClient:
    """Answer approvals, list pending ones, list and revoke grants: an approver's entry point.

    ``async with ApprovalsClient(nc) as approvals:`` (or ``await ApprovalsClient.open(nc)``,
    then `close`) opens the approvals bucket once and keeps it for every call; it starts no
    watch and subscribes to nothing (`events` subscribes when asked). The connection stays
    the caller's. On a server that requires authentication, give it an approver's NATS
    credentials (``hookbus auth add approver NAME``).

    Args:
        nc: a connected nats-py client.
        agent_id: the agent whose approvals a call addresses when it names none (None: the
            approvals of calls without an agent id). Listings cover every agent either way.
        answer_wait_s: seconds `answer_approval` waits, by default, for the deciding
            dispatcher to apply an answer.
        bucket_replicas: replicas of the approvals bucket if this creates it (3 on a cluster).
        js_domain: the JetStream domain holding the approvals bucket (a leaf site: the
            hub's; None: the one bound to `nc`, else the connection's own JetStream).
        closes_records: whether an approval this client finds overdue (`end_overdue`) is
            closed in the bucket (None: unless the server requires authentication, where an
            approver's credentials may not write records: there it is only not listed).
    Raises:
        BadRequestError: `agent_id` is not a valid hookbus name.
    """

    def __init__(
        self,
        nc: NATS,
        *,
        agent_id: str | None = None,
        answer_wait_s: float = 5.0,
        bucket_replicas: int = 1,
        js_domain: str | None = None,
        closes_records: bool | None = None,
    ) -> None:
        if agent_id is not None:
            validate_name("agent", agent_id)
        self._closes = closes_records
        self._nc: NATS | None = nc
        self._agent_id = agent_id
        self._answer_wait_s = answer_wait_s
        self._replicas = bucket_replicas
        self._js_domain = js_domain
        self._approvals: Approvals | None = None
        self._owned = True

    @classmethod
    async def open(
        cls,
        nc: NATS,
        *,
        agent_id: str | None = None,
        answer_wait_s: float = 5.0,
        bucket_replicas: int = 1,
        js_domain: str | None = None,
    ) -> ApprovalsClient:
        """A started client (see the class for the arguments); `close` it when done.

        Raises:
            NotPermittedError: the approvals bucket is absent and these credentials may
                not create it, or may not read it.
            HookbusTimeoutError: JetStream stayed unavailable.
        """
        client = cls(
            nc, agent_id=agent_id, answer_wait_s=answer_wait_s,
            bucket_replicas=bucket_replicas, js_domain=js_domain,
        )  # fmt: skip
        await client.start()
        return client

    @classmethod
    def over(cls, approvals: Approvals, *, owned: bool = False) -> ApprovalsClient:
        """A started client over open `approvals` (a dispatcher's); its default agent is
        theirs. `close` closes them only when `owned`."""
        client = cls.__new__(cls)
        client._nc = None
        client._agent_id = approvals.records.agent_id
        client._answer_wait_s = approvals.answer_wait_s
        client._replicas = 1
        client._js_domain = None
        client._approvals = approvals
        client._owned = owned
        client._closes = None
        return client

    async def start(self) -> None:
        """Open the approvals bucket (create it if absent and allowed); idempotent.

        Raises:
            NotPermittedError: the approvals bucket is absent and these credentials may
                not create it, or may not read it.
            HookbusTimeoutError: JetStream stayed unavailable.
            JetStreamDomainError: the bucket is absent and the answering JetStream is not
                the domain asked for, or none answers (see `open_bucket`).
        """
        if self._approvals is not None:
            return
        if self._nc is None:
            raise NotConnectedError("this approvals client is closed")
        config = approvals_bucket_config(replicas=self._replicas)
        kv = await open_bucket(self._nc, config, js_domain=self._js_domain)
        records = Suspensions(self._nc, kv, agent_id=self._agent_id)  # never waits: no lease
        self._approvals = Approvals(
            records, kv, answer_wait_s=self._answer_wait_s, max_pending=None
        )
        if self._closes is not None:
            self._approvals.closes_records = self._closes
        else:  # on a secured server only the dispatcher service and the admin write records
            info = getattr(self._nc, "_server_info", None) or {}
            self._approvals.closes_records = not info.get("auth_required")

    async def close(self) -> None:
        """Let the bucket go (idempotent). The connection stays the caller's."""
        approvals, self._approvals = self._approvals, None
        if approvals is not None and self._owned:
            await approvals.close()

    async def __aenter__(self) -> ApprovalsClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def agent_id(self) -> str | None:
        """The agent a call addresses when it names none."""
        return self._agent_id

    def _open(self) -> Approvals:
        if self._approvals is None:
            raise NotConnectedError("approvals need a started ApprovalsClient: start() first")
        return self._approvals

    def _records(self, agent_id: str | None) -> Suspensions:
        return self._open().records.for_agent(self._agent_id if agent_id is None else agent_id)

    async def answer_approval(
        self,
        label: str,
        choice: str,
        *,
        approver: str,
        agent_id: str | None = None,
        wait_s: float | None = None,
    ) -> ApprovalAnswer:
        """Answer the pending approval `label` of agent `agent_id` (None: `agent_id` of this
        client) with `choice`, one of its options, as `approver`.

        Writes the approver's answer proof ``<agent>.<label>.<approver>`` (on a secured
        server, a key only that approver's NATS user may write); the dispatcher waiting on
        the approval applies the first proof written (and stores the grant of an allowing
        "Allow always"). Waits up to `wait_s` seconds (None: `answer_wait_s`) for that.

        Returns:
            The answer that decided the approval (this one).
        Raises:
            SuspensionNotFoundError: no approval `label` for this agent.
            AlreadySettledError: it was answered (another approver's answer decided: the
                message names it), cancelled or timed out first.
            ResolutionRejectedError: `choice` is not one of its options.
            BadRequestError: `approver` is empty or too long.
            AnswerNotAppliedError: the answer is recorded but no dispatcher applied it in
                time: it decides when the agent's dispatcher (or the dispatcher service)
                reads the approval.
            HookbusTimeoutError: JetStream stayed unavailable (or these credentials may not
                write the proof: a refused publish is never acknowledged).
            NotConnectedError: the client is not started.
        """
        approvals = self._open()
        agent = self._agent_id if agent_id is None else agent_id
        return await approvals.answer(
            label, choice, agent_id=agent, approver=approver, wait_s=wait_s
        )

    async def approval_page(
        self, *, status: HookStatus | None = "pending", prefix: str | None = APPROVAL_LABEL_PREFIX
    ) -> SuspensionPage:
        """Every agent's approval records in the approvals bucket (pending ones by
        default, `status` None: all; labels starting with `prefix`), oldest first, read in
        one pass; ``skipped`` counts unreadable ones. A pending approval nobody closed past
        its timeout (`end_overdue`) is not pending: listing pending ones ends it first.

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
            NotConnectedError: the client is not started.
        """
        page = await self._open().records.page(status=status, prefix=prefix)
        if status != "pending":
            return page
        ended = {(r.agent_id, r.label) for r in await self._end(page.records)}
        kept = [r for r in page.records if (r.agent_id, r.label) not in ended]
        return dataclasses.replace(page, records=kept) if ended else page

    async def pending_approvals(self) -> list[SuspensionRecord]:
        """Every agent's pending approvals (records whose metadata ``kind`` is
        ``approval``), oldest first, overdue ones ended (`end_overdue`); raises as
        `approval_page`."""
        page = await self.approval_page(status="pending", prefix=APPROVAL_LABEL_PREFIX)
        return [r for r in page.records if r.metadata.get("kind") == "approval"]

    async def end_overdue(self) -> list[SuspensionRecord]:
        """End every agent's pending approvals that nobody closed within their
        ``timeout_s`` plus `EXPIRY_MARGIN_S` by the server's clock (their asker gone): a
        proven answer decides, else each is closed with its default (status
        ``cancelled``, reason "timed out after ...; default ... applied").

        Returns:
            The records ended, as settled (written when `closes_records`; else as they
            would be: they are not pending for this client either).
        Raises:
            HookbusTimeoutError: JetStream stayed unavailable.
            NotConnectedError: the client is not started.
        """
        page = await self._open().records.page(status="pending", prefix=APPROVAL_LABEL_PREFIX)
        return await self._end(page.records)

    async def _end(self, records: list[SuspensionRecord]) -> list[SuspensionRecord]:
        approvals = self._open()
        ended = []
        for r in records:
            if r.metadata.get("kind") != "approval" or r.metadata.get("timeout_s") is None:
                continue
            got = await approvals.end_if_overdue(
                r.label, agent_id=r.agent_id, write=approvals.closes_records
            )
            if got is not None:
                ended.append(got)
        return ended

    @property
    def closes_records(self) -> bool:
        """Whether this client writes the approval records it ends (`end_overdue`): not
        with credentials that may not (an approver's on a secured server), unless told."""
        return self._open().closes_records

    async def get_approval(
        self, label: str, *, agent_id: str | None = None
    ) -> tuple[SuspensionRecord, int] | None:
        """The approval record `label` of agent `agent_id` (None: this client's) and its
        revision, or None; raises as `Suspensions.get`."""
        return await self._records(agent_id).get(label)

    async def cancel_approval(
        self,
        label: str,
        *,
        reason: str | None = None,
        agent_id: str | None = None,
        approver: str | None = None,
        wait_s: float | None = None,
    ) -> None:
        """Cancel the pending approval `label` of agent `agent_id` (None: this client's):
        its waiter (or a retry of the call) denies, "approval cancelled: <reason>".

        With `approver` (an approver's credentials, e.g. on a secured server), this writes
        the approver's cancel proof ``<agent>.<label>.<approver>``, as an answer does, and
        waits up to `wait_s` seconds (None: `answer_wait_s`) for the deciding dispatcher
        to close the record; the reason is then ``"by <approver>: <reason>"``. Without
        it, this closes the record itself: a dispatcher's or admin's NATS user only.

        Raises:
            SuspensionNotFoundError: no approval `label` for this agent.
            AlreadySettledError: it was answered, cancelled or timed out first.
            BadRequestError: `approver` is empty or too long.
            AnswerNotAppliedError: (with `approver`) the cancel is recorded but no
                dispatcher applied it in time.
            HookbusTimeoutError: JetStream stayed unavailable (or these credentials may not
                write the proof or the record: a refused publish is never acknowledged).
            NotConnectedError: the client is not started.
        """
        agent = self._agent_id if agent_id is None else agent_id
        if approver is not None:
            await self._open().cancel(
                label, agent_id=agent, approver=approver, reason=reason, wait_s=wait_s
            )
            return
        store = self._records(agent_id)
        got = await store.get(label)
        if got is None or got[0].metadata.get("kind") != "approval":
            raise SuspensionNotFoundError(f"no approval {label!r} for agent {agent!r}")
        await store.cancel_hook(label, reason=reason)

    async def approval_grants(
        self,
        *,
        agent_id: str | None = None,
        session_id: str | None = None,
        event: str | None = None,
        handler: str | None = None,
        tool: str | None = None,
    ) -> list[ApprovalGrant]:
        """Live "Allow always" grants, oldest first, matching the filters (None: any).

        Raises:
            HookbusTimeoutError: JetStream stayed unavailable (see `Grants.list`).
            NotConnectedError: the client is not started.
        """
        return await self._open().grants.list(
            agent_id=agent_id, session_id=session_id, event=event, handler=handler, tool=tool
        )

    async def revoke_grant(self, grant: ApprovalGrant | str) -> None:
        """Revoke one grant (an `ApprovalGrant` or its key): the next call it covered asks
        again.

        Raises:
            BadRequestError: `grant` is a string that is not a grant key.
            HookbusTimeoutError: JetStream stayed unavailable.
            NotConnectedError: the client is not started.
        """
        await self._open().grants.revoke(grant)

    async def events(self) -> HookEventStream:
        """Subscribe to every agent's suspension events (`HookEvent`: pending / resolved /
        cancelled), approvals' among them (labels starting with ``approval:``), as an
        async iterator; close it with ``aclose``.

        Raises:
            NotConnectedError: the client is not started, or was made by a dispatcher (use
                `HookDispatcher.hook_events` there).
        """
        self._open()
        if self._nc is None:
            raise NotConnectedError("this client has no connection of its own")
        sub = await self._nc.subscribe(suspension_events_subject(None, every_agent=True))
        await self._nc.flush()
        return HookEventStream(sub)
