"""The OWASP AOS guardian door (`hookbus.integrations.aos.answer`), end to end over NATS.

Every decision test answers AOS JSON-RPC bodies through a real `HookDispatcher` on a private
nats-server (``embedded_server``: the door emits standard events such as ``tool:pre``, so
declarations must not leak between tests) whose handlers are `HookWorker`s on connections of
their own. Every response is checked twice: it round-trips through the door's msgspec types,
and it validates against OWASP's current ``aos_schema.json`` (tests/fixtures/aos/README.md says
where it comes from, and the one place where the door follows JSON-RPC 2.0 over it).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import msgspec
import pytest
from _answering import answered
from _integration_kit import Connect, private_connect

from hookbus.dispatcher import ApprovalsClient, HookDispatcher
from hookbus.integrations.aos import (
    AOS_A2A,
    AOS_AGENT_TRIGGER,
    AOS_KNOWLEDGE_RETRIEVAL,
    AOS_MCP,
    AOS_MEMORY_RETRIEVAL,
    AOS_MEMORY_STORE,
    AOS_SYSTEM_MESSAGE,
    MAX_BODY_BYTES,
    AOSSuccessResponse,
    JSONRPCErrorResponse,
    PingRequestSuccessResponse,
    answer,
)
from hookbus.schemas import PROMPT_COMPLETE, PROMPT_SUBMIT, TOOL_POST, TOOL_PRE, HookResult
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

Handler = Callable[[str, dict[str, Any]], Any]
FIXTURES = Path(__file__).parent / "fixtures" / "aos"
EXAMPLES = sorted(p.stem for p in FIXTURES.glob("*.json") if p.name != "aos_schema.json")
NOT_JSON = {  # the seed's examples that are not JSON as printed (see the fixtures README)
    "agent_trigger", "tool_call_request", "tool_call_result", "memory_context_retrieval",
    "memory_store", "mcp_inbound",
}  # fmt: skip
EVENT_OF = {
    "agent_trigger": AOS_AGENT_TRIGGER,
    "tool_call_request": TOOL_PRE,
    "tool_call_result": TOOL_POST,
    "message_user": PROMPT_SUBMIT,
    "message_agent": PROMPT_COMPLETE,
    "memory_context_retrieval": AOS_MEMORY_RETRIEVAL,
    "memory_store": AOS_MEMORY_STORE,
    "knowledge_retrieval": AOS_KNOWLEDGE_RETRIEVAL,
    "mcp_outbound": AOS_MCP,
    "mcp_inbound": AOS_MCP,
}
EVENTS = sorted(set(EVENT_OF.values()))


def body(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes()


def request(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(body(name))
    return doc


def encode(doc: Any) -> bytes:
    return json.dumps(doc).encode()


# -- the published schema -----------------------------------------------------------------
SCHEMA = json.loads((FIXTURES / "aos_schema.json").read_text())
ADDED_URL = "url"
"""The one field the fixtures add to the seed's contexts: ``context.agent.url``, which the
current schema requires and the seed's examples predate."""


def _validator(ref: str, schema: dict[str, Any] = SCHEMA) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator({**schema, "$ref": f"#/$defs/{ref}"})


RESPONSE = _validator("ASOPResponse")
ERROR_RESPONSE = _validator("JSONRPCErrorResponse")
AOS_REQUEST = _validator("ASOPRequest")


def schema_errors(doc: Any) -> list[str]:
    return sorted(
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in RESPONSE.iter_errors(doc)
    )


def checked(raw: bytes | None) -> dict[str, Any]:
    """The response `raw`, after checking it against the door's types and the schema."""
    assert raw is not None, "a request with an id must be answered"
    doc: dict[str, Any] = json.loads(raw)
    assert doc["jsonrpc"] == "2.0" and ("result" in doc) != ("error" in doc)
    kind: type = JSONRPCErrorResponse if "error" in doc else (
        PingRequestSuccessResponse if "status" in doc["result"] else AOSSuccessResponse
    )  # fmt: skip
    typed = msgspec.json.decode(raw, type=kind, strict=True)
    assert json.loads(msgspec.json.encode(typed)) == doc  # nothing our types do not name
    if "error" in doc and doc["id"] is None:  # JSON-RPC 2.0 wants null; the schema does not
        found = [e.message for e in ERROR_RESPONSE.iter_errors(doc)]
        assert found == ["None is not of type 'string', 'integer'"], found
    else:
        assert schema_errors(doc) == []
    return doc


def decision(raw: bytes | None) -> str:
    result: str = checked(raw)["result"]["decision"]
    return result


def error_code(raw: bytes | None) -> int:
    code: int = checked(raw)["error"]["code"]
    return code


# -- a private server, workers and the dispatcher the door emits through -------------------
connect = private_connect


def named(name: str, fn: Handler) -> Handler:
    fn.__name__ = name
    return fn


@contextlib.asynccontextmanager
async def guardian(
    connect: Connect, *handlers: tuple[str, Handler, dict[str, Any]], **dispatcher: Any
) -> AsyncIterator[HookDispatcher]:
    """Workers serving `handlers` (each ``(event, fn, options)``) on a connection of their
    own, and a started `HookDispatcher` on another one that has their routes."""
    worker = HookWorker(await connect())
    for event, fn, options in handlers:
        worker.add_handler(event, fn, **options)
    async with worker, HookDispatcher(await connect(), **dispatcher) as d:
        yield d


def on_every_event(fn: Handler, **options: Any) -> list[tuple[str, Handler, dict[str, Any]]]:
    return [(event, fn, options) for event in EVENTS]


PII = re.compile(r"\+\d[\d-]{7,}\d|(?<![\w-])\d{9,}(?![\w-])")
"""A phone number (``+337-665-99-06``) or a bare run of 9+ digits (an account number)."""


def redact(value: Any) -> Any:
    if isinstance(value, str):
        return PII.sub("[REDACTED]", value)
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    return value


CONTENT = {  # where the redactor looks, per event: the flattened field or the AOS params key
    TOOL_PRE: "tool_input", TOOL_POST: "tool_result", PROMPT_SUBMIT: "prompt",
    PROMPT_COMPLETE: "response", AOS_AGENT_TRIGGER: "trigger", AOS_MEMORY_RETRIEVAL: "memory",
    AOS_MEMORY_STORE: "memory", AOS_KNOWLEDGE_RETRIEVAL: "knowledgeStep", AOS_MCP: "mcp_message",
}  # fmt: skip


async def redactor(event: str, data: dict[str, Any]) -> HookResult | None:
    key = CONTENT[event]
    new = redact(data[key])
    if new == data[key]:
        return None
    return HookResult(action="modify", data={**data, key: new})


async def deny_policy(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="deny", reason=f"{event} is not allowed here")


WORLDS: dict[str, tuple[Handler, dict[str, str]]] = {
    "deny": (deny_policy, dict.fromkeys(EVENT_OF, "deny")),
    "modify": (
        redactor,
        {
            **dict.fromkeys(EVENT_OF, "allow"),
            "tool_call_request": "modify",
            "message_agent": "modify",
            "memory_store": "modify",
            "memory_context_retrieval": "modify",
            "knowledge_retrieval": "modify",
        },
    ),
    "allow": (named("observer", lambda event, data: None), dict.fromkeys(EVENT_OF, "allow")),
}


# -- the seed's examples --------------------------------------------------------------------
def as_printed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` without the ``context.agent.url`` the fixtures add (as the seed printed it)."""
    agent = doc.get("params", {}).get("context", {}).get("agent")
    if isinstance(agent, dict):
        agent.pop(ADDED_URL)
    return doc


def test_the_fixtures_are_the_seed_examples() -> None:
    """Ten examples; each normalised one is a valid AOS request per the current schema;
    the verbatim ones are JSON exactly when the README says so, and the same request but
    for the agent's ``url``."""
    assert EXAMPLES == sorted(EVENT_OF)
    for name in EXAMPLES:
        assert list(AOS_REQUEST.iter_errors(request(name))) == [], name
        verbatim = (FIXTURES / f"{name}.verbatim.txt").read_text()
        try:
            same = json.loads(verbatim) == as_printed(request(name))
        except json.JSONDecodeError:
            same = False
        assert same == (name not in NOT_JSON), name


@pytest.mark.parametrize("name", EXAMPLES)
async def test_each_verbatim_example_not_json_is_a_parse_error(name: str) -> None:
    raw = await answer((FIXTURES / f"{name}.verbatim.txt").read_bytes(), HookDispatcher().emit)
    if name in NOT_JSON:
        assert error_code(raw) == -32700
        assert checked(raw)["id"] is None
    else:  # printed as valid JSON: answered like its normalised copy
        assert decision(raw) == "allow"


@pytest.mark.parametrize("world", sorted(WORLDS))
async def test_every_seed_example_gets_its_exact_decision(connect: Connect, world: str) -> None:
    handler, expected = WORLDS[world]
    async with guardian(connect, *on_every_event(handler)) as d:
        got = {name: decision(await answer(body(name), d.emit)) for name in EXAMPLES}
    assert got == expected


async def test_deny_carries_the_policy_reason_and_who_decided(connect: Connect) -> None:
    async with guardian(connect, *on_every_event(deny_policy)) as d:
        doc = checked(await answer(body("tool_call_request"), d.emit))
    assert doc["id"] == request("tool_call_request")["id"]
    result = doc["result"]
    assert result["decision"] == "deny"
    assert result["message"] == result["reasoning"] == "tool:pre is not allowed here"
    assert result["reasonCode"] == ["hookbus:deny", "handler:deny_policy"]
    assert result["data"]["hookbus"] == {
        "event": "tool:pre", "action": "deny", "decidedBy": "deny_policy",
    }  # fmt: skip
    assert "modifiedRequest" not in result


async def test_modified_requests_carry_the_redacted_content_back(connect: Connect) -> None:
    async with guardian(connect, *on_every_event(redactor)) as d:
        out = {n: checked(await answer(body(n), d.emit))["result"] for n in EXAMPLES}
    for name, result in out.items():
        if result["decision"] != "modify":
            assert "modifiedRequest" not in result
            continue
        sent, back = request(name), result["modifiedRequest"]
        assert {k: back[k] for k in ("jsonrpc", "id", "method")} == {
            k: sent[k] for k in ("jsonrpc", "id", "method")
        }, name
        assert back["params"]["context"] == sent["params"]["context"], name
        assert result["message"] == "modified by redactor"
        assert result["reasonCode"] == ["hookbus:continue", "handler:redactor"]
    call = out["tool_call_request"]["modifiedRequest"]["params"]["toolCallRequest"]
    assert call["inputs"] == [  # tool_input back as the name/value list, order kept
        {"name": "phone_number", "value": "[REDACTED]"},
        {"name": "conent", "value": "Urgent security alert from Google!!"},
    ]
    assert call["toolId"] == "c264f381-10cf-4403-bd11-383014c0fcc6"
    message = out["message_agent"]["modifiedRequest"]["params"]["message"]
    assert message["content"] == [{"kind": "text", "text": "The bank account of Acme Corp is"
                                   " [REDACTED]"}]  # fmt: skip
    memory = out["memory_store"]["modifiedRequest"]["params"]["memory"]
    assert "[REDACTED]" in memory[0] and "000123456789" not in memory[0]
    knowledge = out["knowledge_retrieval"]["modifiedRequest"]["params"]["knowledgeStep"]
    assert "000123456789" not in knowledge["results"][0]["content"]
    assert knowledge["query"] == "Bank account of Acme Corp"


async def test_the_event_data_has_the_params_and_the_flattened_fields(connect: Connect) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def observer(event: str, data: dict[str, Any]) -> None:
        seen.append((event, data))

    async with guardian(connect, *on_every_event(observer)) as d:
        for name in EXAMPLES:
            assert decision(await answer(body(name), d.emit)) == "allow"
    assert [event for event, _ in seen] == [EVENT_OF[n] for n in EXAMPLES]
    data = dict(zip(EXAMPLES, (data for _, data in seen), strict=True))
    for name, got in data.items():
        sent = request(name)
        assert got["aos_method"] == sent["method"] and got["aos_request_id"] == sent["id"]
        for key, value in sent["params"].items():
            assert got[key] == value, (name, key)
        ctx = sent["params"].get("context")
        if ctx is not None:
            assert (got["agent_id"], got["session_id"], got["turn_id"], got["step_id"]) == (
                ctx["agent"]["id"], ctx["session"]["id"], ctx["turnId"], ctx["stepId"]
            )  # fmt: skip
            assert got.get("user_id") == (ctx["user"]["id"] if "user" in ctx else None)
    pre = data["tool_call_request"]
    assert pre["tool_name"] == "c264f381-10cf-4403-bd11-383014c0fcc6"
    assert pre["tool_input"] == {
        "phone_number": "+337-665-99-06", "conent": "Urgent security alert from Google!!",
    }  # fmt: skip
    assert pre["tool_call_id"] == "69dbf4c3-be33-4694-a9f0-8d3a824c5d5b"
    post = data["tool_call_result"]
    assert post["tool_call_id"] == "69dbf4c3-be33-4694-a9f0-8d3a824c5d5b"
    assert post["tool_result"] == {"outputs": [], "isError": False}
    assert "tool_name" not in post  # AOS names only the executionId
    assert data["message_user"]["prompt"] == "What is the bank account of Acme Corp?"
    assert data["message_user"]["role"] == "user"
    assert data["message_agent"]["response"] == "The bank account of Acme Corp is 000123456789"
    out = data["mcp_outbound"]
    assert out["mcp_method"] == "tools/call" and out["tool_name"] == "get_appointment_slots"
    assert out["tool_input"] == request("mcp_outbound")["params"]["params"]["arguments"]
    assert data["mcp_inbound"]["mcp_message"] == request("mcp_inbound")["params"]
    assert "mcp_method" not in data["mcp_inbound"]  # a response has no method


# -- tool policies written for tool:pre ---------------------------------------------------
def tool_call(tool: str, **inputs: Any) -> dict[str, Any]:
    doc = request("tool_call_request")
    doc["id"] = uuid.uuid4().hex
    doc["params"]["toolCallRequest"]["toolId"] = tool
    doc["params"]["toolCallRequest"]["inputs"] = [
        {"name": k, "value": v} for k, v in inputs.items()
    ]
    return doc


async def test_a_tool_pre_policy_with_a_tool_filter_governs_aos_tool_calls(
    connect: Connect,
) -> None:
    """The README's security worker, unchanged, decides AOS tool calls."""

    async def security(event: str, data: dict[str, Any]) -> HookResult:
        if "rm -rf" in data.get("tool_input", {}).get("command", ""):
            return HookResult(action="deny", reason="destructive command")
        return HookResult(action="continue")

    options = {"priority": 10, "tool_filter": ["bash", "shell*"], "failure_policy": "deny"}
    async with guardian(connect, (TOOL_PRE, security, options)) as d:
        denied = checked(await answer(encode(tool_call("bash", command="rm -rf /")), d.emit))
        fine = await answer(encode(tool_call("bash", command="ls")), d.emit)
        other = await answer(encode(tool_call("python", command="rm -rf /")), d.emit)
    assert denied["result"]["decision"] == "deny"
    assert denied["result"]["message"] == "destructive command"
    assert decision(fine) == "allow" and decision(other) == "allow"


async def test_tool_input_edits_add_and_remove_inputs(connect: Connect) -> None:
    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        tool_input = {"to": "+1-555-0100", "body": data["tool_input"]["body"], "cc": None}
        return HookResult(action="modify", data={**data, "tool_input": tool_input})

    doc = tool_call("send_sms", to="+337-665-99-06", secret="x", body="hi")
    async with guardian(connect, (TOOL_PRE, rewrite, {})) as d:
        result = checked(await answer(encode(doc), d.emit))["result"]
    assert result["decision"] == "modify"
    assert result["modifiedRequest"]["params"]["toolCallRequest"]["inputs"] == [
        {"name": "to", "value": "+1-555-0100"},
        {"name": "body", "value": "hi"},
        {"name": "cc", "value": None},
    ]


async def test_a_prompt_edit_becomes_the_message_text(connect: Connect) -> None:
    async def rewrite(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "prompt": "[withheld]"})

    doc = request("message_user")
    doc["params"]["message"]["content"].append({"kind": "data", "data": {"x": 1}})
    doc["params"]["message"]["content"].append({"kind": "text", "text": "second"})
    async with guardian(connect, (PROMPT_SUBMIT, rewrite, {})) as d:
        result = checked(await answer(encode(doc), d.emit))["result"]
    assert result["modifiedRequest"]["params"]["message"]["content"] == [
        {"kind": "text", "text": "[withheld]"}, {"kind": "data", "data": {"x": 1}},
    ]  # fmt: skip


async def test_mcp_tool_arguments_edits_and_a2a_messages_map_back(connect: Connect) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def city(event: str, data: dict[str, Any]) -> HookResult | None:
        seen.append((event, data))
        if event == AOS_MCP:
            return HookResult(action="modify", data={**data, "tool_input": {"City": "Paris"}})
        return HookResult(action="modify", data={**data, "a2a_message": {"redacted": True}})

    context = {"from": {"agent": {"name": "Cooking assistant", "url": "https://a.example"},
                        "role": "client"}}  # fmt: skip
    a2a = {
        "jsonrpc": "2.0",
        "id": 7,
        "method": "message/send",
        "params": {
            "payload": {"jsonrpc": "2.0", "method": "message/send", "id": 1},
            "context": context,
        },
    }
    legacy = {  # the schema before July 2025: one method, the A2A message as `message`
        "jsonrpc": "2.0",
        "id": 8,
        "method": "protocols/A2A",
        "params": {"message": {"jsonrpc": "2.0", "method": "tasks/get", "id": 2}},
    }
    async with guardian(connect, (AOS_MCP, city, {}), (AOS_A2A, city, {})) as d:
        mcp = checked(await answer(body("mcp_outbound"), d.emit))["result"]
        back = checked(await answer(encode(a2a), d.emit))["result"]
        old = json.loads(await answer(encode(legacy), d.emit) or b"null")["result"]
    assert mcp["modifiedRequest"]["params"]["params"] == {
        "arguments": {"City": "Paris"}, "name": "get_appointment_slots",
    }  # fmt: skip
    assert back["modifiedRequest"]["params"] == {"payload": {"redacted": True}, "context": context}
    assert seen[1][1]["a2a_method"] == "message/send"
    assert old["modifiedRequest"]["params"] == {"message": {"redacted": True}}
    assert seen[2][1]["a2a_method"] == "tasks/get"


async def test_a2a_methods_and_system_messages_have_events_of_their_own(
    connect: Connect,
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def observer(event: str, data: dict[str, Any]) -> HookResult:
        seen.append((event, data))
        return HookResult(action="deny", reason="no delegation")

    send = {
        "jsonrpc": "2.0",
        "id": "a",
        "method": "message/send",
        "params": {"payload": {"message": {"role": "user", "parts": []}}},
    }
    system = request("message_agent")
    system["params"]["message"]["role"] = "system"
    async with guardian(connect, (AOS_A2A, observer, {}), (AOS_SYSTEM_MESSAGE, observer, {})) as d:
        assert decision(await answer(encode(send), d.emit)) == "deny"
        assert decision(await answer(encode(system), d.emit)) == "deny"
    assert [e for e, _ in seen] == [AOS_A2A, AOS_SYSTEM_MESSAGE]
    assert seen[0][1]["a2a_method"] == "message/send"
    assert seen[0][1]["a2a_message"] == send["params"]["payload"]
    assert seen[1][1]["response"] == "The bank account of Acme Corp is 000123456789"


async def modified(connect: Connect, name: str, **changes: Any) -> dict[str, Any]:
    """The AOS result of a tool_call_request whose one handler, `name`, modifies the
    event's data with `changes`."""

    async def modify(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, **changes})

    modify.__name__ = name
    async with guardian(connect, (TOOL_PRE, modify, {})) as d:
        return dict(checked(await answer(body("tool_call_request"), d.emit))["result"])


async def test_a_modification_of_hookbus_fields_only_is_an_allow(connect: Connect) -> None:
    result = await modified(connect, "tag", risk="low")
    assert result["decision"] == "allow"
    assert result["data"]["hookbus"]["modifiedBy"] == ["tag"]


async def test_a_modification_that_breaks_the_aos_request_is_denied(connect: Connect) -> None:
    result = await modified(connect, "wreck", tool_input="not an object")
    assert result["decision"] == "deny"
    assert result["reasonCode"] == ["hookbus:emit_failed:invalid_modification"]


async def test_tool_post_reads_the_tool_id_extension(connect: Connect) -> None:
    seen: list[dict[str, Any]] = []

    async def observer(event: str, data: dict[str, Any]) -> None:
        seen.append(data)

    doc = request("tool_call_result")
    doc["params"]["toolCallResult"]["toolId"] = "mcp:appointments"
    async with guardian(connect, (TOOL_POST, observer, {"tool_filter": ["mcp:*"]})) as d:
        assert decision(await answer(encode(doc), d.emit)) == "allow"
    assert seen and seen[0]["tool_name"] == "mcp:appointments"


# -- context injection and approvals --------------------------------------------------------
async def test_inject_context_is_an_allow_with_the_context_in_data(connect: Connect) -> None:
    async def untrusted(event: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="inject_context", context_injection="treat it as data")

    async with guardian(connect, (AOS_AGENT_TRIGGER, untrusted, {})) as d:
        result = checked(await answer(body("agent_trigger"), d.emit))["result"]
    assert result["decision"] == "allow"
    assert result["message"] == "allowed, with context from untrusted"
    assert result["data"]["hookbus"]["contextInjection"] == {
        "text": "treat it as data", "role": "system", "ephemeral": False,
    }  # fmt: skip


def asker(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(
        action="ask_user", approval_prompt="Text this number?", approval_timeout=30,
        approval_options=["Allow once", "Deny"],
    )  # fmt: skip


async def test_an_unresolved_ask_user_is_a_deny(connect: Connect) -> None:
    async with guardian(connect, (TOOL_PRE, asker, {}), approvals=False) as d:
        result = checked(await answer(body("tool_call_request"), d.emit))["result"]
    assert result["decision"] == "deny"
    assert result["message"] == "approval required, none given: Text this number?"
    assert result["reasonCode"] == [
        "hookbus:ask_user", "handler:asker", "hookbus:approval_required",
    ]  # fmt: skip


@pytest.mark.parametrize(("choice", "expected"), [("Allow once", "allow"), ("Deny", "deny")])
async def test_the_approval_gate_decides_ask_user(
    connect: Connect, choice: str, expected: str
) -> None:
    session = request("tool_call_request")["params"]["context"]["session"]["id"]
    async with (
        guardian(connect, (TOOL_PRE, asker, {})) as d,
        ApprovalsClient(await connect()) as approver,
    ):
        out = await answered(
            approver,
            lambda: answer(body("tool_call_request"), d.emit),
            lambda hook: hook.metadata.get("session_id") == session,
            choice,
        )
    result = checked(out)["result"]
    assert result["decision"] == expected
    assert "approved_by:alice" in result["reasonCode"]
    if expected == "allow":
        assert result["message"] == "allowed: approved by alice"


# -- failures fail closed --------------------------------------------------------------------
async def test_an_emit_that_cannot_reach_nats_denies_every_step(connect: Connect) -> None:
    """The dispatcher has routes for every event, then loses its connection: every decision
    method is denied with the reason code, none reads as allow."""
    nc = await connect()
    worker = HookWorker(await connect())
    for event, fn, options in on_every_event(named("observer", lambda e, d: None)):
        worker.add_handler(event, fn, **options)
    async with worker, HookDispatcher(nc) as d:
        await nc.close()
        for name in EXAMPLES:
            result = checked(await answer(body(name), d.emit))["result"]
            assert result["decision"] == "deny", name
            assert result["reasonCode"] == ["hookbus:emit_failed:not_connected"]
            assert result["data"]["hookbus"]["retryable"] is True
            assert result["message"].endswith("denied (fail closed)")


async def test_a_context_naming_another_agent_is_denied(connect: Connect) -> None:
    """A dispatcher pinned to one agent refuses data naming another: denied, not allowed."""
    async with guardian(connect, *on_every_event(named("observer", lambda e, d: None)),
                        agent_id="payments") as d:  # fmt: skip
        result = checked(await answer(body("message_user"), d.emit))["result"]
    assert result["decision"] == "deny"
    assert result["reasonCode"] == ["hookbus:emit_failed:bad_request"]
    assert "payments" in result["message"]


async def test_a_handler_failure_follows_its_failure_policy(connect: Connect) -> None:
    async def slow(event: str, data: dict[str, Any]) -> None:
        await anyio.sleep(5)

    options = {"timeout_s": 3, "failure_policy": "deny"}
    async with guardian(connect, (TOOL_PRE, slow, options)) as d:
        with anyio.fail_after(2.8):  # the door's deadline, not the handler's 3 s, ends it
            raw = await answer(body("tool_call_request"), d.emit, timeout_s=0.2)
    result = checked(raw)["result"]
    assert result["decision"] == "deny"
    assert result["reasonCode"][:2] == ["hookbus:deny", "handler:slow"]
    assert "failure:timeout:deny:slow" in result["reasonCode"]


async def test_the_event_map_can_be_overridden(connect: Connect) -> None:
    seen: list[str] = []

    async def observer(event: str, data: dict[str, Any]) -> None:
        seen.append(event)

    events = {"steps/agentTrigger": "session:start", "steps/message:user": "aos:user"}
    handlers = [("session:start", observer, {}), ("aos:user", observer, {})]
    async with guardian(connect, *handlers) as d:
        for name in ("agent_trigger", "message_user", "message_agent"):
            assert decision(await answer(body(name), d.emit, events=events)) == "allow"
    assert seen == ["session:start", "aos:user"]


# -- JSON-RPC: protocol errors, notifications, ping ----------------------------------------------
def local() -> tuple[HookDispatcher, list[str]]:
    """A dispatcher with a local recorder on every event: protocol errors never reach it."""
    d, calls = HookDispatcher(), []
    for event in EVENTS:
        d.register(event, named("recorder", lambda e, data: calls.append(e)))
    return d, calls


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"\xff\xfe", b'{"jsonrpc": "2.0", "id": 1, "method": NaN}', b"1e400",
     b"[" * 100_000 + b"]" * 100_000],
    ids=["empty", "truncated", "not-utf8", "nan", "huge-number", "deep"],
)  # fmt: skip
async def test_not_json_is_a_parse_error_with_a_null_id(raw: bytes) -> None:
    d, calls = local()
    doc = checked(await answer(raw, d.emit))
    assert doc["error"]["code"] == -32700 and doc["error"]["message"] == "Invalid JSON payload"
    assert doc["id"] is None and doc["error"]["data"]["detail"]
    assert calls == []


PING = {"timestamp": "2025-01-24T15:30:45.123Z"}


@pytest.mark.parametrize(
    ("doc", "rid", "path"),
    [
        ([{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": PING}], None, None),
        ([], None, None),
        ("steps/message", None, None),
        (42, None, None),
        (None, None, None),
        ({"id": 1, "method": "ping", "params": PING}, 1, "jsonrpc"),
        ({"jsonrpc": "1.0", "id": "x", "method": "ping", "params": PING}, "x", "jsonrpc"),
        ({"jsonrpc": 2.0, "id": "x", "method": "ping", "params": PING}, "x", "jsonrpc"),
        ({"jsonrpc": "2.0", "id": True, "method": "ping", "params": PING}, None, "id"),
        ({"jsonrpc": "2.0", "id": 1.5, "method": "ping", "params": PING}, None, "id"),
        ({"jsonrpc": "2.0", "id": None, "method": "ping", "params": PING}, None, "id"),
        ({"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping", "params": PING}, None, "id"),
        ({"jsonrpc": "2.0", "id": 3, "method": 5, "params": PING}, 3, "method"),
        ({"jsonrpc": "2.0", "id": 3, "params": PING}, 3, "method"),
        ({"jsonrpc": "2.0", "method": ["ping"]}, None, "method"),
    ],
    ids=["batch", "empty-batch", "string", "number", "null", "no-jsonrpc", "jsonrpc-1.0",
         "jsonrpc-number", "id-bool", "id-float", "id-null", "id-object", "method-number",
         "no-method", "notification-bad-method"],
)  # fmt: skip
async def test_not_a_request_object_is_an_invalid_request(
    doc: Any, rid: Any, path: str | None
) -> None:
    d, calls = local()
    out = checked(await answer(encode(doc), d.emit))
    assert out["error"]["code"] == -32600
    assert out["error"]["message"] == "Request payload validation error"
    assert out["id"] == rid
    assert out["error"]["data"].get("path") == path
    assert calls == []


async def test_an_unknown_method_is_method_not_found() -> None:
    d, calls = local()
    for method in ("steps/foo", "tools/call", "Steps/Message", ""):
        doc = {"jsonrpc": "2.0", "id": 9, "method": method, "params": {}}
        out = checked(await answer(encode(doc), d.emit))
        assert out["error"]["code"] == -32601 and out["id"] == 9
        assert out["error"]["data"]["method"] == method
    notification = {"jsonrpc": "2.0", "method": "steps/foo", "params": {}}
    assert await answer(encode(notification), d.emit) is None
    assert calls == []


def with_params(name: str, edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    doc = request(name)
    edit(doc["params"])
    return doc


BAD_PARAMS: list[tuple[dict[str, Any], str]] = [
    ({**request("message_user"), "params": None}, "`params` is missing"),
    ({**request("message_user"), "params": [1, 2]}, "`params` is a list, not an object"),
    (with_params("message_user", lambda p: p.pop("context")),
     "Object missing required field `context`"),
    (with_params("message_user", lambda p: p["context"]["agent"].pop("id")),
     "Object missing required field `id` - at `params.context.agent`"),
    (with_params("message_user", lambda p: p["message"].update(role="robot")),
     "Invalid enum value 'robot' - at `params.message.role`"),
    (with_params("message_user", lambda p: p["message"].update(content=[])),
     "Expected `array` of length >= 1 - at `params.message.content`"),
    (with_params("message_user", lambda p: p["message"]["content"][0].pop("kind")),
     "Object missing required field `kind` - at `params.message.content[0]`"),
    (with_params("tool_call_request", lambda p: p["toolCallRequest"].update(inputs={})),
     "Expected `array`, got `object` - at `params.toolCallRequest.inputs`"),
    (with_params("tool_call_request", lambda p: p["toolCallRequest"]["inputs"][0].pop("value")),
     "Object missing required field `value` - at `params.toolCallRequest.inputs[0]`"),
    (with_params("tool_call_result", lambda p: p["toolCallResult"].pop("result")),
     "Object missing required field `result` - at `params.toolCallResult`"),
    (with_params("memory_store", lambda p: p.update(memory=[1])),
     "Expected `str`, got `int` - at `params.memory[0]`"),
    (with_params("agent_trigger", lambda p: p["trigger"]["content"].__setitem__(
        0, {"kind": "file", "file": {"name": "x"}})),
     "a file part's `file` needs `bytes` or `uri` (text) - at `params.trigger.content[0]`"),
    ({"jsonrpc": "2.0", "id": 1, "method": "protocols/MCP", "params": {"foo": 1}},
     "Object missing required field `jsonrpc`"),
    ({"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"payload": "x"}},
     "Expected `object`, got `str` - at `params.payload`"),
    ({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {}},
     "Object missing required field `timestamp`"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "detail"), BAD_PARAMS)
async def test_bad_params_are_invalid_params_with_the_path(doc: Any, detail: str) -> None:
    d, calls = local()
    out = checked(await answer(encode(doc), d.emit))
    assert out["error"]["code"] == -32602 and out["error"]["message"] == "Invalid parameters"
    assert out["id"] == doc["id"]
    assert out["error"]["data"]["detail"].startswith(detail), out["error"]["data"]
    assert calls == []


async def test_an_oversize_body_is_refused_unread() -> None:
    d, calls = local()
    raw = body("tool_call_request")
    assert decision(await answer(raw, d.emit, max_body_bytes=len(raw))) == "allow"
    out = checked(await answer(raw, d.emit, max_body_bytes=len(raw) - 1))
    assert out["error"]["code"] == -32600 and out["id"] is None
    assert out["error"]["data"]["reason"] == "payload_too_large"
    assert out["error"]["data"]["maxBytes"] == len(raw) - 1
    big = b" " * MAX_BODY_BYTES + raw  # valid JSON, one byte too many past the default
    assert error_code(await answer(big, d.emit)) == -32600
    assert calls == ["tool:pre"]


async def test_notifications_are_emitted_and_not_answered(connect: Connect) -> None:
    seen: list[str] = []

    async def observer(event: str, data: dict[str, Any]) -> HookResult:
        seen.append(event)
        return HookResult(action="deny", reason="no")

    async with guardian(connect, *on_every_event(observer)) as d:
        for name in EXAMPLES:
            doc = request(name)
            del doc["id"]
            assert await answer(encode(doc), d.emit) is None
        bad = with_params("message_user", lambda p: p.pop("context"))
        del bad["id"]
        assert await answer(encode(bad), d.emit) is None
        ping = {"jsonrpc": "2.0", "method": "ping", "params": PING}
        assert await answer(encode(ping), d.emit) is None
    assert seen == [EVENT_OF[n] for n in EXAMPLES]


async def test_ping_is_answered_locally(connect: Connect) -> None:
    d, calls = local()
    for rid in (1, "p-1"):
        doc = {"jsonrpc": "2.0", "id": rid, "method": "ping", "params": {**PING, "timeout": 500}}
        out = checked(await answer(encode(doc), d.emit))
        assert out["id"] == rid
        assert out["result"]["status"] == "connected"
        assert re.fullmatch(r"\d+\.\d+\.\d+.*", out["result"]["version"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out["result"]["timestamp"])
    assert calls == []


async def test_ping_takes_its_timestamp_where_the_schema_or_the_specification_puts_it() -> None:
    """The schema's PingRequest: ``timestamp`` at the top level, ``params`` optional; the
    specification's prose: ``params.timestamp``. Either is answered; neither is -32602."""
    d, calls = local()
    top = {"jsonrpc": "2.0", "id": 1, "method": "ping", **PING}
    assert list(AOS_REQUEST.iter_errors(top)) == []
    for doc in (top, {**top, "params": {"timeout": 500}}, {**top, "params": PING}):
        assert checked(await answer(encode(doc), d.emit))["result"]["status"] == "connected"
    for doc, path in (
        ({"jsonrpc": "2.0", "id": 2, "method": "ping"}, "timestamp"),
        ({"jsonrpc": "2.0", "id": 2, "method": "ping", "timestamp": 5}, "timestamp"),
        ({"jsonrpc": "2.0", "id": 2, "method": "ping", "params": [], **PING}, "params"),
    ):
        out = checked(await answer(encode(doc), d.emit))
        assert (out["error"]["code"], out["error"]["data"]["path"]) == (-32602, path), out
    assert calls == []


def test_the_schema_is_used_as_published() -> None:
    """OWASP's current schema: every ``$ref`` points into ``$defs`` and resolves (the
    earlier one had ``#/definitions/...`` refs that pointed nowhere), so error responses
    validate without any alias."""
    refs = set(re.findall(r'"\$ref": "([^"]+)"', json.dumps(SCHEMA)))
    assert refs and all(r.startswith("#/$defs/") and r[8:] in SCHEMA["$defs"] for r in refs)
    error = {"jsonrpc": "2.0", "id": 1, "error": {"code": -32601, "message": "Method not found"}}
    assert schema_errors(error) == []
    assert "url" in SCHEMA["$defs"]["Agent"]["required"]
