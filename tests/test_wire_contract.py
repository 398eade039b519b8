"""The written wire contract, checked with the tools a team in another language would use.

- ``hookbus schema`` loads in ajv (npm ``ajv``, JSON Schema 2020-12, ``strict: true``),
  describes every property, and accepts and refuses what the contract says;
- ``hookbus asyncapi`` parses without errors or warnings in the AsyncAPI project's own parser
  (npm ``@asyncapi/parser``), and a broken document does not;
- a real run (``hookbus worker`` and ``hookbus dispatcher --audit`` processes over a real
  nats-server, an agent sending plain NATS requests, an approver, the CLI) is recorded
  byte for byte with a ``>`` subscription; every hookbus message and KV value on the wire
  is matched to its AsyncAPI channel and validated by ajv against its schema.

The npm packages (pinned in ``tests/node/package.json``) are installed by this module into
``~/.cache/hookbus/node-contract-<hash>/`` (``XDG_CACHE_HOME`` respected), never into the
work tree. Without ``node``/``npm`` the Node checks skip with the reason, and fail when
``CI`` is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import nats
import pytest
from _fleet import WORKER_READY, Fleet, run_cli
from _node import node_packages
from click.testing import CliRunner

from hookbus._core.nats_guard import order_flushes
from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._asyncapi import asyncapi_document
from hookbus.cli._command_tree import cli
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    WIRE_ERROR_CODES,
    WIRE_TYPES,
    SuspensionCancelledError,
    chain_subject,
    emit_service_subject,
    encode_token,
    handler_set_id,
)
from hookbus.schemas._contract import attribute_docs

NODE_DIR = Path(__file__).resolve().parent / "node"
SCRIPT = NODE_DIR / "contract.cjs"
HOOKBUS = [sys.executable, "-m", "hookbus.cli"]


# -- the Node tools ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """``ajv`` and ``@asyncapi/parser`` (tests/node/package.json), installed by npm into
    the cache folder outside the work tree (see `_node`)."""
    return node_packages(NODE_DIR / "package.json", "node-contract")


def _node(node_modules: Path, *args: str) -> Any:
    proc = subprocess.run(
        ["node", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_PATH": str(node_modules)},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _validate(node_modules: Path, tmp_path: Path, schema: dict[str, Any], cases: list[Any]) -> Any:
    schema_file, cases_file = tmp_path / "schema.json", tmp_path / "cases.json"
    schema_file.write_text(json.dumps(schema))
    cases_file.write_text(json.dumps(cases))
    return _node(node_modules, "validate", str(schema_file), str(cases_file))


def _cli_output(*args: str) -> str:
    proc = subprocess.run([*HOOKBUS, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# -- hookbus schema ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema_doc() -> dict[str, Any]:
    """What ``hookbus schema`` prints."""
    doc: dict[str, Any] = json.loads(_cli_output("schema"))
    return doc


def test_schema_loads_in_ajv_strict_mode(node_modules, tmp_path, schema_doc):
    path = tmp_path / "wire.json"
    path.write_text(json.dumps(schema_doc))
    assert _node(node_modules, "compile", str(path)) == {"ok": True}


def test_ajv_strict_mode_refuses_an_unknown_keyword(node_modules, tmp_path, schema_doc):
    """The check above can fail: the former root keyword ``types`` is refused."""
    path = tmp_path / "wire.json"
    path.write_text(json.dumps({**schema_doc, "types": ["EventEnvelope"]}))
    out = _node(node_modules, "compile", str(path))
    assert out["ok"] is False
    assert 'unknown keyword: "types"' in out["error"]


def _properties(doc: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (name, field, prop)
        for name, definition in doc["$defs"].items()
        for field, prop in definition.get("properties", {}).items()
    ]


def test_every_type_and_property_is_described(schema_doc):
    undescribed = [f"{n}.{f}" for n, f, p in _properties(schema_doc) if not p.get("description")]
    assert undescribed == []
    assert [n for n, d in schema_doc["$defs"].items() if not d.get("description")] == []
    assert len(_properties(schema_doc)) > 100


def _is_number(prop: dict[str, Any]) -> bool:
    return prop.get("type") == "number" or any(
        branch.get("type") == "number" for branch in prop.get("anyOf", [])
    )


def test_numbers_and_times_name_their_unit(schema_doc):
    """Every non-integer number is a time or a duration: its description says seconds;
    a time written as text says RFC 3339."""
    numbers = [(n, f, p["description"]) for n, f, p in _properties(schema_doc) if _is_number(p)]
    assert len(numbers) >= 12
    assert [(n, f) for n, f, d in numbers if "seconds" not in d.lower()] == []
    assert (
        "RFC 3339" in schema_doc["$defs"]["DecisionRecord"]["properties"]["time_iso"]["description"]
    )


def test_descriptions_come_from_the_attribute_docstrings(schema_doc):
    """The contract is generated from the code: each description is the field's docstring."""
    for cls in WIRE_TYPES:
        docs = attribute_docs(cls)
        props = schema_doc["$defs"][cls.__name__]["properties"]
        assert set(docs) == set(props), cls.__name__
        assert {f: p["description"] for f, p in props.items()} == docs


def test_schema_required_enums_and_one_of(schema_doc):
    defs = schema_doc["$defs"]
    assert defs["WireError"]["properties"]["code"]["enum"] == list(WIRE_ERROR_CODES)
    assert set(defs["HookResult"]["properties"]["action"]["enum"]) == {
        "continue", "deny", "modify", "inject_context", "ask_user",
    }  # fmt: skip
    assert {"event", "name", "subject", "collect_subject", "queue_group"} <= set(
        defs["HandlerDeclaration"]["required"]
    )
    assert "action" in defs["HookResult"]["required"]
    assert [b["required"] for b in defs["EmitReply"]["oneOf"]] == [["result"], ["error"]]
    assert [b["required"] for b in defs["HookReply"]["oneOf"]] == [["result"], ["error"], ["chain"]]


VALID = [
    ("HookReply", {"handler": "h", "result": {"action": "deny", "reason": "no"}}),
    ("HookReply", {"handler": "h", "error": {"code": "busy", "message": "m", "retryable": True}}),
    ("HookReply", {"handler": "h", "result": {"action": "continue"}, "error": None}),
    ("HookReply", {"handler": "set", "chain": [{"handler": "h", "result": {"action": "deny"}}]}),
    ("EventEnvelope", {"id": "e", "event": "tool:pre", "data": {}, "chain": [{"handler": "h"}]}),
    ("EmitReply", {"result": {"action": "continue", "data": {"a": 1}}}),
    ("EmitReply", {"error": {"code": "bad_request", "message": "$.data"}}),
    ("CollectReply", {"responses": [{"a": 1}]}),
    ("CollectReply", {"error": {"code": "bad_request", "message": "m"}}),
    ("EventEnvelope", {"id": "e", "event": "tool:pre", "data": {}, "budget_s": 4.5}),
    ("EventEnvelope", {"id": "e", "event": "tool:pre", "data": {}, "idempotency_key": "k"}),
    ("EmitRequest", {"data": {}, "timeout_s": 3, "approval_timeout_s": 2.4}),
    (
        "HandlerDeclaration",
        {
            "event": "tool:pre",
            "name": "h",
            "subject": "hookbus.v1.handler.tool=3Apre.h",
            "collect_subject": "hookbus.v1.collect.tool=3Apre",
            "queue_group": "h",
        },
    ),
    ("ApprovalAnswer", {"choice": "Allow once", "answered_by": "alice"}),
]

INVALID = [
    ("both result and error", "HookReply",
     {"handler": "h", "result": {"action": "continue"}, "error": {"code": "busy", "message": ""}}),
    ("neither result nor error", "HookReply", {"handler": "h"}),
    ("a chain and a result", "HookReply",
     {"handler": "h", "result": {"action": "continue"}, "chain": []}),
    ("EmitReply with neither", "EmitReply", {}),
    ("EmitReply with both", "EmitReply",
     {"result": {"action": "deny"}, "error": {"code": "internal", "message": ""}}),
    ("unknown error code", "WireError", {"code": "oops", "message": "m"}),
    ("unknown action", "HookResult", {"action": "explode"}),
    ("result without an action", "HookResult", {"reason": "r"}),
    ("declaration without subject", "HandlerDeclaration",
     {"event": "e", "name": "n", "collect_subject": "c", "queue_group": "n"}),
    ("bad failure policy", "HandlerDeclaration",
     {"event": "e", "name": "n", "subject": "s", "collect_subject": "c", "queue_group": "n",
      "failure_policy": "maybe"}),
    ("envelope without data", "EventEnvelope", {"id": "a", "event": "e"}),
    ("failed collect with responses", "CollectReply",
     {"responses": [1], "error": {"code": "internal", "message": "m"}}),
    ("timeout as text", "CollectRequest", {"timeout_s": "soon"}),
    ("approval timeout of 0", "EmitRequest", {"data": {}, "approval_timeout_s": 0}),
    ("approval label", "ApprovalRecord",
     {"label": "x", "status": "pending", "metadata": {}, "write_id": "w", "created_at": 1.0}),
]  # fmt: skip


def test_ajv_accepts_and_refuses_what_the_contract_says(node_modules, tmp_path, schema_doc):
    cases = [{"id": f"ok {i}", "def": d, "instance": x} for i, (d, x) in enumerate(VALID)]
    cases += [{"id": why, "def": d, "instance": x} for why, d, x in INVALID]
    results = {r["id"]: r for r in _validate(node_modules, tmp_path, schema_doc, cases)}
    assert [i for i, r in results.items() if i.startswith("ok ") and not r["valid"]] == []
    assert [i for i, r in results.items() if not i.startswith("ok ") and r["valid"]] == []


# -- hookbus schema / asyncapi: the command --------------------------------------------------


@pytest.mark.parametrize("command", ["schema", "asyncapi"])
def test_a_bad_out_path_is_one_error_line(tmp_path, command):
    result = CliRunner().invoke(cli, [command, "--out", str(tmp_path / "missing" / "x.json")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    missing = tmp_path / "missing" / "x.json"
    assert lines == [f"Error: cannot write {missing}: No such file or directory"]


def test_asyncapi_command_writes_yaml_and_json(tmp_path):
    yaml = pytest.importorskip("yaml")
    result = CliRunner().invoke(cli, ["asyncapi", "--out", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    as_json = json.loads((tmp_path / "a.json").read_text())
    as_yaml = yaml.safe_load(_cli_output("asyncapi"))
    assert as_json == as_yaml == json.loads(json.dumps(asyncapi_document()))
    assert as_json["asyncapi"] == "3.0.0"


# -- hookbus asyncapi ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def asyncapi_yaml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("asyncapi") / "hookbus.yaml"
    path.write_text(_cli_output("asyncapi"))
    return path


def test_asyncapi_parses_without_errors_or_warnings(node_modules, asyncapi_yaml):
    out = _node(node_modules, "asyncapi", str(asyncapi_yaml))
    serious = [d for d in out["diagnostics"] if d["severity"] <= 1]  # 0 error, 1 warning
    assert serious == []
    doc = asyncapi_document()
    assert out["channels"] == len(doc["channels"]) >= 15
    assert out["operations"] == len(doc["operations"])
    assert out["messages"] == len(doc["components"]["messages"])


def _break_operation(doc: dict[str, Any]) -> None:
    doc["operations"]["serveEmit"]["messages"] = [
        {"$ref": "#/channels/handler/messages/eventEnvelope"}
    ]


def _break_parameters(doc: dict[str, Any]) -> None:
    doc["channels"]["emit"]["parameters"]["nope"] = {"description": "not in the address"}


def _break_payload(doc: dict[str, Any]) -> None:
    doc["components"]["schemas"]["HookReply"]["properties"]["handler"]["type"] = "strnig"


@pytest.mark.parametrize(
    ("breakage", "code"),
    [
        (_break_operation, "asyncapi3-operation-messages-from-referred-channel"),
        (_break_parameters, "asyncapi3-channel-parameters"),
        (_break_payload, "asyncapi-document-resolved"),
    ],
)
def test_the_asyncapi_parser_refuses_a_broken_document(node_modules, tmp_path, breakage, code):
    """The check above can fail: an operation sending another channel's message, a
    parameter its address does not name, a payload schema that is not a schema."""
    doc = asyncapi_document()
    breakage(doc)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(doc))
    out = _node(node_modules, "asyncapi", str(path))
    assert code in {d["code"] for d in out["diagnostics"] if d["severity"] == 0}


def test_asyncapi_covers_every_subject_family_and_bucket():
    doc = asyncapi_document()
    addresses = {c["address"] for c in doc["channels"].values() if c["address"]}
    assert addresses >= {
        "hookbus.v1.handler.{event}.{handler}",
        "hookbus.v1.handler.{event}.{handler}.{instance}",
        "hookbus.v1.collect.{event}",
        "hookbus.v1.emit.{agent}.{event}",
        "hookbus.v1.emit_and_collect.{agent}.{event}",
        "hookbus.v1.suspension.{agent}.{label}.{status}",
        "hookbus.v1.decisions.{agent}",
        "$KV.hookbus_handlers.{event}.{handler}",
        "$KV.hookbus_handlers._required.{event}.{handler}",
        "$KV.hookbus_suspensions.{agent}.{label}",
        "$KV.hookbus_suspensions.{agent}.{label}.{approver}",
        "$KV.hookbus_approvals.{grantAgent}.{session}.{event}.{handler}.{tool}",
        "$KV.hookbus_leases.w.{waiter}",
        "$SRV.{verb}.hookbus-worker",
        "$SRV.{verb}.hookbus-dispatcher",
    }
    ops = doc["operations"]
    assert ops["serveEmit"]["bindings"]["nats"]["queue"] == "hookbus-dispatcher"
    assert ops["serveHandler"]["x-hookbus-queue-group"] == "{handler}"
    assert all("reply" in ops[o] for o in ("serveHandler", "serveCollect", "serveEmit"))
    assert all("reply" in ops[o] for o in ("announceWorker", "announceDispatcher"))
    worker_info = doc["components"]["schemas"]["WorkerServiceInfo"]
    handlers = worker_info["properties"]["metadata"]["properties"]["handlers"]
    assert re.fullmatch(handlers["pattern"], "tool=3Apre.guard tool=3Apost.a=2Eb")
    assert not re.fullmatch(handlers["pattern"], "tool:pre.guard")
    kv = doc["channels"]["leasesBucket"]["x-hookbus-kv"]
    assert (kv["bucket"], kv["ttl_s"], kv["storage"]) == ("hookbus_leases", 15.0, "file")


# -- real messages from a real run ------------------------------------------------------------

WORKER = """
from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler("tool:pre", priority=0, failure_policy="deny", tool_filter=["bash", "transfer"])
def guard(event, data):
    if "rm -rf" in str((data.get("tool_input") or {}).get("command", "")):
        return HookResult(action="deny", reason="destructive command")
    return HookResult(action="continue")


@worker.handler("tool:pre", priority=5, retry_safe=True)
def redact(event, data):
    if "secret" in data:
        return HookResult(action="modify", data={**data, "secret": "***"}, reason="redacted")
    return None


@worker.handler("tool:pre", priority=10, parallel=True)
def context(event, data):
    return HookResult(action="inject_context", context_injection="be careful",
                      context_injection_role="user", ephemeral=True)


@worker.handler("tool:pre", priority=11, parallel=True)
def broken(event, data):
    raise RuntimeError("broken on purpose")


@worker.handler("tool:pre", priority=20)
async def approve(event, data):
    if data.get("tool_name") == "transfer":
        return HookResult(action="ask_user", approval_prompt="Transfer 1200.00?",
                          approval_options=["Allow once", "Allow always", "Deny"],
                          approval_timeout=30)
    return {"action": "continue"}
"""


WORKER_PING = "$SRV.PING.hookbus-worker"
DISPATCHER_INFO = "$SRV.INFO.hookbus-dispatcher"
_SERVICE_SUBJECT = re.compile(r"\$SRV\.[A-Z]+\.hookbus-(worker|dispatcher)")
ASYNCAPI_ONLY = {"Lease", "ServiceRequest", "WorkerServiceInfo", "DispatcherServiceInfo"}
"""Messages whose payload schema is in the AsyncAPI document only (not hookbus types)."""

BAD_REQUESTS: list[dict[str, Any]] = [
    {"data": [1, 2]},
    {"data": {}, "timeout_s": -1},
    {"data": {}, "approval_timeout_s": 0},
]
"""Requests the agent sends on purpose that break the contract: the dispatcher answers
`bad_request`, and ajv refuses them too."""


def _channel_patterns(doc: dict[str, Any]) -> list[tuple[str, re.Pattern[str], dict[str, Any]]]:
    out = []
    for cid, channel in doc["channels"].items():
        if channel["address"] is None:
            continue
        rx = re.escape(channel["address"])
        rx = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^.]+)", rx)
        out.append((cid, re.compile(rx + r"\Z"), channel))
    return out


def _ref_name(ref: dict[str, str]) -> str:
    return ref["$ref"].rpartition("/")[2]


def _reply_message(doc: dict[str, Any], ref: dict[str, str]) -> str:
    """The message name a ``#/channels/<channel>/messages/<key>`` reference stands for."""
    _, _, channel, _, key = ref["$ref"].split("/")
    return _ref_name(doc["channels"][channel]["messages"][key])


class Recording:
    """Every message of a ``>`` subscription: (subject, reply, headers, body)."""

    def __init__(self) -> None:
        self.msgs: list[tuple[str, str, dict[str, str], bytes]] = []

    async def on_msg(self, msg: Any) -> None:
        self.msgs.append((msg.subject, msg.reply or "", dict(msg.headers or {}), msg.data))


async def _request(nc: Any, subject: str, body: dict[str, Any], timeout: float = 30) -> Any:
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=timeout)
    return json.loads(reply.data)


async def _suspensions(url: str, pending: asyncio.Queue[dict[str, Any]]) -> list[Any]:
    """Plain suspensions of agent ``payments``: one resolved before its waiter came
    (pre-registered, then consumed), one cancelled while a waiter waits."""
    waiter_nc, other_nc = await nats.connect(url), await nats.connect(url)
    try:
        waiter = HookDispatcher(waiter_nc, agent_id="payments")
        other = HookDispatcher(other_nc)
        async with waiter, other, waiter.run("run-1"):
            await other.resolve_hook("deploy-7", {"granted": True}, agent_id="payments")
            first = await waiter.hook("deploy-7", metadata={"env": "prod"}, timeout_s=20)
            second = asyncio.ensure_future(waiter.hook("deploy-8", timeout_s=20))
            event = await asyncio.wait_for(pending.get(), 20)
            assert event["hook"]["label"] == "deploy-8"
            await other.cancel_hook("deploy-8", reason="not today", agent_id="payments")
            with pytest.raises(SuspensionCancelledError):
                await asyncio.wait_for(second, 20)
        return [first]
    finally:
        await waiter_nc.close()
        await other_nc.close()


async def _run_fleet(url: str, workdir: Path, recording: Recording) -> dict[str, Any]:
    """A worker, a dispatcher service with the audit trail, an agent in plain NATS requests,
    an approver and the CLI, on a fresh server; returns what the agent got."""
    spy = await nats.connect(url)
    order_flushes(spy)  # its flushes below mean "subscribed" and "all heard"
    await spy.subscribe(">", cb=recording.on_msg)
    await spy.flush()
    agent = await nats.connect(url)
    got: dict[str, Any] = {}
    (workdir / "contract_worker.py").write_text(WORKER)
    async with Fleet(url, workdir) as fleet:
        await fleet.dispatcher(args=("--audit",))
        worker = await fleet._spawn(
            "worker", ["worker", f"{workdir / 'contract_worker.py'}:worker"], WORKER_READY
        )
        await worker.wait_ready()
        # an operator's rule for another event (tool:pre stays decided by its handlers)
        status, _, err = await run_cli(url, "handlers", "require", "tool:post", "audit_log")
        assert status == 0, err

        emit = emit_service_subject("tool:pre", "payments")
        base = {"agent_id": "payments", "session_id": "s-1"}
        got["continue"] = await _request(
            agent, emit, {**base, "data": {"tool_name": "bash", "secret": "hunter2",
                                           "tool_input": {"command": "ls"}}},
        )  # fmt: skip
        got["deny"] = await _request(
            agent, emit, {**base, "idempotency_key": "call-2",
                          "data": {"tool_name": "bash", "tool_input": {"command": "rm -rf /"}}},
        )  # fmt: skip
        got["bad"] = await _request(agent, emit, BAD_REQUESTS[0])
        got["bad_approval"] = await _request(agent, emit, BAD_REQUESTS[2])
        collect = "hookbus.v1.emit_and_collect.payments." + encode_token("tool:pre")
        got["collect"] = await _request(
            agent, collect, {"data": {"tool_name": "bash", "secret": "x"}, "timeout_s": 5}
        )
        got["collect_bad"] = await _request(agent, collect, BAD_REQUESTS[1])
        # the NATS services API: the worker's liveness and the dispatcher service
        got["worker_ping"] = json.loads((await agent.request(WORKER_PING, b"", timeout=10)).data)
        got["dispatcher_info"] = json.loads(
            (await agent.request(DISPATCHER_INFO, b"", timeout=10)).data
        )

        # an approval: the agent waits while an approver answers "Allow always"
        pending: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

        async def on_event(msg: Any) -> None:
            event = json.loads(msg.data)
            if event["hook"]["status"] == "pending":
                pending.put_nowait(event)

        await agent.subscribe("hookbus.v1.suspension.>", cb=on_event)
        transfer = asyncio.ensure_future(
            _request(agent, emit, {**base, "timeout_s": 60,
                                   "data": {"tool_name": "transfer", "amount": "1200.00"}})
        )  # fmt: skip
        event = await asyncio.wait_for(pending.get(), 20)
        status, _, err = await run_cli(
            url, "approvals", "answer", event["hook"]["label"], "Allow always",
            "--approver", "alice", "--agent", "payments",
        )  # fmt: skip
        assert status == 0, err
        got["approved"] = await asyncio.wait_for(transfer, 30)
        got["suspensions"] = await _suspensions(url, pending)
        # the audit trail publishes in the background: one record per decided emit
        for _ in range(200):
            if sum(m[0].startswith("hookbus.v1.decisions.") for m in recording.msgs) >= 3:
                break
            await asyncio.sleep(0.05)
        await spy.flush()
    await agent.close()
    await spy.close()
    return got


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_real_messages_on_the_wire_validate(node_modules, tmp_path, schema_doc):
    recording = Recording()
    with EmbeddedNatsServer() as server:
        got = await _run_fleet(server.url, tmp_path, recording)

    # what the agent got is what the README says
    assert got["continue"]["result"]["action"] == "inject_context"
    assert got["continue"]["result"]["chained_data"]["secret"] == "***"
    assert got["deny"]["result"]["action"] == "deny"
    assert got["bad"]["error"]["code"] == "bad_request"
    assert got["bad_approval"]["error"]["code"] == "bad_request"
    assert "approval_timeout_s" in got["bad_approval"]["error"]["message"]
    assert got["collect"]["responses"] == [{"tool_name": "bash", "secret": "***"}]
    assert got["collect_bad"]["error"]["code"] == "bad_request"
    assert got["approved"]["result"]["action"] == "continue"
    assert got["approved"]["result"]["approved_by"] == "alice"
    assert got["suspensions"] == [{"granted": True}]
    served = got["worker_ping"]["metadata"]["handlers"].split(" ")
    assert {"tool=3Apre.guard", "tool=3Apre.approve"} <= set(served)  # encoded keys
    assert got["dispatcher_info"]["name"] == "hookbus-dispatcher"

    doc = asyncapi_document()
    patterns = _channel_patterns(doc)
    replies: dict[str, list[str]] = {}  # reply subject -> the messages the reply may be
    ops_by_channel = {_ref_name(op["channel"]): op for op in doc["operations"].values()}
    matched: list[tuple[str, str, list[str], dict[str, str], bytes]] = []
    unmatched = []
    for subject, reply, headers, body in recording.msgs:
        if not (
            subject.startswith("hookbus.")
            or subject.startswith("$KV.hookbus_")
            or _SERVICE_SUBJECT.fullmatch(subject)
        ):
            continue
        hits = [(cid, ch) for cid, rx, ch in patterns if rx.match(subject)]
        if len(hits) != 1:
            unmatched.append((subject, [cid for cid, _ in hits]))
            continue
        cid, channel = hits[0]
        names = [_ref_name(m) for m in channel["messages"].values()]
        matched.append((subject, cid, names, headers, body))
        op = ops_by_channel.get(cid)
        if reply and op is not None and "reply" in op:
            replies[reply] = [_reply_message(doc, m) for m in op["reply"]["messages"]]
    assert unmatched == []  # every hookbus subject and key is in the AsyncAPI document
    for subject, _, headers, body in recording.msgs:
        if subject in replies:
            matched.append((subject, "reply", replies[subject], headers, body))

    cases: list[dict[str, Any]] = []
    deletes = 0
    own_schemas = doc["components"]["schemas"]
    for i, (subject, cid, names, headers, body) in enumerate(matched):
        if not body and cid.endswith(("Bucket", "Proofs")):
            assert headers.get("KV-Operation") in ("DEL", "PURGE"), (subject, headers)
            deletes += 1
            continue
        if names == ["Lease"] or names == ["ServiceRequest"]:
            cases.append({"id": f"{i} {names[0]} {subject}", "schema": own_schemas[names[0]],
                          "instance": body.decode()})  # fmt: skip
            continue
        if names[0] in ASYNCAPI_ONLY:
            cases.append({"id": f"{i} {names[0]} {subject}", "schema": own_schemas[names[0]],
                          "instance": json.loads(body)})  # fmt: skip
            continue
        if cid == "suspensionsBucket":
            label = subject.rpartition(".")[2]
            names = ["ApprovalRecord" if label.startswith("approval=3A") else "SuspensionRecord"]
        instance = json.loads(body)
        if instance in BAD_REQUESTS:
            names = [f"refused:{name}" for name in names]
        cases.extend(
            {"id": f"{i} {name} {subject}", "def": name, "instance": instance} for name in names
        )
    refused = [c for c in cases if c.get("def", "").startswith("refused:")]
    assert len(refused) == len(BAD_REQUESTS)
    for case in refused:
        case["def"] = case["def"].removeprefix("refused:")
    results = _validate(node_modules, tmp_path, schema_doc, cases)
    assert [r["valid"] for c, r in zip(cases, results, strict=True) if c in refused] == [
        False
    ] * len(BAD_REQUESTS)
    cases, results = zip(
        *[(c, r) for c, r in zip(cases, results, strict=True) if c not in refused], strict=True
    )
    by_message: dict[str, list[Any]] = {}
    for case, result in zip(cases, results, strict=True):
        by_message.setdefault(case["id"].split()[0], []).append((case, result))
    # a message is valid when it fits one of its channel's messages
    invalid = [
        (cs[0][0]["id"], [r["errors"] for _, r in cs])
        for cs in by_message.values()
        if not any(r["valid"] for _, r in cs)
    ]
    assert invalid == []
    seen = Counter(c["id"].split()[1] for cs in by_message.values() for c, r in cs if r["valid"])
    every_message = set(doc["components"]["messages"])
    assert every_message - set(seen) == set(), seen
    # the variants the run made: error replies, approval events, required-handler rules
    bodies = [json.loads(b) for s, c, n, h, b in matched if b and n != ["Lease"]]
    envelopes = [b for b in bodies if "event" in b and "budget_s" in b]
    keyed = [e for e in envelopes if e.get("idempotency_key") == "call-2"]
    assert keyed and all(len(e["id"]) == 32 and e["id"] != "call-2" for e in keyed)
    assert len({e["id"] for e in envelopes}) > 1  # one fresh id per emit
    assert any(b.get("error", {}).get("code") == "handler_error" for b in bodies)
    statuses = {b["hook"]["status"] for b in bodies if "hook" in b and "at" in b}
    assert statuses >= {"pending", "resolved"}
    assert sum(seen.values()) >= 40


def test_the_docs_worked_chain_example_is_what_the_code_derives():
    """docs/wire.md's chain example: the set id, chain subject and queue group as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "wire.md").read_text()
    set_id = handler_set_id(["sql_readonly", "sql_guard", "sql_guard"])
    assert f"set id:           {set_id}" in text
    assert f"chain subject:    {chain_subject('tool:pre', set_id)}" in text
    assert f"queue group:      {set_id}" in text
    assert handler_set_id(["sql_guard", "sql_readonly", "rate:limit"]) in text
    assert "tool=3Apre.guard tool=3Apre.rate=3Alimit tool=3Apost.audit" in text
