"""`hookbus demo --via aos`: the transcript's steps as OWASP AOS requests through the AOS
guardian door give the same decisions as the agents' direct emits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import msgspec

from hookbus.demo._aos import aos_request
from hookbus.demo._common import Transcript

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "aos" / "aos_schema.json").read_text())
DEMO_TIMEOUT_S = 50


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hookbus.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
    )


def tables(out: str) -> list[list[list[str]]]:
    """Every table's body rows (cell texts), in order."""
    found: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in out.splitlines():
        if line.startswith("┏"):
            current = []
            found.append(current)
        elif line.startswith("│") and current is not None:
            current.append([cell.strip() for cell in line.strip("│").split("│")])
    return found


def decisions(out: str) -> dict[tuple[str, str], tuple[str, ...]]:
    """(agent, step) -> (event, tool, action, deciding handler, approved by, expected)."""
    rows = tables(out)[0]
    return {(r[1], r[2]): (r[3], r[4], r[5], r[6], r[7], r[9]) for r in rows}


def test_both_paths_give_the_same_decisions(nats_url: str) -> None:
    direct = run_demo("--url", nats_url)
    assert direct.returncode == 0, direct.stdout + direct.stderr
    via = run_demo("--url", nats_url, "--via", "aos")
    assert via.returncode == 0, via.stdout + via.stderr
    assert decisions(via.stdout) == decisions(direct.stdout)
    assert len(decisions(direct.stdout)) == 26
    assert "all 26 decisions match the transcript" in via.stdout

    assert len(tables(direct.stdout)) == 1  # the AOS table is --via aos's only
    ours = decisions(via.stdout)
    aos = {(r[1], r[2]): (r[3], r[4]) for r in tables(via.stdout)[1]}
    assert set(aos) == set(ours)
    for key, (sent_as, told) in aos.items():
        action = ours[key][2]
        if sent_as.startswith("direct"):
            assert told == "" and ours[key][0] in ("session:start", "session:end"), key
        elif action == "deny":
            assert told == "deny", key
        else:
            assert told in ("allow", "modify"), key
    assert aos[("payments-agent", "5")] == ("steps/toolCallRequest", "deny")
    assert aos[("email-assistant", "1")] == ("steps/agentTrigger -> session:start", "allow")
    assert aos[("payments-agent", "6")] == ("steps/message", "deny")
    assert aos[("email-assistant", "2")] == ("steps/toolCallRequest", "modify")
    # the transfer: redacted on the way and approved by the approver process: modify
    assert aos[("payments-agent", "9")] == ("steps/toolCallRequest", "modify")
    assert ours[("payments-agent", "9")][2:5] == ("continue", "transfer_approval", "demo-approver")
    summary = "sent through the AOS door: 23 steps (16 allow, 5 deny, 2 modify); 3 emitted directly"
    assert summary in via.stdout


def test_every_request_the_demo_sends_is_a_valid_aos_request() -> None:
    transcript = msgspec.json.decode((EXAMPLES / "transcript.json").read_bytes(), type=Transcript)
    validator = jsonschema.Draft7Validator({**SCHEMA, "$ref": "#/$defs/ASOPRequest"})
    sent: list[dict[str, Any]] = []
    for script in transcript.agents:
        for no, step in enumerate(script.steps, 1):
            made = aos_request(script, no, step)
            if made is None:
                assert step.event in ("session:start", "session:end")
                continue
            request, events = made
            assert [e.message for e in validator.iter_errors(request)] == [], (script.id, no)
            assert request["params"]["context"]["agent"]["id"] == script.id
            assert events == ({"steps/agentTrigger": "session:start"}
                              if request["method"] == "steps/agentTrigger" else {})  # fmt: skip
            sent.append(request)
    assert len(sent) == 23
    assert len({r["id"] for r in sent}) == 23
