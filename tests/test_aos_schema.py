"""The AOS door checked against OWASP's current ``aos_schema.json``, over HTTP.

Everything is real: a private nats-server per test, `HookWorker` handlers on their own
connections, the gateway (`gateway_app` with a `Replica`, as ``hookbus gateway aos`` builds
it) served by uvicorn on a free loopback port, and httpx. The schema is the vendored copy
in tests/fixtures/aos/ (its README names the repository, path and commit), validated with
`jsonschema` as published.

The table: every documented AOS message (the README's and docs/gateway.md's curl examples,
the ten examples of the specification's "Supported hooks" page, the A2A methods as the
schema spells them and as the specification does, ``ping`` with its ``timestamp`` where the
schema puts it and where the prose does), whether it is a valid request, and whether every
answer the door gives it (under a denying and a modifying policy) is a valid response.
``pytest -s`` prints it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from _integration_kit import Connect, private_connect
from _served_app import served

from hookbus.cli._gateway_cmd import Replica
from hookbus.dispatcher import HookDispatcher
from hookbus.integrations.aos import (
    AOS_A2A,
    AOS_AGENT_TRIGGER,
    AOS_KNOWLEDGE_RETRIEVAL,
    AOS_MCP,
    AOS_MEMORY_RETRIEVAL,
    AOS_MEMORY_STORE,
    AOS_SYSTEM_MESSAGE,
)
from hookbus.integrations.gateway import DEFAULT_MAX_BODY_BYTES, gateway_app
from hookbus.schemas import PROMPT_COMPLETE, PROMPT_SUBMIT, TOOL_POST, TOOL_PRE, HookResult
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "aos"
SCHEMA = json.loads((FIXTURES / "aos_schema.json").read_text())
TOKEN = "aos-schema-token-5c2e"


def validator(ref: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator({**SCHEMA, "$ref": f"#/$defs/{ref}"})


REQUEST, RESPONSE, ERROR = (
    validator("ASOPRequest"), validator("ASOPResponse"), validator("JSONRPCErrorResponse"),
)  # fmt: skip


def errors(v: jsonschema.Draft7Validator, doc: Any) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc))


# -- the documented messages -------------------------------------------------------------------
def curl_body(path: Path, after: str) -> dict[str, Any]:
    """The JSON of the first ``curl ... -d '...'`` after `after` in the doc `path`."""
    text = path.read_text()
    found = re.search(r"-d '(\{.*?\})'", text[text.index(after) :], re.S)
    assert found, (path, after)
    doc: dict[str, Any] = json.loads(found.group(1))
    return doc


def a2a(method: str) -> dict[str, Any]:
    """An A2A hook request as the specification's "Send Message Request (Client)" page
    sends it: the A2A message as ``payload``, the ``from`` / ``to`` agents as ``context``."""
    return {
        "jsonrpc": "2.0",
        "id": f"a2a-{method}",
        "method": method,
        "params": {
            "payload": {
                "jsonrpc": "2.0",
                "id": 1,
                "method": method.replace("task/", "tasks/"),
                "params": {"id": "2232321", "metadata": {}},
            },
            "reasoning": "delegate to the agent that specializes in cakes",
            "context": {
                "from": {
                    "agent": {
                        "name": "Cooking assistant",
                        "url": "https://cooking-assistant.example.com/api/v1",
                        "instructions": "You help with cooking.",
                        "version": "1.0.0",
                        "provider": {"name": "OpenAI", "url": "https://openai.com"},
                    },
                    "role": "client",
                },
                "to": {
                    "agent": {"url": "https://api.cakebaker.example.com/v1", "name": "Cake Baker"},
                    "role": "server",
                },
            },
        },
    }


SCHEMA_A2A = (  # the A2A methods of the schema's ASOPRequest, spelled as it spells them
    "message/send", "message/stream", "task/pushNotificationConfig/set",
    "task/pushNotificationConfig/get", "tasks/resubscribe", "tasks/cancel", "task/get",
)  # fmt: skip
SPEC_ONLY_A2A = (
    "tasks/pushNotificationConfig/set",
    "tasks/pushNotificationConfig/get",
    "tasks/get",
)
"""The specification's (and A2A's) spellings of three of them: not in the schema's
ASOPRequest, accepted by the door."""
PING_AT = "2025-07-17T10:00:00.000Z"

MESSAGES: dict[str, dict[str, Any]] = {
    "README: curl to the AOS door": curl_body(ROOT / "README.md", "hookbus gateway aos --url"),
    "docs/gateway.md: AOS with curl": curl_body(ROOT / "docs" / "gateway.md", "### AOS with curl"),
    **{
        f"seed: {p.stem}": json.loads(p.read_text())
        for p in sorted(FIXTURES.glob("*.json"))
        if p.name != "aos_schema.json"
    },
    **{f"a2a: {m}": a2a(m) for m in SCHEMA_A2A + SPEC_ONLY_A2A},
    "ping: timestamp at the top (schema)": {
        "jsonrpc": "2.0", "id": "ping-1", "method": "ping", "timestamp": PING_AT,
    },
    "ping: params.timestamp (specification)": {
        "jsonrpc": "2.0", "id": "ping-2", "method": "ping", "params": {"timestamp": PING_AT},
    },
}  # fmt: skip
NOT_IN_SCHEMA = {f"a2a: {m}" for m in SPEC_ONLY_A2A} | {"ping: params.timestamp (specification)"}
"""Documented by the specification's prose, not requests of the schema: the door answers
them; a ``modify`` echoes their method, so its ``modifiedRequest`` is not one either."""


# -- the policies ------------------------------------------------------------------------------
CHECKED = "[checked]"
EDITS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    TOOL_PRE: lambda d: {"tool_input": dict.fromkeys(d["tool_input"], CHECKED)},
    TOOL_POST: lambda d: {
        "tool_result": {**d["tool_result"], "outputs": [{"kind": "text", "text": CHECKED}]}
    },
    PROMPT_SUBMIT: lambda d: {"prompt": CHECKED},
    PROMPT_COMPLETE: lambda d: {"response": CHECKED},
    AOS_SYSTEM_MESSAGE: lambda d: {"response": CHECKED},
    AOS_AGENT_TRIGGER: lambda d: {
        "trigger": {**d["trigger"], "content": [{"kind": "text", "text": CHECKED}]}
    },
    AOS_MEMORY_RETRIEVAL: lambda d: {"memory": [CHECKED]},
    AOS_MEMORY_STORE: lambda d: {"memory": [CHECKED]},
    AOS_KNOWLEDGE_RETRIEVAL: lambda d: {
        "knowledgeStep": {**d["knowledgeStep"], "results": [{"id": "k", "content": CHECKED}]}
    },
    AOS_MCP: lambda d: {"mcp_message": {**d["mcp_message"], "_meta": {"checked": True}}},
    AOS_A2A: lambda d: {"a2a_message": {**d["a2a_message"], "metadata": {"checked": True}}},
}


async def deny(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="deny", reason=f"{event} is not allowed here")


async def modify(event: str, data: dict[str, Any]) -> HookResult:
    return HookResult(action="modify", data={**data, **EDITS[event](data)})


# -- a gateway replica over HTTP ---------------------------------------------------------------
connect = private_connect


@contextlib.asynccontextmanager
async def gateway(connect: Connect, handler: Any = None, **options: Any) -> AsyncIterator[str]:
    """Workers serving `handler` on every event the door emits, and a gateway replica
    (its own connection and dispatcher) serving ``/aos``; yields the gateway's URL."""
    worker = HookWorker(await connect())
    if handler is not None:
        for event in EDITS:
            worker.add_handler(event, handler)
    nc = await connect()
    replica = Replica(nc, HookDispatcher(nc, strict_events=True, approvals=False))
    await replica.dispatcher.start()
    app = gateway_app(
        replica.emit, doors={"aos"}, ready=replica.ready, lifespan=replica.lifespan, **options
    )
    async with worker, served(app) as url:
        yield url


# -- the table ---------------------------------------------------------------------------------
def test_every_documented_message_is_a_request_of_the_schema() -> None:
    """Each message is a valid ASOPRequest, but those the schema does not define."""
    for name, doc in MESSAGES.items():
        found = errors(REQUEST, doc)
        assert (found == []) == (name not in NOT_IN_SCHEMA), (name, found)
    assert len(MESSAGES) == 2 + 10 + 10 + 2


async def test_every_answer_to_a_documented_message_is_a_response_of_the_schema(
    connect: Connect,
) -> None:
    answers: dict[str, dict[str, dict[str, Any]]] = {}
    for world, handler in (("deny", deny), ("modify", modify)):
        async with (
            gateway(connect, handler) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as http,
        ):
            for name, doc in MESSAGES.items():
                reply = await http.post("/aos", json=doc)
                assert reply.status_code == 200, (name, reply.text)
                assert reply.headers["content-type"] == "application/json"
                answers.setdefault(name, {})[world] = reply.json()
    rows = []
    for name, doc in MESSAGES.items():
        by_world = answers[name]
        is_ping = doc["method"] == "ping"
        for world, out in by_world.items():
            assert out["id"] == doc["id"], (name, world, out)
            if is_ping:
                assert out["result"]["status"] == "connected", (name, out)
            else:  # every step is decided as the policy says: nothing is left unanswered
                assert out["result"]["decision"] == world, (name, world, out)
            found = errors(RESPONSE, out)
            if name in NOT_IN_SCHEMA and world == "modify" and not is_ping:
                # the echo has the agent's own method, which the schema spells "task/..."
                respelled = copy.deepcopy(out)
                echo = respelled["result"]["modifiedRequest"]
                echo["method"] = echo["method"].replace("tasks/", "task/")
                assert found and errors(RESPONSE, respelled) == [], (name, found)
            else:
                assert found == [], (name, world, found)
        modified = by_world["modify"].get("result", {}).get("modifiedRequest")
        if modified is not None:  # the context is echoed as sent (Agent.url included)
            assert modified["params"].get("context") == doc["params"].get("context"), name
        rows.append(
            (name, "yes" if name not in NOT_IN_SCHEMA else "no (prose only)",
             "yes" if not errors(RESPONSE, by_world["deny"]) else "NO",
             "-" if is_ping else "yes" if not errors(RESPONSE, by_world["modify"]) else
             "echo of a non-schema method")
        )  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"\n{'message':<{width}}  request valid    deny answer valid  modify answer valid")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:<15}  {r[2]:<17}  {r[3]}")


# -- refusals: every answer a JSON-RPC response -------------------------------------------------
def refusal(reply: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """`reply` is a JSON-RPC error response: status `status`, ``id`` null, -32600,
    ``data.reason`` `reason`; valid per the schema but for the null ``id`` (JSON-RPC 2.0
    requires null for a request that could not be read; the schema has string | integer)."""
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    out: dict[str, Any] = reply.json()
    assert out["jsonrpc"] == "2.0" and out["id"] is None, out
    assert out["error"]["code"] == -32600, out
    assert out["error"]["message"] == "Request payload validation error"
    assert out["error"]["data"]["reason"] == reason and out["error"]["data"]["detail"], out
    assert errors(ERROR, out) == ["id: None is not of type 'string', 'integer'"]
    assert errors(ERROR, {**out, "id": 0}) == []
    return out


def body_of(size: int) -> bytes:
    """A valid AOS request padded with spaces to `size` bytes."""
    raw = json.dumps(MESSAGES["seed: tool_call_request"]).encode()
    return raw + b" " * (size - len(raw))


async def test_an_oversize_body_is_a_json_rpc_error(connect: Connect) -> None:
    """Over 1 MiB (the gateway's default): 413, and a JSON-RPC error, whether the
    ``Content-Length`` says so or a chunked body passes the limit; 1 MiB exactly is read."""

    async def chunked(size: int) -> AsyncIterator[bytes]:
        data = body_of(size)
        for start in range(0, len(data), 64 * 1024):
            yield data[start : start + 64 * 1024]

    async with (
        gateway(connect, deny) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        at_limit = await http.post("/aos", content=body_of(DEFAULT_MAX_BODY_BYTES))
        over = await http.post("/aos", content=body_of(DEFAULT_MAX_BODY_BYTES + 1))
        streamed = await http.post("/aos", content=chunked(DEFAULT_MAX_BODY_BYTES + 1))
    assert at_limit.status_code == 200 and at_limit.json()["result"]["decision"] == "deny"
    for reply in (over, streamed):
        out = refusal(reply, 413, "payload_too_large")
        assert out["error"]["data"]["maxBytes"] == DEFAULT_MAX_BODY_BYTES
        assert out["error"]["data"]["detail"] == f"the body is over {DEFAULT_MAX_BODY_BYTES} bytes"


async def test_every_early_refusal_is_a_json_rpc_error(connect: Connect) -> None:
    """No token, a wrong one, another HTTP method, a bad ``Content-Length``: the HTTP status
    as before, a JSON-RPC error response as the body. Not JSON (whatever the content type
    says) is the door's own -32700, answered 200."""
    doc = MESSAGES["seed: tool_call_request"]
    async with (
        gateway(connect, deny, token=TOKEN) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        auth = {"Authorization": f"Bearer {TOKEN}"}
        missing = await http.post("/aos", json=doc)
        wrong = await http.post("/aos", json=doc, headers={"Authorization": "Bearer nope"})
        get = await http.get("/aos", headers=auth)
        put = await http.put("/aos", json=doc, headers=auth)
        text = await http.post("/aos", content=b"{not json", headers={
            **auth, "Content-Type": "text/plain"})  # fmt: skip
        form = await http.post("/aos", data={"a": "b"}, headers=auth)
        right = await http.post("/aos", json=doc, headers=auth)
    assert missing.headers["www-authenticate"] == 'Bearer realm="hookbus"'
    assert "Authorization: Bearer" in refusal(missing, 401, "unauthorized")["error"]["data"][
        "detail"]  # fmt: skip
    assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
    refusal(wrong, 401, "unauthorized")
    for reply in (get, put):
        refusal(reply, 405, "method_not_allowed")
        assert reply.headers["allow"] == "POST"
    for reply in (text, form):
        assert reply.status_code == 200
        out = reply.json()
        assert (out["id"], out["error"]["code"]) == (None, -32700), out
    assert right.json()["result"]["decision"] == "deny"
    # a Content-Length that is not a number: uvicorn's parser answers it (400, its own
    # text) before any app; an ASGI server that passes it on gets the gateway's answer
    app = gateway_app(HookDispatcher().emit, doors={"aos"})
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as asgi:
        bad_length = await asgi.post("/aos", content=b"{}", headers={"Content-Length": "ten"})
    refusal(bad_length, 400, "bad_request")


async def test_a_schema_ping_is_answered_over_http(connect: Connect) -> None:
    """The schema's ping (top-level ``timestamp``, no ``params``) is answered, not -32602."""
    async with (
        gateway(connect, deny) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        reply = await http.post("/aos", json=MESSAGES["ping: timestamp at the top (schema)"])
        none = await http.post("/aos", json={"jsonrpc": "2.0", "id": 3, "method": "ping"})
    out = reply.json()
    assert out["id"] == "ping-1" and out["result"]["status"] == "connected", out
    assert errors(RESPONSE, out) == []
    bad = none.json()
    assert (bad["id"], bad["error"]["code"]) == (3, -32602) and errors(RESPONSE, bad) == []
