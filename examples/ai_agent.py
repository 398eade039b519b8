"""An agent of the Vercel AI SDK for Python (the ``ai`` package) whose tool waits for a
durable hookbus approval.

The agent's ``transfer`` tool is declared ``@ai.tool(require_approval=True)``: before it
runs, ``ai`` suspends on the hook ``approve_<tool call id>`` (payload
``ai.tools.ToolApproval``: ``{"granted": bool, "reason": str | null}``). With
`hookbus.integrations.ai.HookbusHooks` that hook is a record in the
``hookbus_suspensions`` JetStream KV bucket, so anyone can answer it from another process,
and the run survives this one: Ctrl-C aborts the wait (the record stays pending) and
saves the conversation; running the example again with ``--resume`` picks it up. The model
is ``ai.testing.FakeModel`` (a scripted conversation): no network, no API key. Once
approved, the tool call is also decided by the fleet's hook workers (``tool:pre`` before it,
``tool:post`` after it, through the ``HookDispatcher`` that ``HookbusHooks`` starts for the
agent): a worker's deny stops it.

Needs Python >= 3.12 (``ai``). From the repository::

    python3.12 -m venv .venv312 && .venv312/bin/pip install -q -e '.[ai]'
    .venv/bin/hookbus server &                                   # NATS on 127.0.0.1:4222
    .venv312/bin/python examples/ai_agent.py                     # waits for the approval
    # in another terminal, answer it as an approver (its answer proof; the agent applies it;
    # on a secured server with an approver's seed in $NATS_NKEY, its name in
    # $HOOKBUS_APPROVER):
    .venv312/bin/python examples/ai_agent.py --approve           # --deny to refuse

``--url`` (default ``$NATS_URL`` or ``nats://127.0.0.1:4222``; on a secured server the
agent's nkey seed file in ``$NATS_NKEY`` and its inbox prefix in ``$NATS_INBOX_PREFIX``),
``--agent`` (default ``ai-example``: the records' agent), ``--state FILE`` (default
``.hookbus/ai_agent.json``: the run id and the saved conversation for ``--resume``). Exit
status 0 when the run ended (transferred or refused), 3 when it was aborted and saved, 2 on
a connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
import uuid
from pathlib import Path
from typing import Any

import ai
import nats
import pydantic
from ai import testing

from hookbus.dispatcher import AnswerNotAppliedError
from hookbus.integrations.ai import HookbusHooks

MESSAGES = pydantic.TypeAdapter(list[ai.messages.Message])


def credentials_from_env() -> dict[str, Any]:
    """nats-py options from the variables `hookbus demo` sets for its processes: an nkey
    seed (NATS_NKEY), the inbox prefix the server lets this user listen on
    (NATS_INBOX_PREFIX) and a CA to verify the server with (NATS_CA). None set: none."""
    options: dict[str, Any] = {}
    if os.environ.get("NATS_NKEY"):
        options["nkeys_seed"] = os.environ["NATS_NKEY"]
    if os.environ.get("NATS_INBOX_PREFIX"):
        options["inbox_prefix"] = os.environ["NATS_INBOX_PREFIX"]
    if os.environ.get("NATS_CA"):
        options["tls"] = ssl.create_default_context(cafile=os.environ["NATS_CA"])
    return options


@ai.tool(require_approval=True)
async def transfer(amount_cents: int, payee: str) -> str:
    """Transfer `amount_cents` to `payee`."""
    return f"transferred {amount_cents / 100:.2f} to {payee}"


def conversation() -> list[Any]:
    call = testing.tool_call(transfer, amount_cents=120000, payee="Acme Corp")
    return [
        ai.user_message("Pay Acme Corp's invoice of 1,200.00."),
        ai.assistant_message("I'll transfer 1,200.00 to Acme Corp.", call),
        ai.assistant_message("Done."),
    ]


def save(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


async def run_agent(hooks: HookbusHooks, state: Path, resume: bool) -> int:
    if resume:
        saved = json.loads(await asyncio.to_thread(state.read_text))
        run_id, messages = saved["run_id"], MESSAGES.validate_python(saved["messages"])
        script = [messages[0], messages[1].model_copy(update={"replay": True}), *conversation()[2:]]
    else:
        run_id, script = uuid.uuid4().hex, conversation()
        messages = script[:1]
    model = testing.FakeModel(script)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, hooks.abort_all)  # Ctrl-C: stop waiting, keep it
    async with hooks.run(ai.Agent(tools=[transfer]), model, messages, run_id=run_id) as stream:
        async for event in stream:
            if isinstance(event, ai.events.HookEvent):
                part = event.hook
                print(f"hook {part.hook_id}: {part.status}", part.metadata or "", flush=True)
                if part.status == "pending":
                    agent = hooks.suspensions.agent_id
                    print(f"  answer it as an approver: {sys.argv[0]} --agent {agent} --approve"
                          "  (or --deny; Ctrl-C to suspend)", flush=True)  # fmt: skip
            elif isinstance(event, ai.events.RunBlocked):
                print("run blocked on", [h.hook_id for h in event.hooks])
    loop.remove_signal_handler(signal.SIGINT)
    last = stream.messages[-1]
    if last.role == "tool" and any(p.is_hook_deferred for p in last.tool_results):
        saved = {"run_id": run_id, "messages": MESSAGES.dump_python(stream.messages, mode="json")}
        await asyncio.to_thread(save, state, json.dumps(saved))
        print(f"suspended; resume with: {sys.argv[0]} --resume")
        return 3
    for message in stream.messages:
        for result in message.tool_results:
            print("tool result:", result.result)
    return 0


async def answer(hooks: HookbusHooks, granted: bool) -> int:
    pending = await hooks.suspensions.page(status="pending", prefix="approve_")
    if not pending.records:
        print("no pending approval")
        return 1
    approver = os.environ.get("HOOKBUS_APPROVER", "example-approver")
    for record in pending.records:
        # a tool approval is decided only by an approver's answer proof: the agent applies it
        try:
            await hooks.approve(record.label, "Allow" if granted else "Deny", approver=approver)
        except AnswerNotAppliedError as exc:  # the agent is not waiting now: recorded
            print(exc)
            continue
        print(f"{'approved' if granted else 'refused'} {record.label} as {approver}")
    return 0


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("NATS_URL", "nats://127.0.0.1:4222"))
    parser.add_argument("--agent", default="ai-example")
    parser.add_argument("--state", type=Path, default=Path(".hookbus/ai_agent.json"))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true")
    mode.add_argument("--approve", action="store_true")
    mode.add_argument("--deny", action="store_true")
    args = parser.parse_args()
    try:
        nc = await nats.connect(
            args.url, max_reconnect_attempts=2, connect_timeout=5, **credentials_from_env()
        )
    except Exception as exc:
        print(f"cannot connect to {args.url}: {exc!r} (is `hookbus server` running?)")
        return 2
    hooks = await HookbusHooks.open(nc, agent_id=args.agent, scoped=True)
    try:
        if args.approve or args.deny:
            return await answer(hooks, granted=args.approve)
        return await run_agent(hooks, args.state, resume=args.resume)
    finally:
        await hooks.close()
        with contextlib.suppress(Exception):
            await nc.close()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
