"""The real Claude Code CLI against a fake Anthropic Messages API, for the tests and the
benchmark that drive it (tests/test_claude_code_real.py, benchmarks/claude_code_bench.py
``--real-cli``).

- `claude_binary()`: the CLI of npm ``@anthropic-ai/claude-code`` (pinned in
  tests/claude_cli/package.json), installed by `_node.node_packages` into
  ``~/.cache/hookbus/``; its postinstall puts the native binary of the platform's optional
  dependency in place. `None` (with the reason) when node/npm or the binary is missing.
- `FakeMessagesApi`: a local HTTP server answering ``POST /v1/messages`` (SSE when the
  request asks for ``stream``): a request whose last message holds no ``tool_result``
  gets one ``tool_use`` block calling ``Bash`` with the server's `command`, the next one
  (the tool's result, or the hook's refusal, in it) a final text. Other requests the CLI
  makes (token counting, ...) get a small valid answer.
- `run_claude(...)`: one headless turn, ``claude -p PROMPT --output-format json``, with the
  API at the fake server, a private HOME, telemetry, auto-update and nonessential traffic
  off, and a wall-clock bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MANIFEST = Path(__file__).resolve().parent / "claude_cli" / "package.json"
MODEL = "claude-sonnet-4-5"


def claude_binary() -> tuple[Path | None, str]:
    """(the ``claude`` executable, "") or (None, why it does not run). Installs once (node
    and npm too, with apt-get, when missing)."""
    from _node import node_packages

    modules = node_packages(MANIFEST, "claude-code-cli")
    exe = modules / ".bin" / "claude"
    if not exe.exists():
        return None, f"npm installed no 'claude' executable under {modules}"
    probe = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "HOME": str(modules.parent)})  # fmt: skip
    if probe.returncode != 0 or "Claude Code" not in probe.stdout:
        return None, (f"'claude --version' does not run here (exit {probe.returncode}):"
                      f" {probe.stdout.strip()} {probe.stderr.strip()[-500:]}")  # fmt: skip
    return exe, ""


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events
    )


def _message(content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex[:20]}",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }


def _stream(message: dict[str, Any]) -> bytes:
    start = {**message, "content": [], "stop_reason": None}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            events += [
                ("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": {"type": "text", "text": ""}}),
                ("content_block_delta", {"type": "content_block_delta", "index": i,
                                         "delta": {"type": "text_delta", "text": block["text"]}}),
            ]  # fmt: skip
        else:
            events += [
                ("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": {**block, "input": {}}}),
                ("content_block_delta", {"type": "content_block_delta", "index": i,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": json.dumps(block["input"])}}),
            ]  # fmt: skip
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events += [
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                           "usage": {"output_tokens": 5}}),
        ("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip
    return _sse(events)


def _has_tool_result(body: dict[str, Any]) -> bool:
    messages = body.get("messages") or []
    last = messages[-1] if messages else {}
    content = last.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") == "tool_result" for b in content
    )


def _offers_bash(body: dict[str, Any]) -> bool:
    return any(isinstance(t, dict) and t.get("name") == "Bash" for t in body.get("tools") or [])


@dataclass
class FakeMessagesApi:
    """See the module docstring. `command` is what the tool_use asks Bash to run;
    `tool_results` collects the text of every tool_result the CLI sent back, `requests`
    every ``/v1/messages`` body (what the model was shown: a hook's added context too)."""

    command: str = "true"
    tool_results: list[str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    @contextlib.contextmanager
    def serving(self) -> Iterator[FakeMessagesApi]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, payload: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                self._send(200, b"{}", "application/json")

            def do_HEAD(self) -> None:
                self._send(200, b"", "application/json")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                path = self.path.split("?")[0]
                if path.endswith("/count_tokens"):
                    self._send(200, b'{"input_tokens": 10}', "application/json")
                    return
                if not path.endswith("/v1/messages"):
                    self._send(200, b"{}", "application/json")
                    return
                api.requests.append(body)
                if _has_tool_result(body):
                    for block in body["messages"][-1]["content"]:
                        if isinstance(block, dict) and block.get("type") == "tool_result":
                            api.tool_results.append(json.dumps(block.get("content")))
                    message = _message([{"type": "text", "text": "done"}], "end_turn")
                elif _offers_bash(body):
                    call = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}",
                            "name": "Bash",
                            "input": {"command": api.command, "description": "run it"}}  # fmt: skip
                    message = _message([call], "tool_use")
                else:
                    message = _message([{"type": "text", "text": "ok"}], "end_turn")
                if body.get("stream"):
                    self._send(200, _stream(message), "text/event-stream")
                else:
                    self._send(200, json.dumps(message).encode(), "application/json")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()


@dataclass
class Turn:
    code: int
    stdout: str
    stderr: str
    seconds: float


def claude_env(home: Path, api_url: str, **extra: str) -> dict[str, str]:
    """Claude Code's environment: the fake API, a private HOME, nothing phoned home."""
    keep = {k: v for k, v in os.environ.items()
            if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "TERM")}  # fmt: skip
    return {
        **keep,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "ANTHROPIC_BASE_URL": api_url,
        "ANTHROPIC_API_KEY": "test",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "NATS_CONTEXT": "",
        **extra,
    }


def trust(home: Path, project: Path) -> None:
    """Record in HOME's ``.claude.json`` that `project`'s trust dialog was accepted (an
    untrusted workspace's permission rules are ignored in a headless run)."""
    config = home / ".claude.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    entry = data.setdefault("projects", {}).setdefault(str(project.resolve()), {})
    entry["hasTrustDialogAccepted"] = True
    data["hasCompletedOnboarding"] = True
    config.write_text(json.dumps(data))


def run_claude(
    exe: Path, project: Path, env: dict[str, str], timeout: float = 90,
    prompt: str = "run the command",
) -> Turn:  # fmt: skip
    """One headless turn in `project` (its .claude/settings.json applies: it must allow
    Bash, ``"permissions": {"allow": ["Bash"]}``; ``--dangerously-skip-permissions`` is
    refused when running as root)."""
    argv = [str(exe), "-p", prompt, "--output-format", "json", "--model", MODEL]
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(
            f"claude -p ran past {timeout}s\nstdout: {out}\nstderr: {err}"
        ) from None
    return Turn(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)
