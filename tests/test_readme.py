"""README.md runs as written: every code block is run for real, or says why not.

Each fenced block of the README is found by a line of its own (`RUNS`) and run by one test
below, against the suite's nats-server (or, for a block that starts its own server, on a
free port): Python blocks in a subprocess with top-level ``await`` (as ``python -m asyncio``
runs them), shell blocks command by command (`_readme_run.Shell`: ``hookbus`` commands that
terminate are run to their end, services are started, checked for their banner and stopped
with SIGINT, asserting exit code 0 and no traceback). A block that cannot run here carries
``<!-- readme-test: skip (why) -->`` right before it; `test_every_block_runs_or_says_why`
fails on a block that is neither run nor skipped with a reason.

`test_a_newcomer_from_the_readme` walks the README's approval loop in a browser (Debian's
Chromium through Playwright, as tests/test_console.py drives it).
"""

from __future__ import annotations

import json
import re
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from _browser import (  # noqa: F401 (the fixtures browser, chromium, page)
    browser_fixture,
    chromium_fixture,
    page_fixture,
    screenshot_folder,
    sign_in,
)
from _ports import free_port
from _procs import alive
from _readme_blocks import Block, Command, blocks, commands, free_names, inline_code
from _readme_run import HOOKBUS, NOT_RUN, Job, Result, Shell, Snippet, clean_env, run_python
from playwright.async_api import Page, expect

from hookbus.cli import EmbeddedNatsServer
from hookbus.integrations.console import CSRF_HEADER

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent

WORKER_AGENT_REQUEST = "test_a_worker_an_agent_and_a_plain_nats_request"
RUNS = {
    "pip install '.[cli,server]' && hookbus demo": "test_the_install_lines_and_the_demo",
    ".venv/bin/pip install -q -e '.[cli,server]'": "test_the_install_lines_and_the_demo",
    "# policy.py\n": WORKER_AGENT_REQUEST,
    'hooks.set_default_fields(session_id="sess_1")': WORKER_AGENT_REQUEST,
    "nats req ": WORKER_AGENT_REQUEST,
    "from hookbus.testing import WorkerTestKit": "test_the_worker_test_kit",
    "# test_gate.py\n": "test_the_hook_test_env_module",
    "from hookbus.amplifier import": "test_the_amplifier_core_switch",
    "HookbusCapability(hooks)": "test_the_pydantic_ai_capability",
    "HookbusToolHooks(hooks).tool_node(": "test_the_langgraph_tool_node",
    "HookbusGuard(hooks).run(": "test_the_openai_agents_guard",
    "HookbusClaudeHooks(hooks).options(": "test_the_claude_agent_sdk_hooks",
    '{"hooks": {"PreToolUse"': "test_the_claude_code_settings_block",
    "hookbus gateway aos ": "test_the_aos_door_with_curl",
    "class TransferApproval(": "test_a_suspension_resolved_from_another_dispatcher",
    "HOOKBUS_CONSOLE_TOKEN=... hookbus console": "test_the_console_command",
    "hookbus auth init --out auth --demo": "test_the_secured_demo",
    "hookbus worker examples/approval_gate.py:worker &": "test_a_newcomer_from_the_readme",
}  # fmt: skip
"""A line of each README block that is run → the test that runs it."""


def block(fingerprint: str) -> Block:
    """The one README block containing `fingerprint`."""
    found = [b for b in blocks() if fingerprint in b.text]
    assert len(found) == 1, f"{len(found)} README.md blocks contain {fingerprint!r}"
    assert RUNS.get(fingerprint), f"{fingerprint!r} is not in RUNS"
    return found[0]


def port_is_free(port: int) -> bool:
    """Whether nothing listens on `port` (a server could bind it again: connections in
    TIME_WAIT do not count, as for any server with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A server of this module's own: the README emits standard events (``tool:pre``,
    ``prompt:complete``), and declarations other test modules leave on the suite's server
    (handlers whose workers are gone, some with policy deny) would decide them."""
    with EmbeddedNatsServer() as server:
        yield server.url


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A reader's folder: empty but for ``examples`` (the clone's)."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    return tmp_path


@pytest.fixture
async def shell(folder: Path, nats_url: str) -> AsyncIterator[Shell]:
    """A shell on the suite's server; every service still running at the end is stopped
    with SIGINT and must exit 0 without a traceback."""
    sh = Shell(folder, nats_url)
    try:
        yield sh
    finally:
        codes = await sh.stop()
    assert all(code == 0 for code in codes.values()), codes


async def forget_handlers(sh: Shell, *handlers: tuple[str, str]) -> None:
    """Remove declarations (event, name) that a block's worker left in the registry, with
    the README's ``hookbus handlers --remove``, so no dead route outlives the test."""
    for event, name in handlers:
        done = await sh.run(Command(["hookbus", "handlers", "--remove", event, name], 0))
        assert isinstance(done, Result) and done.code == 0, str(done)


# -- every block --------------------------------------------------------------------------
def test_every_block_runs_or_says_why() -> None:
    """Each code block is run by exactly one test here, or skipped with a reason; blocks
    without a language are diagrams; most blocks run."""
    found = blocks()
    code = [b for b in found if b.is_code]
    for b in found:
        if not b.is_code:
            assert b.lang in ("", "text"), f"{b.where}: no runner for a {b.lang} block"
            assert not re.search(r"^(\$ )?hookbus ", b.text, re.M), f"{b.where}: commands"
    run, skipped = [], []
    for b in code:
        runners = {test for mark, test in RUNS.items() if mark in b.text}
        if b.skip:
            assert not runners, f"{b.where} is skipped but {runners} runs it"
            skipped.append(b)
        else:
            assert len(runners) == 1, f"{b.where} ({b.lang}) is run by {runners or 'no test'}"
            run.append(b)
    for mark in RUNS:
        assert sum(mark in b.text for b in found) == 1, f"{mark!r}: not one README block"
    tests = {name for name in globals() if name.startswith("test_")}
    assert set(RUNS.values()) <= tests
    print(f"README.md: {len(code)} code blocks, {len(run)} run, {len(skipped)} skipped; "
          f"{len(found) - len(code)} diagrams")  # fmt: skip
    for b in skipped:
        print(f"  skipped {b.where}: {b.skip}")
    assert len(run) >= 0.75 * len(code), "most README blocks must run"


def test_a_skip_needs_a_reason() -> None:
    with pytest.raises(ValueError, match=r"skip \(the reason\)"):
        blocks("<!-- readme-test: skip -->\n```sh\nhookbus demo\n```\n")
    with pytest.raises(ValueError, match="not closed"):
        blocks("```python\nprint()\n")
    (b,) = blocks("<!-- readme-test: skip (a fragment) -->\n\n```python\nx\n```\n")
    assert b.skip == "a fragment" and b.line == 4


# -- install, the demo ----------------------------------------------------------------------
async def test_the_install_lines_and_the_demo(shell: Shell) -> None:
    """``hookbus demo`` (both blocks name it: run once) passes against the suite's server;
    the install lines are left to tests/test_packaging.py."""
    ran = []
    for mark in ("pip install '.[cli,server]' && hookbus demo",
                 ".venv/bin/pip install -q -e '.[cli,server]'"):  # fmt: skip
        ran += await shell.run_block(block(mark))
    demos = {id(r): r for r in ran if isinstance(r, Result)}
    assert len(demos) == 1, ran
    (demo,) = demos.values()
    assert demo.code == 0, str(demo)
    assert re.search(r"all \d+ decisions match the transcript", demo.stdout), str(demo)
    assert sorted(why for _, why in shell.not_run) == sorted(
        [NOT_RUN["pip"], NOT_RUN["venv"], NOT_RUN["pip"]]
    ), shell.not_run


# -- a worker, an agent, a plain NATS request ---------------------------------------------
async def test_a_worker_an_agent_and_a_plain_nats_request(
    shell: Shell, folder: Path, nats_url: str
) -> None:
    """policy.py served as the README says, the agent snippet denied by it, then the
    dispatcher service answering the plain NATS request with an EmitReply."""
    worker = block("# policy.py\n")
    (folder / "policy.py").write_text(worker.text)
    serve = inline_code(worker, "hookbus worker")
    assert serve.startswith("hookbus worker policy.py:worker"), serve
    agent = block('hooks.set_default_fields(session_id="sess_1")')
    assert free_names(worker) == free_names(agent) == set()
    try:
        for cmd in commands(Block("sh", worker.line, serve + "\n")):
            assert isinstance(await shell.run(cmd), Job)
        said = await run_python(folder, [Snippet.of(agent, nats_url=nats_url)])
        assert said.stdout == "blocked: destructive command by security\n", str(said)

        assert isinstance(await shell.run(_one(inline_code(agent, "hookbus dispatcher"))), Job)
        (reply,) = await shell.run_block(block("nats req "))
        assert isinstance(reply, Result)
        answer = json.loads(reply.stdout)
        assert set(answer) == {"result"}, answer  # an EmitReply with the folded result
        assert answer["result"]["decided_by"] != "security", answer  # no command: allowed
    finally:
        await shell.stop()
        await forget_handlers(shell, ("tool:pre", "security"))


async def test_the_worker_test_kit(folder: Path) -> None:
    """The kit block decides the README's policy.py in process: no server, no command."""
    (folder / "policy.py").write_text(block("# policy.py\n").text)
    kit = block("from hookbus.testing import WorkerTestKit")
    assert free_names(kit) == set()
    said = await run_python(folder, [Snippet.of(kit)])
    assert said.stdout == "security destructive command\n", str(said)


async def test_the_hook_test_env_module(folder: Path) -> None:
    """The HookTestEnv block is a whole test module: pytest runs its three tests, one of
    them against the embedded nats-server the kit starts (the reader's pytest has no
    plugin of ours; looptime's, installed here for the suite, is left out as the suite
    leaves it out)."""
    b = block("# test_gate.py\n")
    (folder / "test_gate.py").write_text(b.text)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-p", "no:looptime_plugin", "-p", "no:looptime_chronometers",
            "-p", "no:looptime_timeproxies", "test_gate.py"]  # fmt: skip
    said = await Shell(folder)._exec(argv, clean_env(), 120, shown=f"pytest {b.where}")
    assert said.code == 0 and "3 passed" in said.stdout, str(said)


async def run_given(
    tmp_path: Path, fingerprint: str, free: set[str], given: str, check: str, **options: float
) -> Result:
    """Run the README block containing `fingerprint`, whose free names must be `free`,
    after the code `given` (which defines them) and before the code `check`: what it all
    printed (`options`: `run_python`'s)."""
    b = block(fingerprint)
    assert free_names(b) == free
    return await run_python(
        tmp_path, [Snippet(given)], [Snippet.of(b)], [Snippet(check)], **options
    )


def _one(text: str) -> Command:
    (cmd,) = commands(Block("sh", 0, text + "\n"))
    return cmd


# -- amplifier-core, pydantic-ai, suspensions -------------------------------------------------
async def test_the_amplifier_core_switch(tmp_path: Path) -> None:
    b = block("from hookbus.amplifier import")
    use = Snippet(
        "registry = HookRegistry()\n"
        "registry.register('tool:pre', lambda e, d: HookResult(action='deny', reason='no'))\n"
        "result = await registry.emit('tool:pre', {'tool_name': 'bash'})\n"
        "print(result.action, result.reason)\n"
    )
    said = await run_python(tmp_path, [Snippet.of(b)], [use])
    assert said.stdout == "deny no\n", str(said)


async def test_the_pydantic_ai_capability(tmp_path: Path, nats_url: str) -> None:
    """Given `nc` (a connection) and `model` (pydantic-ai's TestModel), the block runs an
    agent whose hooks go on the bus."""
    given = (
        f"import nats\nfrom pydantic_ai.models.test import TestModel\n"
        f"nc = await nats.connect({nats_url!r})\nmodel = TestModel()\n"
    )
    check = "print(type(result).__name__, bool(result.output))\nawait nc.close()\n"
    said = await run_given(tmp_path, "HookbusCapability(hooks)", {"nc", "model"}, given, check)
    assert said.stdout == "AgentRunResult True\n", str(said)


async def test_the_langgraph_tool_node(tmp_path: Path, nats_url: str) -> None:
    """Given `nc` and `model` (langchain-core's scripted chat model asking for ``rm -rf``),
    with a worker that denies it: the tool never runs and the model reads why (the worker
    removes its declaration after: the module's server is shared)."""
    given = (
        "import nats\n"
        "from langchain_core.language_models.fake_chat_models import GenericFakeChatModel\n"
        "from langchain_core.messages import AIMessage\n"
        "from hookbus.schemas import HookResult\n"
        "from hookbus.workers import HookWorker\n"
        f"nc = await nats.connect({nats_url!r})\n"
        f"guard = HookWorker(await nats.connect({nats_url!r}))\n"
        "async def no_rm_rf(event, data):\n"
        "    if 'rm -rf' in data['tool_input']['command']:\n"
        "        return HookResult(action='deny', reason='destructive command')\n"
        "guard.add_handler('tool:pre', no_rm_rf, tool_filter=['bash'])\n"
        "await guard.start()\n"
        "call = {'name': 'bash', 'args': {'command': 'rm -rf /tmp/*'}, 'id': 'call-1'}\n"
        "model = GenericFakeChatModel(messages=iter([AIMessage('', tool_calls=[call]),"
        " AIMessage('done')]))\n"
    )
    check = (
        "print(result['messages'][2].content)\nprint(result['messages'][-1].content)\n"
        "await guard.unregister()\nawait guard.shutdown()\nawait nc.close()\n"
    )
    node = "HookbusToolHooks(hooks).tool_node("
    said = await run_given(tmp_path, node, {"nc", "model"}, given, check)
    assert said.stdout == "Denied by hook: destructive command\ndone\n", str(said)


async def test_the_openai_agents_guard(tmp_path: Path, nats_url: str) -> None:
    """Given `nc` (a connection) and `model` (a scripted `agents` model: one call of the
    block's tool, then text; no network, tracing off), the block runs an agent whose tool
    call goes on the bus."""
    given = (
        "import os, json, nats, agents\n"
        "os.environ.setdefault('OPENAI_API_KEY', 'sk-dummy-no-network')\n"
        "agents.set_tracing_disabled(True)\n"
        "from agents import ModelResponse, Usage\n"
        "from agents.models.interface import Model\n"
        "from openai.types.responses import ResponseFunctionToolCall as Call\n"
        "from openai.types.responses import ResponseOutputMessage as Msg\n"
        "from openai.types.responses import ResponseOutputText as Text\n"
        "class Scripted(Model):\n"
        "    turns = [[Call(id='fc1', call_id='c1', type='function_call', name='bash',\n"
        "                   arguments=json.dumps({'command': 'rm -rf build'}))]]\n"
        "    async def get_response(self, *args, **kwargs):\n"
        "        turn = self.turns.pop(0) if self.turns else [Msg(\n"
        "            id='m1', type='message', role='assistant', status='completed',\n"
        "            content=[Text(text='done', type='output_text', annotations=[])])]\n"
        "        return ModelResponse(output=turn, usage=Usage(), response_id=None)\n"
        "    def stream_response(self, *args, **kwargs):\n"
        "        raise NotImplementedError\n"
        f"nc = await nats.connect({nats_url!r})\nmodel = Scripted()\n"
    )
    check = (
        "outputs = [i.output for i in result.new_items if i.type == 'tool_call_output_item']\n"
        "print(result.final_output, outputs)\nawait nc.close()\n"
    )
    said = await run_given(tmp_path, "HookbusGuard(hooks).run(", {"nc", "model"}, given, check)
    assert said.stdout == "done ['ran rm -rf build']\n", str(said)


async def test_the_claude_agent_sdk_hooks(tmp_path: Path, nats_url: str) -> None:
    """Given `nc` and `project` (a trusted folder, HOME a private one, the Anthropic API a
    local fake: `_claude_cli.FakeMessagesApi`, one Bash call ``touch ran``, then "done"), the
    block runs the SDK's own CLI with its tool call on the bus."""
    home, project = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    project.mkdir()
    given = (
        "import os, sys, nats\nfrom pathlib import Path\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from _claude_cli import FakeMessagesApi, claude_env, trust\n"
        f"home, project = Path({str(home)!r}), Path({str(project)!r})\ntrust(home, project)\n"
        "serving = FakeMessagesApi(command='touch ran').serving()\napi = serving.__enter__()\n"
        "os.environ.update(claude_env(home, api.url))\n"
        f"nc = await nats.connect({nats_url!r})\n"
    )
    check = (
        "print(api.tool_results[0][:40])\nawait nc.close()\nserving.__exit__(None, None, None)\n"
    )
    options = "HookbusClaudeHooks(hooks).options("
    said = await run_given(tmp_path, options, {"nc", "project"}, given, check, timeout_s=120)
    assert said.stdout.startswith("done\n"), str(said)
    assert "Bash completed with no output" in said.stdout, str(said)
    assert (project / "ran").exists(), str(said)


async def test_a_suspension_resolved_from_another_dispatcher(tmp_path: Path, nats_url: str) -> None:
    """The agent's part and the part "from any process" run at once, each on a dispatcher
    of its own: the hook returns the resolution."""
    b = block("class TransferApproval(")
    assert free_names(b) == {"hooks", "other"}
    lines = b.text.splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if line.startswith("# from any process"))
    agent_part = Snippet("".join(lines[:cut]).replace("timeout_s=600", "timeout_s=30"), b.line)
    other_part = Snippet("".join(lines[cut:]), b.line + cut)
    given = Snippet(
        "import nats\nfrom hookbus.dispatcher import HookDispatcher\n"
        f"hooks = await HookDispatcher(await nats.connect({nats_url!r}), agent_id='payments')"
        ".__aenter__()\n"
        f"other = await HookDispatcher(await nats.connect({nats_url!r})).__aenter__()\n"
    )
    check = Snippet("print(answer)\nawait hooks.close()\nawait other.close()\n")
    said = await run_python(tmp_path, [given], [agent_part, other_part], [check])
    assert said.stdout == "TransferApproval(granted=True, reason='')\n", str(said)


# -- the doors --------------------------------------------------------------------------------
async def test_the_claude_code_settings_block(tmp_path: Path) -> None:
    """The settings.json block is what ``hookbus claude-code settings`` prints for it."""
    shown = json.loads(block('{"hooks": {"PreToolUse"').text)
    (event,) = shown["hooks"]
    (entry,) = shown["hooks"][event]
    (hook,) = entry["hooks"]
    program, _, args = hook["command"].partition(" claude-code ")
    printed = await Shell(tmp_path)._exec(
        [HOOKBUS, "claude-code", "settings", "--command", program, "--events", event,
         "--matcher", entry["matcher"], "--hook-timeout", str(hook["timeout"]), "--",
         *args.split()],
        {},
    )  # fmt: skip
    assert printed.code == 0, str(printed)
    assert json.loads(printed.stdout) == shown


async def test_the_aos_door_with_curl(shell: Shell) -> None:
    """With the worker the block's comment names, the gateway answers the curl command
    with the decision and message the comment shows."""
    b = block("hookbus gateway aos ")
    found = re.search(r"# with (\S+:worker) serving:\n((?:#.*\n)+)", b.text)
    assert found, b.text
    expected = " ".join(line.lstrip("#").strip() for line in found.group(2).splitlines())
    try:
        assert isinstance(await shell.run(_one(f"hookbus worker {found.group(1)}")), Job)
        gateway, curl = await shell.run_block(b)
        assert isinstance(gateway, Job) and isinstance(curl, Result), (gateway, curl)
        reply = json.loads(curl.stdout)
        for key in ("decision", "message"):
            shown = re.search(rf'"{key}":"([^"]+)"', expected)
            assert shown, expected
            assert reply["result"][key] == shown.group(1), (reply, expected)
        assert reply["id"] == "req-1" and reply["jsonrpc"] == "2.0"
    finally:
        await shell.stop()
        await forget_handlers(shell, ("tool:pre", "security_policy"),
                              ("prompt:complete", "response_dlp"))  # fmt: skip


async def test_the_console_command(shell: Shell) -> None:
    """The console serves (on a free port: its default is the comment's 8090) and takes
    the token of ``HOOKBUS_CONSOLE_TOKEN``."""
    b = block("HOOKBUS_CONSOLE_TOKEN=... hookbus console")
    (console,) = await shell.run_block(b)
    assert isinstance(console, Job) and console.url.startswith("http://127.0.0.1:"), console
    assert 8090 in shell.http and "http://127.0.0.1:8090/" in commands(b)[0].comment
    async with httpx.AsyncClient(base_url=console.url, timeout=10) as client:
        token = shell.secrets["HOOKBUS_CONSOLE_TOKEN"]
        r = await client.post("/api/login", json={"token": token, "approver": "reader"},
                              headers={CSRF_HEADER: "1"})  # fmt: skip
        assert r.status_code == 200, r.text
    helped = await shell._exec([HOOKBUS, "console", "--help"], {})
    assert re.search(r"\[default:\s+8090", helped.stdout), helped.stdout


# -- the secured demo ---------------------------------------------------------------------------
async def test_the_secured_demo(folder: Path) -> None:
    """auth init, the server on its config (in the background), the demo with every role's
    credentials: it passes, with the approver in its "approved by" column."""
    sh = Shell(folder, server_port=free_port())
    try:
        init, server, demo = await sh.run_block(block("hookbus auth init --out auth --demo"))
        assert isinstance(init, Result) and init.code == 0, str(init)
        assert isinstance(server, Job) and sh.jobs == [server]
        assert isinstance(demo, Result) and demo.code == 0, str(demo)
        assert "approved" in demo.stdout and "demo-approver" in demo.stdout, str(demo)
    finally:
        codes = await sh.stop()
    assert list(codes.values()) == [0], codes
    assert server.children and not any(alive(pid) for pid in server.children)


# -- the newcomer's walk-through ----------------------------------------------------------------
@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Iterator[Path]:
    with screenshot_folder("readme", request.node.name) as shots:
        yield shots


async def test_a_newcomer_from_the_readme(folder: Path, page: Page, artifacts: Path) -> None:
    """The README's approval loop, command by command, on a server of its own: the
    approval appears in the browser, Allow once, the emit continues with the approver,
    ``hookbus tail`` prints the decision with its latency, and every process stops on
    SIGINT with exit 0, leaving no process and no port behind."""
    port = free_port()
    sh = Shell(folder, nats_url=f"nats://127.0.0.1:{port}", server_port=port)
    steps = commands(block("hookbus worker examples/approval_gate.py:worker &"))
    kinds = [c.argv[1] if c.argv[0] == "hookbus" else c.argv[0] for c in steps]
    assert kinds == ["server", "worker", "console", "emit", "tail", "kill"], kinds
    console_cmd, emit_cmd, tail_cmd, kill_cmd = steps[2:]
    try:
        server, _worker, console = [await sh.run(c) for c in steps[:3]]
        assert isinstance(server, Job) and isinstance(console, Job)
        nats_server = server.children
        assert len(nats_server) == 1 and alive(nats_server[0])
        await sign_in(page, console.url, console_cmd.env["HOOKBUS_CONSOLE_TOKEN"], "newcomer")
        await expect(page.locator("#who")).to_have_text("signed in as newcomer")
        await expect(page.locator("#live")).to_have_text("live")

        call = json.loads(emit_cmd.argv[-1])["tool_input"]
        prompt = f"Transfer {call['amount']} {call['currency']} to {call['payee']}?"
        card = page.locator("article.approval", has_text=prompt)
        async with anyio.create_task_group() as tg:
            emitted: list[Result | Job | None] = []

            async def emit() -> None:
                emitted.append(await sh.run(emit_cmd))

            started = time.monotonic()
            tg.start_soon(emit)
            try:
                await card.wait_for(state="visible", timeout=15_000)
            except Exception as exc:
                raise AssertionError(f"no approval {prompt!r} on the page; the emit: "
                                     f"{emitted or 'still waiting'}") from exc  # fmt: skip
            print(f"approval on the page {time.monotonic() - started:.2f} s after the emit")
            await page.screenshot(path=str(artifacts / "readme-pending.png"), full_page=True)
            await card.locator("button", has_text="Allow once").click()
        (done,) = emitted
        assert isinstance(done, Result) and done.code == 0, str(done)
        result = json.loads(done.stdout)
        assert (result["action"], result["approved_by"]) == ("continue", "newcomer"), result
        assert result["decided_by"] == "transfer_approval"
        await expect(card).to_have_count(0)
        row = page.locator("#decisions tbody tr", has_text="payments:create_transfer")
        await expect(row.locator("td.approver")).to_have_text("newcomer")  # the console's too
        # the console opened before the first decision made the stream: no stale "off" note
        await expect(page.locator("#decisions-note")).to_have_text("")

        tail = await sh.run(tail_cmd)
        assert isinstance(tail, Job)
        line = await tail.wait_for(
            r"tool:pre\s+\S+\s+payments:create_transfer\s+continue\s+"
            r"(\d+(\.\d+)?m?s|\d+m\d\ds)\s+transfer_approval",
            stderr=False,
        )  # fmt: skip
        print(f"hookbus tail: {line.rstrip()}")
        await page.screenshot(path=str(artifacts / "readme-answered.png"), full_page=True)

        await sh.run(kill_cmd)
        assert [j.code for j in sh.jobs] == [0, 0, 0], [j.output for j in sh.jobs]
    finally:
        codes = await sh.stop()
    assert set(codes.values()) == {0}, codes
    for job in sh.services:
        assert not [pid for pid in job.children if alive(pid)], f"{job.name} left a child"
    assert not alive(nats_server[0]), "the embedded nats-server outlived hookbus server"
    for held in (port, int(console.url.rsplit(":", 1)[1].strip("/"))):
        assert port_is_free(held), f"port {held} is still held"
