"""``hookbus emit`` as a script uses it: the data from stdin or a file, the agent and
session, ``--exit-code`` for the decision, ``--compact`` output, and its span exported
by OTLP in the caller's trace. Real subprocesses against the test's nats-server and an
in-process `HookWorker`; Ctrl-C is in test_cli_signals.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _otlp_receiver import OtlpReceiver

from hookbus.schemas import HookResult
from hookbus.workers import HookWorker

pytestmark = pytest.mark.anyio

HOOKBUS = [sys.executable, "-m", "hookbus.cli"]


async def emit(
    *args: str, stdin: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "OTEL_"))}
    clean.update(env or {})
    with anyio.fail_after(60):
        return await anyio.run_process(
            [*HOOKBUS, "emit", *args], input=stdin, check=False, env=clean
        )


def result(p: subprocess.CompletedProcess[bytes]) -> dict[str, Any]:
    assert b"Traceback" not in p.stderr, p.stderr.decode()
    out: dict[str, Any] = json.loads(p.stdout)
    return out


@pytest.fixture
async def deciding(nc: Any) -> AsyncIterator[str]:
    """A worker deciding by ``data["want"]``: deny, ask (an approval), fail (raises; failure
    policy ignore) or anything else: let it go on, echoing the data it saw."""
    event = f"test:{uuid.uuid4().hex[:10]}"
    w = HookWorker(nc)

    @w.handler(event, failure_policy="ignore")
    async def decide(ev: str, data: dict[str, Any]) -> HookResult:
        want = data.get("want")
        if want == "deny":
            return HookResult(action="deny", reason="no")
        if want == "ask":
            return HookResult(action="ask_user", approval_prompt="Go?", approval_options=["Yes"])
        if want == "fail":
            raise RuntimeError("broken handler")
        return HookResult(action="modify", data={**data, "seen": True})

    async with w:
        yield event


async def test_data_from_stdin(nats_url: str, deciding: str) -> None:
    p = await emit(deciding, "-", "--url", nats_url, stdin=b'{"tool_name": "ls"}')
    assert p.returncode == 0, p.stderr
    out = result(p)
    assert out["data"]["tool_name"] == "ls" and out["data"]["seen"] is True


async def test_data_from_a_file(nats_url: str, deciding: str, tmp_path: Path) -> None:
    (tmp_path / "call.json").write_text('{"tool_name": "cat", "n": [1, 2]}')
    p = await emit(deciding, f"@{tmp_path / 'call.json'}", "--url", nats_url)
    assert p.returncode == 0, p.stderr
    assert result(p)["data"]["n"] == [1, 2]


async def test_bad_data_in_a_file_names_the_file(nats_url: str, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{oops")
    p = await emit("tool:pre", f"@{tmp_path / 'bad.json'}", "--url", nats_url)
    assert p.returncode == 2
    assert f"JSON data in {tmp_path / 'bad.json'} is not valid JSON" in p.stderr.decode()


async def test_agent_and_session(nats_url: str, deciding: str) -> None:
    p = await emit(deciding, "{}", "--url", nats_url, "--agent-id", "billing",
                   "--session-id", "s-42")  # fmt: skip
    assert p.returncode == 0, p.stderr
    data = result(p)["data"]
    assert (data["agent_id"], data["session_id"]) == ("billing", "s-42")


async def test_an_agent_id_too_long_is_one_line(nats_url: str) -> None:
    """A usage error (exit 2): click's usage lines and one error line, no traceback."""
    p = await emit("tool:pre", "{}", "--url", nats_url, "--agent-id", "a" * 1000)
    assert p.returncode == 2
    assert b"Traceback" not in p.stderr
    errors = [line for line in p.stderr.decode().splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "at most 200 characters" in errors[0], p.stderr


@pytest.mark.parametrize(
    ("want", "extra", "status", "action"),
    [
        ("go", [], 0, "continue"),
        ("deny", [], 3, "deny"),
        ("ask", ["--no-wait"], 4, "ask_user"),
        ("fail", [], 5, "continue"),
    ],
)
async def test_exit_code_says_the_decision(
    nats_url: str, deciding: str, want: str, extra: list[str], status: int, action: str
) -> None:
    data = json.dumps({"want": want})
    p = await emit(deciding, data, "--url", nats_url, "--exit-code", *extra)
    assert p.returncode == status, p.stderr
    out = result(p)
    assert out["action"] == action
    assert bool(out["failures"]) == (want == "fail")
    without = await emit(deciding, data, "--url", nats_url, *extra)
    assert without.returncode == 0, without.stderr  # only --exit-code changes it


async def test_compact_is_one_line(nats_url: str, deciding: str) -> None:
    p = await emit(deciding, '{"a": 1}', "--url", nats_url, "--compact")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.decode().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["data"]["a"] == 1


async def test_the_emit_is_traced_in_the_callers_trace(nats_url: str, deciding: str) -> None:
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    with OtlpReceiver() as rx:
        p = await emit(
            deciding, '{"want": "deny"}', "--url", nats_url, "--otlp-endpoint", rx.url,
            env={"TRACEPARENT": f"00-{trace_id}-{caller}-01"},
        )  # fmt: skip
        spans = rx.wait_for(
            lambda got: any(s.name == f"emit {deciding}" for s in got), timeout_s=20
        )
    assert p.returncode == 0, p.stderr
    (span,) = [s for s in spans if s.name == f"emit {deciding}"]
    assert span.trace_id == trace_id and span.parent_span_id == caller
    assert span.service == "hookbus-emit"
    assert span.attributes["hookbus.action"] == "deny"
