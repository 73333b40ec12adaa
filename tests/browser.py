"""Headless Chromium (Debian's `chromium`) driven by Playwright, for the playground's tests: the page
run as a user runs it, against a live app. scripts/test.sh installs the browser where it is missing."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

TIMEOUT_MS = 180_000  # a whole answer of the Qwen pair on two cores, with room
# screenshots a run leaves behind (CI keeps the folder); the docs show a copy of one
ARTIFACTS = Path(os.environ.get("TANDEM_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))


@contextlib.contextmanager
def browser_page():
    """A fresh page (its own context: no storage from another test) in headless Chromium."""
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    assert executable, "Debian's chromium is not installed: scripts/test.sh installs it (apt-get install chromium)"
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def fill(page: Page, **fields) -> None:
    """Sets the page's request fields (prompt, temperature, max_tokens, ...; mode and model are selects)."""
    for name, value in fields.items():
        if name in ("mode", "model"):
            page.select_option(f"#{name}", str(value))
        else:
            page.fill(f"#{name.replace('api_key', 'api-key')}", str(value))


def run(page: Page, button: str = "send") -> None:
    """Clicks Send (or Compare) and waits until the page is ready for the next call."""
    page.click(f"#{button}")  # its handler disables Send before it returns
    # selectors, not wait_for_function: the page's CSP (no eval) refuses Playwright's polling code
    page.wait_for_selector("#send:enabled")
    page.wait_for_selector("#cancel:disabled")


def wait_text(page: Page, selector: str, text: str) -> None:
    """Until the element's text contains `text`."""
    page.locator(selector, has_text=text).wait_for()


def answer(page: Page, pane: str = "spec") -> str:
    return page.text_content(f"#answer-{pane}")


def spans(page: Page, pane: str = "spec", kind: str = "draft") -> int:
    return page.locator(f"#answer-{pane} .tok.{kind}").count()


def sse_events(text: str) -> list[dict]:
    """A streamed answer's events (the `data:` lines before [DONE])."""
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]
