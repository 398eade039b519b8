"""The demo's approver: a separate process that answers pending approvals through NATS.

Run as ``python approver.py NATS_URL``. It opens the approvals bucket alone (`ApprovalsClient`:
no dispatcher, no handler registry), watches suspension events and answers every pending
approval with "Allow once" (a real one would show the prompt to a person: see
``hookbus approvals`` and ``hookbus demo --interactive``). It prints one line per answer.
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import sys
from typing import Any

import nats

from hookbus.dispatcher import APPROVAL_LABEL_PREFIX, ApprovalsClient
from hookbus.schemas import HookbusError

CHOICE = "Allow once"
APPROVER = os.environ.get("HOOKBUS_APPROVER", "demo-approver")
"""Who answers: on a secured server, the approver name this process's NATS user may answer as."""


def credentials_from_env() -> dict[str, Any]:
    """nats-py options from the variables `hookbus demo` sets for its processes: an nkey
    seed (NATS_NKEY), the inbox prefix the server lets this user listen on
    (NATS_INBOX_PREFIX) and a CA to verify the server with (NATS_CA)."""
    options: dict[str, Any] = {}
    if os.environ.get("NATS_NKEY"):
        options["nkeys_seed"] = os.environ["NATS_NKEY"]
    if os.environ.get("NATS_INBOX_PREFIX"):
        options["inbox_prefix"] = os.environ["NATS_INBOX_PREFIX"]
    if os.environ.get("NATS_CA"):
        options["tls"] = ssl.create_default_context(cafile=os.environ["NATS_CA"])
    return options


async def main(url: str) -> None:
    nc = await nats.connect(url, name="hookbus-demo-approver", **credentials_from_env())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ApprovalsClient(nc) as approvals:
        events = await approvals.events()
        print("approver ready", flush=True)

        async def answer() -> None:
            async for event in events:
                hook = event.hook
                if hook.status != "pending" or not hook.label.startswith(APPROVAL_LABEL_PREFIX):
                    continue
                try:
                    await approvals.answer_approval(
                        hook.label, CHOICE, approver=APPROVER, agent_id=hook.agent_id
                    )
                except HookbusError as exc:
                    print(f"approver: {hook.label}: {exc}", flush=True)
                    continue
                prompt = hook.metadata.get("prompt")
                print(
                    f"approver answered {CHOICE!r} to {prompt!r} ({hook.label}) as {APPROVER}",
                    flush=True,
                )

        task = asyncio.create_task(answer())
        await stop.wait()
        task.cancel()
        await events.aclose()
    await nc.drain()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
