"""`hookbus demo`: the example workers as separate processes, three agents replaying the
OWASP AOS transcript concurrently, decisions checked against the transcript."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.js.errors
import pytest
from test_integration_ai_runner import INSTALL_TIMEOUT_S, _interpreter, _venv

from hookbus._core.buckets import handlers_bucket_config
from hookbus._core.consumers import watch_keys
from hookbus._core.kv import release_consumer
from hookbus.cli._auth_files import parse_worker
from hookbus.cli._command_support import load_object
from hookbus.demo import demo_identities
from hookbus.schemas import HookResult

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
DEMO_TIMEOUT_S = 50


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hookbus.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        env=env,
    )


def table_rows(out: str) -> list[list[str]]:
    """The decision table's rows, as lists of cell texts."""
    rows = []
    for line in out.splitlines():
        if line.startswith("│"):
            rows.append([cell.strip() for cell in line.strip("│").split("│")])
    return rows


def row(rows: list[list[str]], agent: str, step: int) -> dict[str, str]:
    header = [
        "#", "agent", "step", "event", "tool", "action", "handler", "approved", "latency",
        "expected",
    ]  # fmt: skip
    for cells in rows:
        if cells[1] == agent and cells[2] == str(step):
            return dict(zip(header, cells, strict=True))
    raise AssertionError(f"no row for {agent} step {step}")


async def handler_keys(url: str) -> set[str]:
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(handlers_bucket_config().bucket)
        # not nats-py's kv.keys(): its end-of-keys marker can come before the only key
        watch = await watch_keys(kv, ignore_deletes=True, meta_only=True)
        try:
            keys = set()
            while (entry := await watch.updates(timeout=5)) is not None:
                keys.add(entry.key)
            return keys
        finally:
            await release_consumer(watch._sub)
    except nats.js.errors.BucketNotFoundError:
        return set()
    finally:
        await nc.close()


def copy_examples(dest: Path) -> dict:
    for path in EXAMPLES.iterdir():
        if path.is_file():
            shutil.copy(path, dest / path.name)
    return json.loads((dest / "transcript.json").read_text())


@pytest.mark.anyio
async def test_demo_on_a_given_server(nats_url: str) -> None:
    before = await handler_keys(nats_url)
    proc = run_demo("--url", nats_url)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    transcript = json.loads((EXAMPLES / "transcript.json").read_text())
    assert len(rows) == sum(len(a["steps"]) for a in transcript["agents"])
    assert {r[1] for r in rows} == {"email-assistant", "payments-agent", "appointment-agent"}
    assert all(r[-1] == "ok" for r in rows)

    bash = row(rows, "appointment-agent", 7)
    assert (bash["tool"], bash["action"], bash["handler"]) == ("bash", "deny", "security_policy")
    fail_closed = row(rows, "email-assistant", 6)
    assert (fail_closed["action"], fail_closed["handler"]) == ("deny", "security_policy")
    assert "failure policy is deny" in proc.stdout
    sms = row(rows, "email-assistant", 2)
    assert (sms["tool"], sms["action"], sms["handler"]) == ("send_sms", "modify", "redact_pii")
    # The transfer asked for approval; the separate approver process allowed it, and
    # the redaction made on the way stays in the data.
    transfer = row(rows, "payments-agent", 9)
    assert (transfer["action"], transfer["handler"]) == ("continue", "transfer_approval")
    assert re.search(r"approvals answered by the approver process \(pid \d+\): 1", proc.stdout)
    assert "approver answered 'Allow once' to 'Transfer 1200.00 USD to Acme Corp?'" in proc.stdout
    assert "[REDACTED card ending 1111]" in proc.stdout
    assert "[REDACTED e-mail]" in proc.stdout
    mcp = row(rows, "appointment-agent", 4)
    assert (mcp["tool"], mcp["action"], mcp["handler"]) == (
        "mcp:get_appointment_slots",
        "inject_context",
        "untrusted_content",
    )
    assert "all 26 decisions match the transcript" in proc.stdout

    # The redactor ran as 2 processes; together they answered every tool:pre that the
    # security policy let through (4 in the transcript; the transfer among them, since
    # ask_user does not stop the chain).
    served = dict(re.findall(r"(redactor\.py #\d) \(pid \d+\): (\d+)", proc.stdout))
    assert set(served) == {"redactor.py #1", "redactor.py #2"}
    assert sum(int(n) for n in served.values()) == 4

    # The demo's declarations go with its workers: no dead handler is left routed.
    assert await handler_keys(nats_url) <= before


def test_demo_with_no_url_uses_the_embedded_server() -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    proc = run_demo(env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "embedded nats-server at nats://127.0.0.1:" in proc.stderr
    actions = {(r[5], r[6]) for r in table_rows(proc.stdout)}
    assert {
        ("deny", "security_policy"),
        ("modify", "redact_pii"),
        ("inject_context", "untrusted_content"),
    } <= actions


@pytest.mark.parametrize(
    ("agent", "step", "expect", "mismatch"),
    [
        (
            1,
            9,
            {"action": "deny"},
            "MISMATCH payments-agent step 9 (tool:pre payments:create_transfer):"
            " expected deny, got continue by transfer_approval",
        ),
        (
            2,
            7,
            {"action": "deny", "decided_by": "redact_pii"},
            "MISMATCH appointment-agent step 7 (tool:pre bash):"
            " expected deny by redact_pii, got deny by security_policy",
        ),
    ],
)
def test_a_changed_expectation_fails_the_demo(
    nats_url: str, tmp_path: Path, agent: int, step: int, expect: dict, mismatch: str
) -> None:
    transcript = copy_examples(tmp_path)
    transcript["agents"][agent]["steps"][step - 1]["expect"] = expect
    (tmp_path / "transcript.json").write_text(json.dumps(transcript))
    proc = run_demo("--url", nats_url, "--examples-dir", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 decision(s) differ from the transcript" in proc.stdout
    assert mismatch in proc.stdout
    assert sum(r[-1] == "MISMATCH" for r in table_rows(proc.stdout)) == 1


def test_a_bad_transcript_is_a_clear_error(nats_url: str, tmp_path: Path) -> None:
    transcript = copy_examples(tmp_path)
    transcript["agents"][0]["steps"][1]["expect"]["action"] = "allow"
    (tmp_path / "transcript.json").write_text(json.dumps(transcript))
    proc = run_demo("--url", nats_url, "--examples-dir", str(tmp_path))
    assert proc.returncode == 1
    assert "is not a valid transcript" in proc.stderr
    assert "$.agents[0].steps[1].expect.action" in proc.stderr


def test_a_worker_that_cannot_start_is_reported(nats_url: str, tmp_path: Path) -> None:
    copy_examples(tmp_path)
    (tmp_path / "audit.py").write_text("raise RuntimeError('audit store unreachable')\n")
    proc = run_demo("--url", nats_url, "--examples-dir", str(tmp_path))
    assert proc.returncode == 1
    assert "audit.py failed to load: RuntimeError: audit store unreachable" in proc.stderr


def test_redactor_rules() -> None:
    spec = importlib.util.spec_from_file_location("demo_redactor", EXAMPLES / "redactor.py")
    assert spec is not None and spec.loader is not None
    redactor = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(redactor)
    at = chr(64)
    text, kinds = redactor.redact_text(
        f"card 4111-1111-1111-1111, not a card 4111 1111 1111 1112, account 000123456789,"
        f" mail jo.doe{at}example.org"
    )
    assert text == (
        "card [REDACTED card ending 1111], not a card 4111 1111 1111 1112, account 000123456789,"
        " mail [REDACTED e-mail]"
    )
    assert kinds == ["card_number", "email_address"]


def _example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"demo_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the module's annotations there
    spec.loader.exec_module(module)
    return module


@pytest.mark.anyio
async def test_security_policy_denies_claude_codes_bash() -> None:
    """examples/security_policy.py stops a shell tool however the agent spells it: Claude
    Code's ``Bash`` ``rm -rf`` (its PreToolUse input, through the Claude Code door) is
    denied as ``bash`` is; the other rules ignore case too."""
    from hookbus.dispatcher import HookDispatcher
    from hookbus.integrations.claude_code import answer
    from hookbus.schemas import TOOL_PRE

    policy = _example("security_policy")
    rule = policy.security_policy
    for tool in ("bash", "Bash", "BASH", "Shell", "OS:exec", "Terminal:Run"):
        result = rule(TOOL_PRE, {"tool_name": tool, "tool_input": {"command": "rm -rf /"}})
        assert result is not None and result.action == "deny", tool
        assert result.reason == f"{tool}: shell and OS tools are not allowed for fleet agents"
    for tool in ("Read", "bashful", "Write"):
        assert rule(TOOL_PRE, {"tool_name": tool, "tool_input": {"file_path": "/x"}}) is None
    texted = rule(TOOL_PRE, {"tool_name": "Send_SMS", "tool_input": {"phone_number": "+1"}})
    assert texted is not None and texted.action == "deny"
    stored = {"tool_name": "Memory:Store", "tool_input": {"text": "000123456789"}}
    assert (rule(TOOL_PRE, stored) or HookResult()).action == "deny"

    d = HookDispatcher()
    for spec in policy.worker.handlers:  # the worker's handlers, with their declared options
        decl = spec.declaration
        d.register(decl.event, spec.fn, name=decl.name, priority=decl.priority,
                   failure_policy=decl.failure_policy, tool_filter=decl.tool_filter)  # fmt: skip
    body = json.loads((FIXTURES / "claude_code" / "PreToolUse.json").read_text())
    assert body["tool_name"] == "Bash"  # as Claude Code names its shell tool
    body["tool_input"] = {"command": "rm -rf /home/user/my-project/build"}
    reply = await answer(json.dumps(body), d.emit)
    assert reply.exit_code == 0
    out = json.loads(reply.stdout)["hookSpecificOutput"]
    assert out["permissionDecision"] == "deny"
    assert out["permissionDecisionReason"] == (
        "Bash: shell and OS tools are not allowed for fleet agents"
    )
    body["tool_name"], body["tool_input"] = "Read", {"file_path": "/etc/hosts"}
    assert (await answer(json.dumps(body), d.emit)).stdout == ""  # no opinion


def test_context_injector_marks_claude_codes_mcp_and_web_results() -> None:
    injector = _example("context_injector")
    for tool in ("mcp:get_slots", "mcp__github__get_issue", "MCP__Jira__search", "WebFetch"):
        result = injector.untrusted_content("tool:post", {"tool_name": tool})
        assert result is not None and result.action == "inject_context", tool
    for tool in ("Read", "Bash", "mcp_x"):
        assert injector.untrusted_content("tool:post", {"tool_name": tool}) is None, tool


def test_a_worker_process_that_exits_is_reported(nats_url: str, tmp_path: Path) -> None:
    copy_examples(tmp_path)
    source = (tmp_path / "audit.py").read_text()
    (tmp_path / "audit.py").write_text(
        source + "\nimport sys\nif 'worker' in sys.argv:\n"
        "    sys.exit('audit: cannot open the audit store')\n"
    )
    proc = run_demo("--url", nats_url, "--examples-dir", str(tmp_path))
    assert proc.returncode == 1
    assert "worker audit.py exited with code 1 before serving" in proc.stderr
    assert "cannot open the audit store" in proc.stderr


@contextlib.contextmanager
def secured_server(tmp_path: Path) -> Iterator[tuple[Path, str, dict[str, str]]]:
    """`hookbus auth init --demo` -> `hookbus server --config`: the auth folder, the
    server's URL and an environment without NATS_* variables."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = tmp_path / "auth"
    hookbus = [sys.executable, "-m", "hookbus.cli"]
    subprocess.run(
        [*hookbus, "auth", "init", "--out", str(auth), "--demo", "--port", str(port)],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    server = subprocess.Popen(
        [*hookbus, "server", "--config", str(auth / "server.conf"),
         "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
        yield auth, f"nats://127.0.0.1:{port}", env
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(20)


def test_secure_demo_from_auth_init(tmp_path: Path) -> None:
    """The README's three commands: `hookbus auth init --demo` -> `hookbus server --config`
    -> `hookbus demo --secure`: every process connects as its own identity (anonymous
    access refused), every decision matches, and the approval names its approver."""
    with secured_server(tmp_path) as (auth, url, env):
        # the demo's agents are plain agents: clients of the dispatcher service only ...
        manifest = json.loads((auth / "hookbus-auth.json").read_text())
        agents = [i for i in manifest["identities"] if i["role"] == "agent"]
        assert {i["name"] for i in agents} >= {"payments-agent", "email-assistant"}
        # ... but the ai agent, whose runs keep durable suspensions in hookbus
        assert {i["name"] for i in agents if i.get("embedded")} == {"ai-agent"}
        proc = run_demo("--secure", "--auth", str(auth), "--url", url, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "all 26 decisions match the transcript" in proc.stdout
        assert "each with its own connection and the dispatcher service's client" in proc.stdout
        assert "demo-approver chose 'Allow once'" in proc.stdout
        assert "as demo-approver" in proc.stdout
        assert re.search(r"approvals answered by the approver process \(pid \d+\): 1", proc.stdout)
        transfer = row(table_rows(proc.stdout), "payments-agent", 9)
        assert transfer["approved"].startswith("demo-appro"), transfer
        # the same server refuses anyone without credentials (who trusts its CA, if TLS)
        ca = manifest.get("tls_ca")
        anonymous = run_demo("--url", url, *(["--tls-ca", ca] if ca else []), env=env)
        assert anonymous.returncode != 0
        assert "authorization violation" in anonymous.stderr.lower(), anonymous.stderr
        assert "Traceback" not in anonymous.stderr


def test_secure_demo_aos_door_and_pydantic_ai_through_the_service(tmp_path: Path) -> None:
    """With --secure, the AOS door's emits and the pydantic-ai agent's go to the demo's
    dispatcher service too (a plain agent identity may not call handlers): same decisions,
    and both transfers are approved by the approver identity."""
    with secured_server(tmp_path) as (auth, url, env):
        proc = run_demo(
            "--secure", "--auth", str(auth), "--url", url, "--via", "aos",
            "--agents", "pydantic-ai", env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = proc.stdout
        assert "all 26 decisions match the transcript" in out
        assert "sent through the AOS door: 23 steps" in out
        assert "pydantic-ai agent ok: 4 of 4 tool calls as pydantic_ai_agent.py expects" in out
        assert (
            "pydantic-ai: payments:create_transfer: continue by transfer_approval, approved by"
            " demo-approver -> ran with"
        ) in out
        assert re.search(r"approvals answered by the approver process \(pid \d+\): 2", out)


def test_demo_identities_serve_what_each_worker_file_declares() -> None:
    """`hookbus auth init --demo`'s workers: NAME:EVENT/HANDLER,... with every (event,
    handler) the example file declares, and nothing else."""
    agents, embedded, workers, approvers = demo_identities(EXAMPLES)
    transcript = json.loads((EXAMPLES / "transcript.json").read_text())
    # + --agents pydantic-ai's (the transcript's payments-agent) and ai's (embedded)
    assert agents == [a["id"] for a in transcript["agents"]] and embedded == ["ai-agent"]
    assert approvers == ["demo-approver"]
    assert "approval_gate:tool:pre/transfer_approval" in workers
    served = {}
    for spec in workers:
        name, pairs = parse_worker(spec)
        served[name] = {tuple(pair.split("/", 1)) for pair in pairs}
    assert set(served) == {Path(w["file"]).stem for w in transcript["workers"]}
    for w in transcript["workers"]:
        worker = load_object(f"{EXAMPLES / w['file']}:{w.get('attr', 'worker')}")
        declared = {(h.declaration.event, h.declaration.name) for h in worker.handlers}
        assert served[Path(w["file"]).stem] == declared


# -- framework agents (hookbus demo --agents) ----------------------------------------------
def framework_rows(out: str) -> list[dict[str, str]]:
    """The rows of the framework agents' table (9 cells; the transcript's table has 10)."""
    header = [
        "#", "agent", "framework", "event", "tool", "action", "handler", "approved", "latency",
    ]  # fmt: skip
    return [dict(zip(header, r, strict=True)) for r in table_rows(out) if len(r) == len(header)]


def test_demo_with_the_pydantic_ai_agent(nats_url: str) -> None:
    proc = run_demo("--url", nats_url, "--agents", "pydantic-ai")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all 26 decisions match the transcript" in proc.stdout
    out = proc.stdout
    assert (
        "pydantic-ai: bash: deny by security_policy -> not run; the model read"
        " 'Denied by hook: bash: shell and OS tools are not allowed for fleet agents'"
    ) in out
    assert (
        'pydantic-ai: send_sms: deny by security_policy -> not run; the model read "Denied by'
        " hook: send_sms: '+1-202-555-0147' is not one of the user's verified numbers\""
    ) in out
    assert (
        'pydantic-ai: send_sms: modify by redact_pii -> ran with {"phone_number":'
        ' "+337-665-99-06", "message": "Paying Acme; receipts to [REDACTED e-mail]"}'
    ) in out
    assert (
        "pydantic-ai: payments:create_transfer: continue by transfer_approval, approved by"
        ' demo-approver -> ran with {"amount": "1200.00", "payee": "Acme Corp",'
        ' "memo": "invoice 7, card [REDACTED card ending 1111]"}'
    ) in out
    assert "pydantic-ai agent ok: 4 of 4 tool calls as pydantic_ai_agent.py expects" in out
    assert "approver answered 'Allow once' to 'Transfer 1200.00 EUR to Acme Corp?'" in out

    rows = framework_rows(out)
    assert {r["agent"] for r in rows} == {"payments-agent"}
    assert {r["framework"] for r in rows} == {"pydantic-ai"}
    pre = [(r["tool"], r["action"], r["handler"], r["approved"]) for r in rows
           if r["event"] == "tool:pre"]  # fmt: skip
    assert pre == [
        ("bash", "deny", "security_policy", ""),
        ("send_sms", "deny", "security_policy", ""),
        ("send_sms", "modify", "redact_pii", ""),
        ("payments:create_transfer", "continue", "transfer_approval", "demo-approver"),
    ]
    submit = [r for r in rows if r["event"] == "prompt:submit"]
    assert [(r["action"], r["handler"]) for r in submit] == [
        ("inject_context", "payments_guidance")
    ]


def test_demo_agents_without_the_pydantic_ai_extra(nats_url: str, tmp_path: Path) -> None:
    """Without pydantic-ai the option is a clear error, before any worker starts."""
    fake = tmp_path / "pydantic_ai"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named pydantic_ai')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path[1:]])}
    proc = run_demo("--url", nats_url, "--agents", "pydantic-ai", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "--agents pydantic-ai needs the pydantic-ai extra" in proc.stderr
    assert "pip install 'hookbus[pydantic-ai]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout


def test_demo_agents_rejects_an_unknown_name() -> None:
    proc = run_demo("--agents", "pydantic-ai,langchain")
    assert proc.returncode == 2
    assert "unknown agent 'langchain' (choose from pydantic-ai, ai)" in proc.stderr


def test_demo_ai_agent_on_a_python_that_cannot_run_it_says_what_is_needed(
    nats_url: str, tmp_path: Path
) -> None:
    """A venv of this interpreter with nothing installed: no hookbus, no ``ai`` (and on
    3.11, too old besides), whatever Python the suite runs on."""
    bare = tmp_path / "bare"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr
    python = str(bare / "bin" / "python")
    proc = run_demo("--url", nats_url, "--agents", "ai", "--ai-python", python)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"--ai-python {python} cannot run the ai agent" in proc.stderr
    assert "--agents ai needs a Python >= 3.12 with hookbus and its ai extra" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout


@pytest.mark.timeout(INSTALL_TIMEOUT_S + DEMO_TIMEOUT_S + 60)  # the venv, once: then ~10 s
def test_demo_with_the_ai_agent(nats_url: str) -> None:
    """The ai agent on the Python >= 3.12 venv the ai runner test builds (HOOKBUS_PY312;
    skipped without one, failed when CI is set), its approval answered by the demo's
    approver through the demo's workers, together with the pydantic-ai agent."""
    venv_python = _venv(_interpreter())
    proc = run_demo(
        "--url", nats_url, "--agents", "pydantic-ai,ai", "--ai-python", str(venv_python)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(
        r"ai: transfer \(asked as payments:create_transfer\): continue by transfer_approval,"
        r" approved by demo-approver -> hook approve_\S+ resolved granted=True",
        out,
    ), out
    assert "ai: tool result: transferred 1200.00 to Acme Corp" in out
    assert f"ai agent ok: ran on {venv_python}" in out
    assert "pydantic-ai agent ok: 4 of 4 tool calls" in out
    ai_rows = [
        (r["agent"], r["event"], r["tool"], r["action"], r["handler"], r["approved"])
        for r in framework_rows(out)
        if r["framework"] == "ai"
    ]
    transfer = ("payments:create_transfer", "continue", "transfer_approval", "demo-approver")
    assert ai_rows == [("ai-agent", "tool:pre", *transfer)]
    # the transcript's transfer, the pydantic-ai agent's and the ai agent's
    assert re.search(r"approvals answered by the approver process \(pid \d+\): 3", out)


@pytest.mark.timeout(INSTALL_TIMEOUT_S + DEMO_TIMEOUT_S + 60)  # the venv, once: then ~10 s
def test_secure_demo_with_the_ai_agent(tmp_path: Path) -> None:
    """With --secure the ai agent's process connects as agent ai-agent (an identity of
    `auth init --demo`); the demo's bridge, a plain agent too, sends the approval's
    tool:pre to the dispatcher service and answers the tool approval with a proof written
    as the approver identity, from which the agent resolves its hook."""
    venv_python = _venv(_interpreter())
    with secured_server(tmp_path) as (auth, url, env):
        proc = run_demo(
            "--secure", "--auth", str(auth), "--url", url, "--agents", "ai",
            "--ai-python", str(venv_python), env=env,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(
        r"ai: transfer \(asked as payments:create_transfer\): continue by transfer_approval,"
        r" approved by demo-approver -> hook approve_\S+ resolved granted=True"
        r" \(answered Allow as demo-approver\)",
        out,
    ), out
    assert "ai: tool result: transferred 1200.00 to Acme Corp" in out
    assert re.search(r"approvals answered by the approver process \(pid \d+\): 2", out)


def test_secure_demo_names_a_missing_agent_identity(tmp_path: Path) -> None:
    """An auth folder without a framework agent's identity: a clear error before anything
    starts, saying how to add it."""
    auth = tmp_path / "auth"
    subprocess.run(
        [sys.executable, "-m", "hookbus.cli", "auth", "init", "--out", str(auth)],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    proc = run_demo("--secure", "--auth", str(auth), "--agents", "pydantic-ai")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "has no agent 'payments-agent'" in proc.stderr
    assert f"hookbus auth add agent payments-agent --dir {auth}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "starting" not in proc.stdout


def test_the_terminal_prompt_says_when_an_approval_times_out() -> None:
    """--interactive: the question shows the approval's own timeout and what it ends with."""
    from hookbus.demo._app import _times_out

    assert _times_out({"timeout_s": 30.0, "default": "deny"}) == " (times out in 30 s: then deny)"
    assert _times_out({"timeout_s": 2.5}) == " (times out in 2.5 s)"
    assert _times_out({}) == ""
