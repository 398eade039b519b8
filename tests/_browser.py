"""The browser the console tests drive: Debian's headless Chromium through Playwright.

Playwright's own browsers are never downloaded (``executable_path``); Chromium is
installed with apt-get when it is missing (CI runs as root). Import the fixtures into a
test module to use them (``from _browser import browser_fixture, chromium_fixture,
page_fixture``: fixtures ``browser``, ``chromium``, ``page``); screenshots
go to ``test-artifacts/<group>/<test name>/`` (gitignored, kept after the run).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from _debian import apt_install
from playwright.async_api import Browser, Page, async_playwright, expect

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"


def install_chromium() -> str:
    """Debian's chromium, installed with apt-get if missing; its path."""
    return apt_install("chromium", binary="chromium")


@pytest.fixture(scope="session", name="chromium")
def chromium_fixture() -> str:
    return install_chromium()


@pytest.fixture(name="browser")
async def browser_fixture(chromium: str) -> AsyncIterator[Browser]:
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium, headless=True)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture(name="page")
async def page_fixture(browser: Browser) -> AsyncIterator[Page]:
    """A 1280x1000 page (10 s default timeout); the test fails on any JavaScript error."""
    context = await browser.new_context(viewport={"width": 1280, "height": 1000})
    p = await context.new_page()
    p.set_default_timeout(10_000)
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield p
    finally:
        await context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


async def sign_in(page: Page, url: str, token: str, approver: str | None = "alice") -> None:
    """Open the console at `url` and sign in with `token` as `approver` (None: the
    console binds the approver, the field is hidden)."""
    await page.goto(url)
    await expect(page.locator("#login")).to_be_visible()
    await page.fill("#token", token)
    if approver is not None:
        await page.fill("#approver", approver)
    await page.click("#login button[type=submit]")


@contextlib.contextmanager
def screenshot_folder(group: str, test_name: str) -> Iterator[Path]:
    """``test-artifacts/<group>/<test_name>/``, emptied first; each screenshot's path is
    printed at the end."""
    folder = ARTIFACTS / group / test_name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    yield folder
    for shot in sorted(folder.iterdir()):
        print(f"{group} screenshot: {shot}")
