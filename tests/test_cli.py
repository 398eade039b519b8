"""The `hookbus` command: schema, emit, worker, handlers, as a user runs them.

Fast argument errors go through click's CliRunner; anything that serves, signals or
starts the embedded server runs ``python -m hookbus.cli`` as a real subprocess.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import nats.js.errors
import pytest
from click.testing import CliRunner

from hookbus.cli._command_tree import cli
from hookbus.dispatcher import HookDispatcher
from hookbus.schemas import (
    HANDLERS_BUCKET,
    WIRE_TYPES,
    CollectReply,
    CollectRequest,
    ContextInjection,
    EmitReply,
    EmitRequest,
    EventEnvelope,
    HandlerDeclaration,
    HandlerFailure,
    HookReply,
    HookResult,
    WireError,
    collect_subject,
    encode,
    handler_key,
    handler_queue_group,
    handler_subject,
)
from hookbus.workers import HookWorker

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]


def _env(**extra: str) -> dict[str, str]:
    """The subprocess environment, without a NATS URL unless a test gives one."""
    env = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "HOOKBUS_TEST_NATS_URL")}
    env.update(COLUMNS="200", **extra)
    return env


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*HOOKBUS, *args], capture_output=True, text=True, timeout=timeout, env=_env()
    )


async def _arun(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run the CLI from an async test without blocking the event loop."""
    with anyio.fail_after(60):
        return await anyio.run_process([*HOOKBUS, *args], check=False, env=_env())


def _invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), env={"NATS_URL": None})


# -- schema -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema_doc() -> dict[str, Any]:
    proc = _run("schema")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    root = {"$schema": doc["$schema"], "$defs": doc["$defs"], "$ref": f"#/$defs/{name}"}
    jsonschema.Draft202012Validator.check_schema(root)
    return jsonschema.Draft202012Validator(root)


def test_schema_covers_every_wire_type(schema_doc):
    assert schema_doc["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    names = [t.__name__ for t in WIRE_TYPES]
    assert schema_doc["anyOf"] == [{"$ref": f"#/$defs/{n}"} for n in names]
    assert set(names) <= set(schema_doc["$defs"])
    for name in names:
        _validator(schema_doc, name)  # each is a valid 2020-12 schema


SAMPLES = [
    EventEnvelope(
        id="e1",
        event="tool:pre",
        data={"tool_name": "bash", "n": [1, {"a": None}]},
        agent_id="a",
        session_id="s",
        emitted_at=1.5,
        budget_s=2.5,
    ),
    EventEnvelope(id="e2", event="x", data={}),
    HookResult(),
    HookResult(
        action="inject_context",
        data={"k": 1},
        context_injection="hi",
        context_injection_role="user",
        ephemeral=True,
        approval_options=["yes", "no"],
        context_injections=[
            ContextInjection(content="hi", role="user", hook_name="h", event="tool:pre")
        ],
        failures=[HandlerFailure(handler="g", kind="timeout", policy="ignore", message="slow")],
        decided_by="h",
    ),
    HookReply(handler="h", result=HookResult(action="deny", reason="no")),
    HookReply(handler="h", error=WireError(code="bad_request", message="$.event")),
    HandlerDeclaration(
        event="tool:pre",
        name="h",
        priority=-3,
        tool_filter=["bash*"],
        timeout_s=0.5,
        failure_policy="deny",
        parallel=True,
        subject=handler_subject("tool:pre", "h"),
        collect_subject=collect_subject("tool:pre"),  # a writer puts every derived route
        queue_group=handler_queue_group("h"),
    ),
    EmitRequest(data={"tool_name": "ls"}, agent_id="a"),
    EmitRequest(),
    EmitReply(result=HookResult(action="modify", data={"x": 1})),
    EmitReply(error=WireError(code="unknown_event", message="nope")),
    CollectRequest(data={"q": 1}, timeout_s=0.25),
    CollectReply(responses=[{"a": 1}, [2], "three"]),
    WireError(code="internal", message="m"),
]


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_schema_validates_real_encoded_messages(schema_doc, sample):
    instance = json.loads(encode(sample))
    _validator(schema_doc, type(sample).__name__).validate(instance)


@pytest.mark.parametrize(
    ("name", "instance"),
    [
        ("EventEnvelope", {"id": "a", "event": 1, "data": {}}),
        ("EventEnvelope", {"id": "a", "event": "e"}),
        ("HookResult", {"action": "explode"}),
        ("HookReply", {"result": {}}),
        ("HandlerDeclaration", {"event": "e", "name": "n", "failure_policy": "maybe"}),
        ("EmitRequest", {"data": []}),
        ("CollectRequest", {"timeout_s": "soon"}),
    ],
)
def test_schema_rejects_bad_messages(schema_doc, name, instance):
    with pytest.raises(jsonschema.ValidationError):
        _validator(schema_doc, name).validate(instance)


def test_schema_out_file(tmp_path, schema_doc):
    out = tmp_path / "wire.json"
    result = _invoke("schema", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text()) == schema_doc


# -- emit: argument errors ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{bad", "not valid JSON"),
        ('{"a": 1', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"text"', "must be a JSON object, got str"),
        ("null", "must be a JSON object, got NoneType"),
    ],
)
def test_emit_bad_json(data, message):
    result = _invoke("emit", "tool:pre", data, "--url", "nats://127.0.0.1:1")
    assert result.exit_code != 0
    assert message in result.output
    assert "Traceback" not in result.output


def test_emit_unknown_event(nats_url):
    result = _invoke("emit", "tool:pree", "{}", "--url", nats_url)
    assert result.exit_code == 1
    assert "unknown event 'tool:pree'" in result.output
    assert "tool:pre" in result.output  # the standard events are listed
    assert "Traceback" not in result.output


def test_emit_unknown_event_allowed(nats_url):
    result = _invoke("emit", "tool:pree", '{"a": 1}', "--url", nats_url, "--allow-unknown")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert (out["action"], out["data"], out["failures"]) == ("continue", {"a": 1}, [])


@pytest.mark.parametrize("url", ["localhost:4222", "not a url", "nats://127.0.0.1:4222,oops"])
def test_url_not_a_url(url):
    result = _invoke("emit", "tool:pre", "{}", "--url", url)
    assert result.exit_code == 2
    assert "is not a NATS URL" in result.output
    assert "--url" in result.output


def test_unreachable_url():
    result = _invoke("emit", "tool:pre", "{}", "--url", "nats://127.0.0.1:1")
    assert result.exit_code == 1
    assert "cannot connect to NATS at nats://127.0.0.1:1" in result.output
    assert "Traceback" not in result.output


def test_emit_embedded_uses_a_private_server():
    proc = _run("emit", "session:start", '{"a": 1}', "--embedded")
    assert proc.returncode == 0, proc.stderr
    assert "embedded nats-server at nats://127.0.0.1:" in proc.stderr
    out = json.loads(proc.stdout)
    assert (out["action"], out["data"], out["failures"]) == ("continue", {"a": 1}, [])


# -- worker: loading errors ---------------------------------------------------------------


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    (tmp_path / "no_worker_here.py").write_text("value = 42\n")
    (tmp_path / "raises_on_import.py").write_text('raise RuntimeError("import-time boom")\n')
    return tmp_path


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("justamodule", "is not MODULE:ATTR"),
        ("hookbus_no_such_module_xyz:worker", "cannot import 'hookbus_no_such_module_xyz'"),
        ("{dir}/missing.py:worker", "no such file"),
        ("{dir}/no_worker_here.py:worker", "has no attribute 'worker'"),
        ("{dir}/no_worker_here.py:value", "is a int, not a HookWorker"),
        ("os:sep", "is a str, not a HookWorker"),
    ],
)
def test_worker_bad_target(module_dir, target, message):
    result = _invoke("worker", target.format(dir=module_dir), "--url", "nats://127.0.0.1:1")
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_worker_module_that_raises_on_import(module_dir):
    proc = _run("worker", f"{module_dir}/raises_on_import.py:worker", "--url", "nats://127.0.0.1:1")
    assert proc.returncode != 0
    assert "import-time boom" in proc.stderr
    assert "raises_on_import.py" in proc.stderr


# -- handlers -------------------------------------------------------------------------------

anyio_test = pytest.mark.anyio  # the async tests here (the rest are sync)


@anyio_test
async def test_handlers_lists_and_removes(nc, nats_url, event):
    w = HookWorker(nc)

    @w.handler(event, priority=4, tool_filter=["bash*"], timeout_s=1.5, failure_policy="deny")
    async def guard(ev: str, data: dict[str, Any]) -> None:
        return None

    async with w:
        listed = await _arun("handlers", "--url", nats_url, "--event", event, "--json")
        table = await _arun("handlers", "--url", nats_url, "--event", event)
    assert listed.returncode == 0, listed.stderr
    decls = json.loads(listed.stdout)
    assert [(d["event"], d["name"]) for d in decls] == [(event, "guard")]
    assert decls[0]["priority"] == 4 and decls[0]["tool_filter"] == ["bash*"]
    assert decls[0]["timeout_s"] == 1.5 and decls[0]["failure_policy"] == "deny"
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.decode().splitlines() if "guard" in line)
    assert event in row and "bash*" in row and "deny" in row

    removed = await _arun("handlers", "--url", nats_url, "--remove", event, "guard")
    assert removed.returncode == 0, removed.stderr
    assert f"removed guard from {event}" in removed.stdout.decode()
    kv = await nc.jetstream().key_value(HANDLERS_BUCKET)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get(handler_key(event, "guard"))
    after = await _arun("handlers", "--url", nats_url, "--event", event, "--json")
    assert json.loads(after.stdout) == []

    again = await _arun("handlers", "--url", nats_url, "--remove", event, "guard")
    assert again.returncode == 1
    assert f"no handler 'guard' for '{event}'" in again.stderr.decode()


# -- worker and emit as subprocesses ------------------------------------------------------

WORKER_MODULE = """
import asyncio
import os

from hookbus.workers import HookWorker

worker = HookWorker()


@worker.handler({event!r}, timeout_s=30)
async def stamp(event, data):
    print("started", data.get("n"), flush=True)
    await asyncio.sleep(data.get("sleep", 0))  # the handler's work
    return {{"action": "modify", "data": {{**data, "pid": os.getpid()}}}}
"""


async def _read_until(stream: asyncio.StreamReader, needle: str, seen: list[str]) -> None:
    while True:
        line = await stream.readline()
        if not line:
            raise AssertionError(f"stream ended before {needle!r}: {seen}")
        seen.append(line.decode())
        if needle in seen[-1]:
            return


async def _pump(stream: asyncio.StreamReader, seen: list[str]) -> None:
    """Keep reading a child's pipe (a full pipe would block it) until it closes."""
    async for line in stream:
        seen.append(line.decode())


@anyio_test
async def test_worker_subprocess_serves_and_drains_on_sigterm(tmp_path, nc, nats_url, event):
    module = tmp_path / "stamp_worker.py"
    module.write_text(textwrap.dedent(WORKER_MODULE.format(event=event)))
    proc = await asyncio.create_subprocess_exec(
        *HOOKBUS, "--log-level", "info", "worker", f"{module}:worker", "--url", nats_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=_env(),
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    err: list[str] = []
    out: list[str] = []
    try:
        with anyio.fail_after(30):
            await _read_until(proc.stderr, "serving 1 handler(s): stamp", err)
        pump = asyncio.create_task(_pump(proc.stderr, err))
        async with HookDispatcher(nc) as d:
            first = await d.emit(event, {"n": 0})
            in_flight = asyncio.create_task(d.emit(event, {"n": 1, "sleep": 0.3}))
            with anyio.fail_after(30):
                await _read_until(proc.stdout, "started 1", out)
            proc.send_signal(signal.SIGTERM)  # while request 1 is being handled
            second = await in_flight
            with anyio.fail_after(30):
                code = await proc.wait()
            after = await d.emit(event, {"n": 2})
        await pump
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert first.failures == [] and first.data["pid"] == proc.pid
    assert second.failures == [] and second.data["pid"] == proc.pid and second.data["n"] == 1
    assert code == 0, "".join(err)
    assert any("drained after 2 request(s)" in line for line in err), err
    # the process is gone, its declaration stays: no responders, policy ignore
    assert [f.kind for f in after.failures] == ["no_responders"]


@anyio_test
async def test_emit_subprocess_reaches_a_worker(nc, nats_url, event):
    w = HookWorker(nc)

    @w.handler(event)
    async def tag(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(action="modify", data={**data, "tagged": True})

    async with w:
        proc = await _arun("emit", event, '{"tool_name": "bash"}', "--url", nats_url)
        collected = await _arun(
            "emit", event, '{"q": 1}', "--url", nats_url, "--collect", "--timeout", "5"
        )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["action"] == "continue"  # a modify chain ends as continue with its data
    assert out["data"]["tool_name"] == "bash" and out["data"]["tagged"] is True
    assert "timestamp" in out["data"]
    assert collected.returncode == 0, collected.stderr
    assert json.loads(collected.stdout) == [{"q": 1, "tagged": True}]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grace-period", "0"], "above 0"),
        (["--grace-period", "soon"], "not a duration"),
        (["--suspension-ttl", "nan"], "above 0"),
        (["--approval-ttl", "-1h"], "above 0"),
        (["--bucket-replicas", "0"], "1<=x<=5"),
    ],
)
def test_dispatcher_operations_options_are_checked(args, message):
    result = CliRunner().invoke(cli, ["dispatcher", "--url", "nats://127.0.0.1:1", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_durations_take_units():
    from hookbus.cli._command_support import DURATION

    assert [DURATION.convert(v, None, None) for v in ("90", "90s", "15m", "24h", "7d", 2.5)] == [
        90.0, 90.0, 900.0, 86400.0, 604800.0, 2.5,
    ]  # fmt: skip


def _k8s_commands() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container in deploy/k8s/hookbus.yaml."""
    import yaml

    path = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "hookbus.yaml"
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        pod = doc["spec"]["template"]["spec"]
        out.extend((pod, c) for c in pod["containers"])
    return out


@pytest.mark.parametrize("pod_container", _k8s_commands(), ids=lambda pc: pc[1]["name"])
def test_k8s_example_parses_and_drains_before_the_kill(pod_container, monkeypatch):
    """Every container's command line parses with the real CLI under its env; buckets
    are R3 and strict; the drain's grace ends before Kubernetes' SIGKILL."""
    pod, container = pod_container
    for var in container["env"]:
        monkeypatch.setenv(var["name"], var["value"])
    args = container["args"]
    i = next(i for i, a in enumerate(args) if a in cli.commands)
    command = cli.commands[args[i]]
    with cli.make_context("hookbus", args[:i]) as ctx:
        with command.make_context(args[i], args[i + 1 :], parent=ctx) as sub:
            params = sub.params
    assert params["bucket_replicas"] == 3
    assert params["strict_buckets"] is True
    assert params["url"].count("nats://") == 3
    assert params["grace_s"] + 5 <= pod["terminationGracePeriodSeconds"]
