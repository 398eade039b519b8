"""The example policies (examples/security_policy.py, examples/redactor.py) decided in
process with `hookbus.testing.WorkerTestKit`: the same fold, tool filters and failure
policies as when they are served, with no nats-server (the fast tier)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from hookbus.schemas import PROMPT_COMPLETE, TOOL_PRE
from hookbus.testing import WorkerTestKit

pytestmark = pytest.mark.anyio

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module


def call(tool: str, **tool_input: Any) -> dict[str, Any]:
    return {"tool_name": tool, "tool_input": tool_input}


@pytest.mark.parametrize(
    ("data", "action"),
    [
        (call("Bash", command="ls"), "deny"),  # Claude Code's name, matched ignoring case
        (call("bash", command="ls"), "deny"),
        (call("os:exec", argv=["id"]), "deny"),
        (call("send_sms", phone_number="+1-555-0100", text="hi"), "deny"),
        (call("send_sms", phone_number="+337-665-99-06", text="hi"), "continue"),
        (call("memory:store", note="account 000123456789"), "deny"),
        (call("memory:store", note="account ending 6789"), "continue"),
        (call("read_file", path="README.md"), "continue"),
        ({"tool_name": "bash", "tool_input": "not an object"}, "deny"),  # raises: fails closed
        ({"tool_input": {}}, "deny"),  # no tool name: raises, fails closed
    ],
)
async def test_the_security_policy_decides_tool_calls(data: dict[str, Any], action: str) -> None:
    async with WorkerTestKit(example("security_policy").worker) as hooks:
        result = await hooks.emit(TOOL_PRE, data)
    assert result.action == action, result
    if action == "deny":
        assert result.decided_by == "security_policy"


async def test_a_response_revealing_an_account_number_is_denied() -> None:
    async with WorkerTestKit(example("security_policy").worker) as hooks:
        leak = await hooks.emit(PROMPT_COMPLETE, {"response": "your account is 000123456789"})
        fine = await hooks.emit(PROMPT_COMPLETE, {"response": "your account ends in 6789"})
        broken = await hooks.emit(PROMPT_COMPLETE, {"response": ["not", "text"]})
    assert (leak.action, fine.action, broken.action) == ("deny", "continue", "deny")


async def test_the_redactor_rewrites_card_numbers_and_e_mail_addresses() -> None:
    async with WorkerTestKit(example("redactor").worker) as hooks:
        result = await hooks.emit(
            TOOL_PRE,
            call("send_sms", text="card 4111 1111 1111 1111, mail bob@example.com"),
        )
        untouched = await hooks.emit(TOOL_PRE, call("send_sms", text="card 1234 5678 9012 3456"))
    assert result.action == "continue" and result.modified_by == ["redact_pii"], result
    assert result.data["tool_input"]["text"] == (
        "card [REDACTED card ending 1111], mail [REDACTED e-mail]"
    )
    assert [r["kind"] for r in result.data["redactions"]] == ["card_number", "email_address"]
    assert untouched.modified_by in (None, []) and "redactions" not in untouched.data
