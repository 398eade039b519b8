"""The approvals console (`hookbus console`, `hookbus.integrations.console`), in a real browser.

Everything is real: the session's nats-server, a `HookWorker` whose handler asks the user,
an agent's `HookDispatcher` whose emit waits on the approval, the console served by uvicorn
(as the ``hookbus console`` subprocess, or in this process), and Debian's headless
Chromium driven by Playwright (``executable_path``: Playwright's own browsers are never
downloaded). Chromium is installed with apt-get when it is missing (CI runs as root).

Each test has its own event, session and prompt, so it finds its own approvals among
whatever else the shared server holds.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import pytest
from _browser import (  # noqa: F401 (the fixtures browser, chromium, page)
    browser_fixture,
    chromium_fixture,
    page_fixture,
    screenshot_folder,
)
from _browser import sign_in as browser_sign_in
from _emitted import Emitted, in_background
from _served_app import served
from _served_process import ServedProcess
from click.testing import CliRunner
from conftest import Connect
from nats.aio.client import Client as NATS
from playwright.async_api import Page, expect

from hookbus.cli import EmbeddedNatsServer
from hookbus.cli._auth_files import DEFAULT_TENANT, load_setup
from hookbus.cli._command_tree import cli
from hookbus.cli._connect import auth_ssl_context
from hookbus.cli._permissions import inbox_prefix
from hookbus.cli._provision import provision
from hookbus.dispatcher import ApprovalsClient, DispatcherService, HookDispatcher
from hookbus.integrations.console import COOKIE, CSRF_HEADER, console_app
from hookbus.schemas import (
    TOOL_PRE,
    EmitReply,
    EmitRequest,
    HookResult,
    decode,
    emit_service_subject,
    encode,
)
from hookbus.workers import HookWorker

# a first run on a clean machine installs Chromium (about 30 s) inside the first test
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

TOKEN = "console-test-token-5c2e"
OPTIONS = ["Allow once", "Allow always", "Deny"]
POST = {"Content-Type": "application/json", CSRF_HEADER: "1"}


# -- the browser ----------------------------------------------------------------------------
async def sign_in(page: Page, url: str, token: str = TOKEN, approver: str | None = "alice") -> None:
    await browser_sign_in(page, url, token, approver)


# -- the bus --------------------------------------------------------------------------------
def asking_worker(conn: NATS, event: str, prompt: str, **options: Any) -> HookWorker:
    """A worker whose handler asks the user `prompt` for every call of `event`."""
    w = HookWorker(conn, **options)

    @w.handler(event, name="console_gate", failure_policy="deny", timeout_s=5.0)
    async def console_gate(ev: str, data: dict[str, Any]) -> HookResult:
        return HookResult(
            action="ask_user",
            approval_prompt=prompt,
            approval_options=OPTIONS,
            approval_timeout=30.0,
            approval_default="deny",
        )

    return w


class Scene:
    """A worker that asks, an agent (its dispatcher, with the audit trail on) in its own
    session, and the prompt its approvals show."""

    def __init__(self, agent: HookDispatcher, event: str, session: str, prompt: str) -> None:
        self.agent, self.event, self.session, self.prompt = agent, event, session, prompt

    def data(self, command: str) -> dict[str, Any]:
        return {"tool_name": "bash", "tool_input": {"command": command}, "agent_id": "agent-7"}


@pytest.fixture
async def scene(connect: Connect, event: str) -> AsyncIterator[Scene]:
    tag = uuid.uuid4().hex[:8]
    prompt = f"Run a shell command ({tag})?"
    async with asking_worker(await connect(), event, prompt):
        agent = HookDispatcher(await connect(), audit=True)
        session = f"session-{tag}"
        agent.set_default_fields(session_id=session)
        async with agent:
            yield Scene(agent, event, session, prompt)


def spawn_emit(tg: Any, scene: Scene, command: str) -> Emitted:
    """The agent's emit of `command` in the background of `tg` (its `wait`: 15 s)."""
    return in_background(tg, lambda: scene.agent.emit(scene.event, scene.data(command)), 15)


async def shown(page: Page, card: Any, out: Emitted, timeout_s: float = 10.0) -> None:
    """Wait for the approval `card` of the emit `out`; on failure say what the emit did and
    what the console lists."""
    try:
        await card.wait_for(state="visible", timeout=timeout_s * 1000)
    except Exception as exc:
        listed = await page.evaluate("fetch('/api/approvals').then((r) => r.text())")
        raise AssertionError(
            f"no approval card after {timeout_s} s; the emit: "
            f"{out.result if out.done.is_set() else 'still waiting'}; listed: {listed}"
        ) from exc


async def live_card(page: Page, url: str, scene: Scene) -> Any:
    """Signs alice in on the console at `url`, waits for its live feed, and returns the
    locator of `scene`'s approval card (not shown yet)."""
    await sign_in(page, url, approver="alice")
    await expect(page.locator("#live")).to_have_text("live")
    return page.locator("article.approval", has_text=scene.prompt)


async def answered_on_the_page(
    page: Page, card: Any, scene: Scene, command: str, button: Any
) -> HookResult:
    """Emits `scene`'s call of `command`, waits for its `card` on `page`, clicks `button`
    (a locator on the card), and returns the emit's result."""
    async with anyio.create_task_group() as tg:
        out = spawn_emit(tg, scene, command)
        await shown(page, card, out)
        await button.click()
        return await out.wait()


# -- the console ----------------------------------------------------------------------------
class ConsoleProcess(ServedProcess):
    """``hookbus console --port 0 --url URL ...`` as a subprocess (token from the
    environment); `url` once it serves."""

    def __init__(self, nats_url: str, *args: str) -> None:
        argv = [a for a in ["console", "--port", "0", "--url", nats_url, *args] if a]
        super().__init__(
            argv, banner="hookbus console serving ", env={"HOOKBUS_CONSOLE_TOKEN": TOKEN}
        )


@contextlib.asynccontextmanager
async def served_console(connect: Connect, **options: Any) -> AsyncIterator[str]:
    """`console_app` on its own connection, served by uvicorn in this process; its URL."""
    nc = await connect()
    client = ApprovalsClient(nc)
    await client.start()

    def make_app(stopping: Callable[[], bool]) -> Any:
        return console_app(client, nc, token=TOKEN, stopping=stopping, **options)

    try:
        # as `hookbus console` serves it: request tasks still running 2 s after the stop
        # (a browser's page left open) are cancelled, not waited for without limit
        async with served(make_app=make_app, timeout_graceful_shutdown=2) as url:
            yield f"{url}/"
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def signed_in_client(url: str, approver: str = "carol") -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client holding `approver`'s session cookie."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        r = await client.post("/api/login", json={"token": TOKEN, "approver": approver},
                              headers={CSRF_HEADER: "1"})  # fmt: skip
        assert r.status_code == 200, r.text
        yield client


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Iterator[Path]:
    """This test's screenshot folder (test-artifacts/console/<test>), emptied first."""
    with screenshot_folder("console", request.node.name) as folder:
        yield folder


# -- the tests ---------------------------------------------------------------------------------
async def test_sign_in_see_a_pending_approval_live_and_allow_it(
    nats_url: str, scene: Scene, page: Page, artifacts: Path
) -> None:
    """The whole loop in a browser: sign in, an emit asks, the approval appears live with
    what the handlers saw, Allow once, the waiting emit continues with approved_by = the
    signed-in approver; the decision and the handler with its live replica are shown."""
    async with ConsoleProcess(nats_url) as console:
        await sign_in(page, console.url, approver="alice")
        await expect(page.locator("#who")).to_have_text("signed in as alice")
        await expect(page.locator("#live")).to_have_text("live")
        card = page.locator("article.approval", has_text=scene.prompt)
        await expect(card).to_have_count(0)

        # live: the card comes over the page's event stream, not a reading of the list
        lists: list[str] = []
        page.on("request", lambda r: lists.append(r.url) if "/api/approvals" in r.url else None)
        async with anyio.create_task_group() as tg:
            out = spawn_emit(tg, scene, "rm -rf /tmp/build")
            await shown(page, card, out)
            appeared_s = time.monotonic() - out.started
            print(f"pending approval on the page {appeared_s * 1000:.0f} ms after the emit")
            assert lists == [], f"the card came by reading the list, not the live feed: {lists}"
            assert not out.done.is_set()

            facts = card.locator(".facts")
            for text in ("agent-7", scene.session, "bash", "console_gate", scene.event):
                await expect(facts).to_contain_text(text)
            await expect(card.locator(".left")).to_contain_text("s left")
            await card.locator("summary").click()
            await expect(card.locator("pre")).to_contain_text('"command": "rm -rf /tmp/build"')
            assert await card.locator(".choices button").all_inner_texts() == OPTIONS
            await page.screenshot(path=str(artifacts / "console-pending.png"), full_page=True)

            await card.locator("button", has_text="Allow once").click()
            result = await out.wait()

        assert result.action == "continue"
        assert result.approved_by == "alice"
        assert result.decided_by == "console_gate"
        await expect(card).to_have_count(0)  # gone once answered (the feed's resolved)

        row = page.locator("#decisions tbody tr", has_text=scene.session)
        await expect(row).to_have_count(1)
        await expect(row.locator("td.approver")).to_have_text("alice")
        await expect(row).to_contain_text("continue")
        handler = page.locator("#handlers tbody tr", has_text="console_gate")
        await page.click("#handlers-refresh")
        await expect(handler.first.locator("td.replicas")).to_have_text("1")
        await page.screenshot(path=str(artifacts / "console-answered.png"), full_page=True)
    assert not [line for line in console.lines if TOKEN in line]  # the token is never logged


async def test_a_wrong_token_is_refused(connect: Connect, page: Page, artifacts: Path) -> None:
    async with served_console(connect) as url:
        await sign_in(page, url, token="not-the-token", approver="mallory")
        await expect(page.locator("#login-error")).to_have_text("the token is not accepted")
        await expect(page.locator("#console")).to_be_hidden()
        await page.screenshot(path=str(artifacts / "console-wrong-token.png"))
        assert await page.context.cookies() == []

        async with httpx.AsyncClient(base_url=url, timeout=10) as anonymous:
            for path in ("/api/approvals", "/api/grants", "/api/decisions", "/api/handlers",
                         "/events"):  # fmt: skip
                assert (await anonymous.get(path)).status_code == 401, path
            forged = "eyJhIjoibWFsbG9yeSIsImV4cCI6OTk5OTk5OTk5OX0.AAAA"  # mallory, unsigned
            r = await anonymous.get("/api/approvals", headers={"Cookie": f"{COOKIE}={forged}"})
            assert r.status_code == 401
            r = await anonymous.post("/api/login", json={"token": "nope", "approver": "m"},
                                     headers=POST)  # fmt: skip
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "unauthorized"

        # then the right token signs in, and the page is the console
        await sign_in(page, url, approver="alice")
        await expect(page.locator("#who")).to_have_text("signed in as alice")
        cookie = next(c for c in await page.context.cookies() if c["name"] == COOKIE)
        assert cookie["httpOnly"] is True and cookie["sameSite"] == "Strict"
        assert TOKEN not in cookie["value"]


async def test_answers_need_the_same_origin_header_and_json(connect: Connect) -> None:
    """A signed-in browser tricked by another site: no custom header, a form body, or a
    foreign Origin / Sec-Fetch-Site is refused before anything is answered or revoked."""
    async with served_console(connect) as url:
        async with signed_in_client(url) as client:
            body = json.dumps({"key": "k"})
            refused = [
                {"Content-Type": "application/json"},  # no custom header
                {CSRF_HEADER: "1", "Content-Type": "application/x-www-form-urlencoded"},
                {**POST, "Origin": "https://evil.example"},
                {**POST, "Sec-Fetch-Site": "cross-site"},
            ]
            for headers in refused:
                r = await client.post("/api/grants/revoke", content=body, headers=headers)
                assert r.status_code == 403, (headers, r.text)
            r = await client.post(
                "/api/approvals/answer", headers=POST,
                json={"label": "approval:nope", "agent_id": None, "choice": "Allow"},
            )  # fmt: skip
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await client.post("/api/grants/revoke", headers=POST, json={"key": 7})
            assert r.status_code == 400


async def test_revoke_a_grant_from_the_page(
    connect: Connect, scene: Scene, page: Page, artifacts: Path
) -> None:
    """An "Allow always" answered on the page stores a grant, which appears in the grants
    table; Revoke removes it from the bucket, and the next call asks again."""
    async with served_console(connect) as url:
        card = await live_card(page, url, scene)
        result = await answered_on_the_page(
            page, card, scene, "make deploy", card.locator("button", has_text="Allow always")
        )
        assert result.action == "continue" and result.approved_by == "alice"

        approvals = ApprovalsClient.over(scene.agent.approvals)
        grants = await approvals.approval_grants(session_id=scene.session)
        assert len(grants) == 1
        row = page.locator("#grants tbody tr", has_text=scene.session)
        await expect(row).to_have_count(1)  # live, from the approvals bucket's watch
        await expect(row).to_contain_text("console_gate")
        again = await scene.agent.emit(scene.event, scene.data("make test"))
        assert again.action == "continue" and "always" in (again.reason or "")
        handler = page.locator("#handlers tbody tr", has_text=scene.event)  # the first load
        await expect(handler.locator("td.replicas")).to_have_text("1")
        await page.screenshot(path=str(artifacts / "console-grant.png"), full_page=True)

        # a refused revoke (an approver's credentials on a secured server: 403) is said on
        # the page, where the approver looks, not in a tooltip
        refusal = "nats: permissions violation for publish to $KV.hookbus_approvals.g"

        async def refuse(route: Any) -> None:
            body = {"error": {"code": "not_permitted", "message": refusal}}
            await route.fulfill(status=403, content_type="application/json", body=json.dumps(body))

        await page.route("**/api/grants/revoke", refuse)
        await row.locator("button.revoke").click()
        await expect(page.locator("#grants-error")).to_be_visible()
        await expect(page.locator("#grants-error")).to_contain_text(refusal)
        await expect(row).to_have_count(1)
        await page.unroute("**/api/grants/revoke")

        await row.locator("button.revoke").click()
        await expect(row).to_have_count(0)
        await expect(page.locator("#grants-error")).to_have_text("")
        assert await approvals.approval_grants(session_id=scene.session) == []

        # asked again, now denied on the page
        denied = await answered_on_the_page(
            page, card, scene, "make test", card.locator("button", has_text="Deny")
        )
        assert denied.action == "deny" and denied.approved_by == "alice"


async def test_cancelled_and_expired_approvals_leave_the_pending_list(
    connect: Connect, scene: Scene, page: Page, artifacts: Path
) -> None:
    """Cancel on a card ends the approval: the waiting emit is denied "approval cancelled:
    by alice: on the console" and the card goes. An approval whose asker gave up
    (the caller's deadline) is shown expired past its timeout, ended by the console's next
    listing (its default applied), and leaves the list too."""
    async with served_console(connect) as url:
        card = await live_card(page, url, scene)
        result = await answered_on_the_page(
            page, card, scene, "make cancel", card.locator("button.cancel")
        )
        assert result.action == "deny"
        assert result.reason == "approval cancelled: by alice: on the console"
        await expect(card).to_have_count(0)

        gone = await scene.agent.emit(scene.event, scene.data("make expire"), timeout_s=0.5)
        assert gone.action == "deny"  # the caller's deadline: the approval stays pending
        await expect(card).to_have_count(1)
        await page.screenshot(path=str(artifacts / "console-left-pending.png"), full_page=True)
        # its own 30 s, then the margin: ended by a listing, gone from the page
        await expect(card).to_have_count(0, timeout=60_000)
        listed = await page.evaluate("fetch('/api/approvals').then((r) => r.json())")
        assert not [a for a in listed["approvals"] if a["prompt"] == scene.prompt]


async def test_the_event_stream_delivers_a_pending_approval_within_a_second(
    connect: Connect, scene: Scene
) -> None:
    """The raw server-sent events: hello first, then the pending approval (from the KV
    watch) within a second of the emit, then its resolution naming the approver."""
    async with served_console(connect) as url:
        async with (
            signed_in_client(url, approver="carol") as client,
            client.stream("GET", "/events") as stream,
        ):
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            events = _sse_events(stream.aiter_lines())
            kind, hello = await anext(events)
            assert kind == "hello" and hello["approver"] == "carol"
            async with anyio.create_task_group() as tg:
                out = spawn_emit(tg, scene, "cat /etc/passwd")
                with anyio.fail_after(10):
                    while True:
                        kind, item = await anext(events)
                        if kind == "approval" and item["session_id"] == scene.session:
                            break
                took = time.monotonic() - out.started
                print(f"pending approval on the event stream {took * 1000:.0f} ms after the emit")
                assert item["status"] == "pending" and item["prompt"] == scene.prompt
                assert item["options"] == OPTIONS and item["agent_id"] == "agent-7"
                assert item["data"]["tool_input"] == {"command": "cat /etc/passwd"}
                assert 25 < item["expires_at"] - time.time() <= 30

                listed = (await client.get("/api/approvals")).json()["approvals"]
                assert [a["label"] for a in listed if a["session_id"] == scene.session] == [
                    item["label"]
                ]
                r = await client.post(
                    "/api/approvals/answer", headers=POST,
                    json={"label": item["label"], "agent_id": "agent-7", "choice": "Deny"},
                )  # fmt: skip
                assert r.status_code == 200 and r.json()["answered_by"] == "carol"
                with anyio.fail_after(10):
                    while True:
                        kind, done = await anext(events)
                        if kind == "approval" and done["label"] == item["label"]:
                            break
                assert done["status"] == "resolved" and done["answered_by"] == "carol"
                assert (await out.wait()).action == "deny"
            r = await client.post(
                "/api/approvals/answer", headers=POST,
                json={"label": item["label"], "agent_id": "agent-7", "choice": "Allow once"},
            )  # fmt: skip
            assert r.status_code == 409  # already answered


REASON = (  # 300 characters: words, then one long unbroken token
    "denied by security_policy: the command writes outside the workspace and pipes a remote"
    " script into a shell; the policy allows network access only to the package mirror,"
    " never runs downloaded code without review: ask the admins "
    "sha256=9f2c4e7a1b3d5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"
)
assert len(REASON) == 300


def _tables_fixture(now: float) -> dict[str, Any]:
    """What the console's list endpoints answer in `test_the_tables_stay_readable_...`."""
    decision = {
        "id": "d1", "emit_id": "e1", "time": now - 5, "agent_id": "agent-7",
        "session_id": "session-9f8e7d6c5b4a", "event": "tool:pre", "tool_name": "bash",
        "action": "deny", "decided_by": "security_policy", "approver": None, "reason": REASON,
    }  # fmt: skip
    grant = {
        "key": "agent-7.session-9f8e7d6c5b4a.tool=3Apre.gate.bash", "agent_id": "agent-7",
        "session_id": "session-9f8e7d6c5b4a", "event": "tool:pre", "handler": "console_gate",
        "tool": "bash", "granted_at": now - 60, "label": "approval:7c1d0e5f",
    }  # fmt: skip
    handler = {
        "event": "tool:pre", "priority": 10, "name": "security_policy",
        "tool_filter": ["bash", "shell*"], "failure_policy": "deny", "timeout_s": 2.0,
        "required": True, "declared": True, "replicas": [{"service_id": "x"}], "last_seen": now,
    }  # fmt: skip
    return {
        "/api/decisions": {"records": [decision], "available": True},
        "/api/grants": {"grants": [grant]},
        "/api/handlers": {"handlers": [handler], "rejected": {}, "live_only": []},
        "/api/approvals": {"approvals": [], "now": now, "skipped": 0},
    }


async def test_the_tables_stay_readable_with_a_long_reason_on_a_desktop_and_a_phone(
    connect: Connect, page: Page, artifacts: Path
) -> None:
    """A decision with a 300-character reason: at 1280x800 every header stays on one line
    (no word broken letter by letter), the reason column keeps room and the page does not
    scroll sideways; at 390x844 (a phone) the rows are cards within the page, the reason
    as wide as the card allows. The lists are fixed (routed), so the layout is."""
    fixed = _tables_fixture(time.time())

    async def answer(route: Any) -> None:
        path = "/" + route.request.url.split("/", 3)[3].split("?")[0]
        await route.fulfill(status=200, content_type="application/json", json=fixed[path])

    for path in fixed:
        await page.route(f"**{path}*", answer)
    measure = """(table) => {
      const t = document.getElementById(table);
      const line = (el) => parseFloat(getComputedStyle(el).lineHeight);
      const box = (el) => el.getBoundingClientRect();
      return {
        headers: [...t.tHead.rows[0].cells].map((th) => [th.textContent,
          box(th).height - parseFloat(getComputedStyle(th).paddingTop)
          - parseFloat(getComputedStyle(th).paddingBottom), line(th)]),
        cells: [...t.tBodies[0].rows[0].cells].map((td) => [td.dataset.label || "",
          box(td).left, box(td).right, box(td).width]),
        reason: t.tBodies[0].rows[0].cells[8] && box(t.tBodies[0].rows[0].cells[8]).width,
        page: [document.documentElement.scrollWidth, document.documentElement.clientWidth],
      };
    }"""
    async with served_console(connect) as url:
        await page.set_viewport_size({"width": 1280, "height": 800})
        await sign_in(page, url, approver="alice")
        await expect(page.locator("#decisions td.reason")).to_have_text(REASON)
        await expect(page.locator("#grants tbody tr")).to_have_count(1)
        await expect(page.locator("#handlers td.replicas")).to_have_text("1")
        for table in ("decisions", "grants", "handlers"):
            got = await page.evaluate(measure, table)
            for text, height, line in got["headers"]:
                assert height <= 1.5 * line, f"{table} header {text!r} wraps: {height} px"
            scroll, width = got["page"]
            assert scroll <= width, f"the page scrolls sideways at 1280 px: {scroll} > {width}"
        got = await page.evaluate(measure, "decisions")
        assert got["reason"] >= 300, f"the reason column is {got['reason']} px wide"
        for label, _, _, cell_width in got["cells"][:8]:  # no other column squeezed to letters
            assert cell_width >= 40, (label, cell_width)
        await page.screenshot(path=str(artifacts / "console-tables-1280.png"), full_page=True)

        await page.set_viewport_size({"width": 390, "height": 844})
        await expect(page.locator("#decisions thead")).to_be_hidden()  # rows as cards
        for table in ("decisions", "grants", "handlers"):
            got = await page.evaluate(measure, table)
            scroll, width = got["page"]
            assert scroll <= width == 390, f"the page scrolls sideways at 390 px ({table})"
            for label, left, right, _ in got["cells"]:
                assert 0 <= left and right <= 390, f"{table} cell {label!r}: {left}..{right}"
        got = await page.evaluate(measure, "decisions")
        assert got["cells"][8][0] == "reason"  # each card line names its column
        assert got["reason"] >= 300, f"the reason is {got['reason']} px wide on a phone"
        reason_box = await page.locator("#decisions td.reason").bounding_box()
        assert reason_box is not None and reason_box["height"] < 400  # wrapped by words
        await page.screenshot(path=str(artifacts / "console-tables-390.png"), full_page=True)


async def test_an_approver_bound_to_the_token_is_who_answers(
    connect: Connect, scene: Scene
) -> None:
    """With ``approver=`` the name given at sign-in is ignored: answers are the bound one's."""
    async with served_console(connect, approver="bob") as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/api/session")).json()["approver_bound"] is True
            r = await client.post("/api/login", headers=POST,
                                  json={"token": TOKEN, "approver": "mallory"})  # fmt: skip
            assert r.status_code == 200 and r.json()["approver"] == "bob"
            async with anyio.create_task_group() as tg:
                out = spawn_emit(tg, scene, "ls")
                with anyio.fail_after(10):
                    while True:
                        pending = (await client.get("/api/approvals")).json()["approvals"]
                        mine = [a for a in pending if a["session_id"] == scene.session]
                        if mine:
                            break
                        await anyio.sleep(0.05)
                r = await client.post(
                    "/api/approvals/answer", headers=POST,
                    json={"label": mine[0]["label"], "agent_id": "agent-7", "choice": "Allow once"},
                )  # fmt: skip
                assert r.status_code == 200, r.text
                assert (await out.wait()).approved_by == "bob"


@dataclass
class SecuredServer:
    """A nats-server set up by ``hookbus auth init`` in `out` (nkeys, TLS)."""

    url: str
    out: Path

    def seed(self, role: str, name: str) -> str:
        """The nkey seed file of the identity (`role`, `name`) of the default tenant."""
        who = load_setup(self.out).find(DEFAULT_TENANT, role, name)
        assert who is not None
        return str(who.seed_path(self.out))


@contextlib.asynccontextmanager
async def secured_server(
    out: Path, *init: str
) -> AsyncIterator[tuple[SecuredServer, Callable[[str, str], Awaitable[NATS]]]]:
    """``hookbus auth init --out OUT *init``, its server started and provisioned by its
    admin; yields the server and ``connect_as(role, name)`` (a connection as that identity:
    its seed, inbox prefix and the folder's CA; closed at the end)."""
    result = CliRunner().invoke(cli, ["auth", "init", "--out", str(out), *init])
    assert result.exit_code == 0, result.output
    setup = load_setup(out)
    conns: list[NATS] = []
    server = EmbeddedNatsServer(out / "run", config=out / "server.conf", port=-1)

    async def connect_as(role: str, name: str) -> NATS:
        who = setup.find(DEFAULT_TENANT, role, name)
        assert who is not None
        conns.append(await nats.connect(
            server.url, nkeys_seed=str(who.seed_path(out)), allow_reconnect=False,
            inbox_prefix=inbox_prefix(who.public_key), connect_timeout=5,
            tls=auth_ssl_context(out),  # auth init's CA (TLS by default)
        ))  # fmt: skip
        return conns[-1]

    server.start()
    try:
        await provision(await connect_as("admin", "admin"))  # the buckets, as the admin does
        yield SecuredServer(server.url, out), connect_as
    finally:
        for conn in conns:
            await conn.close()
        server.stop()


async def test_on_a_secured_server_with_an_approvers_own_credentials(
    tmp_path: Path, page: Page
) -> None:
    """`hookbus auth init` identities: the agent (emitting through the dispatcher service,
    which asks the approvals: an agent may not create them), the worker and the console,
    which connects as approver alice (bound with --approver): an answer from the page (its
    proof) decides with approved_by alice; what alice's NATS user may not read (the audit
    trail) is said on the page, not fatal."""
    async with secured_server(
        tmp_path / "auth", "--agent", "payments", "--worker", f"gate:{TOOL_PRE}/console_gate",
        "--approver", "alice",
    ) as (server, connect_as):  # fmt: skip
        prompt = "Pay 1200.00 EUR to ACME Corp?"
        async with asking_worker(await connect_as("worker", "gate"), TOOL_PRE, prompt):
            service_nc = await connect_as("dispatcher", "dispatcher")
            service = DispatcherService(HookDispatcher(service_nc, strict_events=True), service_nc)
            agent_nc = await connect_as("agent", "payments")
            await service.start()
            async with (
                ConsoleProcess(server.url, "--nkey", server.seed("approver", "alice"),
                               "--approver", "alice") as console,
            ):  # fmt: skip
                await page.goto(console.url)
                await expect(page.locator("#approver-field")).to_be_hidden()
                await sign_in(page, console.url, approver=None)
                await expect(page.locator("#who")).to_have_text("signed in as alice")
                await expect(page.locator("#live")).to_have_text("live")
                card = page.locator("article.approval", has_text=prompt)
                async with anyio.create_task_group() as tg:
                    done: list[HookResult] = []

                    async def emit() -> None:
                        body = EmitRequest(
                            data={"tool_name": "payments:create_transfer",
                                  "tool_input": {"amount": "1200.00"}},
                            session_id="s-secured",
                        )  # fmt: skip
                        msg = await agent_nc.request(
                            emit_service_subject(TOOL_PRE, "payments"), encode(body), timeout=30
                        )
                        reply = decode(msg.data, EmitReply)
                        assert reply.result is not None, reply.error
                        done.append(reply.result)

                    tg.start_soon(emit)
                    await card.locator("button", has_text="Allow once").click()
                note = page.locator("#decisions-note")
                await expect(note).to_contain_text("audit trail", timeout=12_000)
            await service.stop()
    assert done[0].action == "continue" and done[0].approved_by == "alice"


async def test_on_a_secured_server_the_handlers_view_counts_the_live_workers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`hookbus auth init` identities: the console, connected as approver alice, sees the
    worker's live replica (its liveness ping is within the approver's grants); the worker
    identity, restarted with another timeout while a replica is live, is refused (one live)
    and, once that one stopped, takes its declaration over (its own ping is within the
    worker's grants: its own service answers it)."""
    from hookbus.schemas import HandlerConflictError

    def gate(timeout_s: float, conn: NATS) -> HookWorker:
        w = HookWorker(conn)

        @w.handler(TOOL_PRE, name="console_gate", failure_policy="deny", timeout_s=timeout_s)
        async def console_gate(ev: str, data: dict[str, Any]) -> HookResult:
            return HookResult(action="continue")

        return w

    async def replicas(client: httpx.AsyncClient) -> list[int]:
        r = await client.get("/api/handlers")
        assert r.status_code == 200, r.text
        return [len(h["replicas"]) for h in r.json()["handlers"] if h["name"] == "console_gate"]

    async with secured_server(
        tmp_path / "auth", "--worker", f"gate:{TOOL_PRE}/console_gate", "--approver", "alice"
    ) as (server, connect_as):
        async with (
            ConsoleProcess(server.url, "--nkey", server.seed("approver", "alice"),
                           "--approver", "alice") as console,
            signed_in_client(console.url, approver="alice") as client,
        ):  # fmt: skip
            async with gate(5.0, await connect_as("worker", "gate")):
                assert await replicas(client) == [1]
                restarted = gate(9.0, await connect_as("worker", "gate"))
                with pytest.raises(HandlerConflictError, match=r"1 replica\(s\) of it live now"):
                    await restarted.start()
                await restarted.shutdown()
            assert await replicas(client) == [0]
            caplog.set_level("WARNING", logger="hookbus.workers")
            async with gate(9.0, await connect_as("worker", "gate")):
                assert "timeout_s: live 5.0, declared 9.0" in caplog.text
                assert "taking over handler console_gate" in caplog.text
                listed = (await client.get("/api/handlers")).json()["handlers"]
                mine = [h for h in listed if h["name"] == "console_gate"]
                assert [(h["timeout_s"], len(h["replicas"])) for h in mine] == [(9.0, 1)]


def test_the_cli_refuses_bad_options(nats_url: str) -> None:
    runner = CliRunner()
    env = {"HOOKBUS_CONSOLE_TOKEN": ""}
    cases = [
        (["console", "--url", nats_url], {}, "needs a token"),
        (["console", "--url", nats_url], env, "is empty"),
        (["console", "--url", nats_url, "--console-token", "t", "--approver", " a"], {},
         "surrounding spaces"),
        (["console", "--url", nats_url, "--console-token", "t", "--console-tls-key", "k"], {},
         "needs --console-tls-cert"),
    ]  # fmt: skip
    for argv, extra, message in cases:
        result = runner.invoke(cli, argv, env={"HOOKBUS_CONSOLE_TOKEN": None, **extra})
        assert result.exit_code == 2, (argv, result.output)
        assert message in result.output, (argv, result.output)
        assert "Traceback" not in result.output


async def _sse_events(lines: AsyncIterator[str]) -> AsyncIterator[tuple[str, Any]]:
    """(kind, data) of each server-sent event (comments and retry lines skipped)."""
    kind, data = "message", ""
    async for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data += line[6:]
        elif line == "" and data:
            yield kind, json.loads(data)
            kind, data = "message", ""
