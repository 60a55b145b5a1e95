"""`lvx serve` in a real browser: headless Chromium (Debian's /usr/bin/chromium) driven by
Playwright.

Loads the page, uploads a video, loads it, asks a question, waits for the streamed answer (the
model's greedy one) and its TTFT line, clicks a timestamp link to seek the player, and saves a
screenshot. CI installs Chromium; without it this test fails.
"""

from __future__ import annotations

import os

import pytest
from test_engine import PARAMS, QUESTIONS, _reference
from test_engine_speech import talking_video, tiny_whisper  # noqa: F401 - fixtures
from test_serve import start_server, stop_server
from timing import scaled

from lvx_app.engine.describe import printable
from lvx_ui.evidence_view import THUMB_WIDTH

pytest.importorskip("playwright.sync_api")  # a bare GPU image has no Playwright: skip there

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = int(scaled(120) * 1000)


@pytest.mark.slow
def test_browser_upload_ask_and_seek(tiny_checkpoints, short_video, tmp_path):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium (CI's "
            ".ci/run does)"
        )
    from playwright.sync_api import expect, sync_playwright

    expected = printable(_reference(tiny_checkpoints["g2"], short_video)[0]).strip()
    log = tmp_path / "serve.log"
    args = [
        "--gpus",
        "0",
        "--model",
        tiny_checkpoints["g2"],
        "--cache-dir",
        str(tmp_path / "cache"),
        "--max-new-tokens",
        str(PARAMS.max_new_tokens),
        "--allow-paths",
        str(tmp_path),
    ]
    proc, url = start_server(args, log)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(
                str(tmp_path / "profile"),
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport={"width": 1360, "height": 900},
            )
            try:
                page = browser.new_page()
                page.goto(url, timeout=TIMEOUT_MS)
                page.locator("#lvx-video input[type=file]").set_input_files(short_video)
                expect(page.locator("#lvx-video video")).to_be_attached(timeout=TIMEOUT_MS)
                page.locator("#lvx-load").click()
                status = page.locator("#lvx-status")
                expect(status).to_contain_text("10 frames at 1 fps", timeout=TIMEOUT_MS)
                expect(status).to_contain_text("peak RSS")  # memory per rank

                question = page.locator("#lvx-question textarea")
                question.fill(QUESTIONS[0])
                question.press("Enter")
                chat = page.locator("#lvx-chat")
                expect(chat).to_contain_text("tok/s", timeout=TIMEOUT_MS)
                expect(chat).to_contain_text(expected)
                expect(chat).to_contain_text(QUESTIONS[0])

                # Under the answer, its moments as thumbnails; a click seeks the player there.
                thumb = chat.locator("a[href*='lvx-seek-']:has(img)").first
                expect(thumb).to_be_visible(timeout=TIMEOUT_MS)
                shown = thumb.locator("img").evaluate("i => i.getBoundingClientRect().width")
                assert shown == THUMB_WIDTH, f"a thumbnail at its own size, not {shown} px wide"
                asked, box = chat.get_by_text(QUESTIONS[0]).bounding_box(), chat.bounding_box()
                assert asked["y"] >= box["y"], "the question stays in view above its answer"
                at = float(thumb.get_attribute("href").rsplit("-", 1)[1])
                player = page.locator("#lvx-video video")
                player.evaluate("(v, t) => { v.currentTime = t; }", 9.5 if at < 9 else 1.5)
                thumb.locator("img").click()
                expect(player).to_have_js_property("currentTime", at, timeout=10_000)

                # Times in the chat are links that seek the player (here in the question; answers
                # use the same).
                question.fill("what happens at 0:07?")
                page.locator("#lvx-send").click()
                expect(chat.get_by_text("tok/s")).to_have_count(2, timeout=TIMEOUT_MS)
                link = chat.get_by_role("link", name="0:07")
                expect(link).to_have_count(1)
                link.click()
                player = page.locator("#lvx-video video")
                expect(player).to_have_js_property("currentTime", 7, timeout=10_000)
                assert page.url.rstrip("/") == url.rstrip("/"), (
                    "a timestamp click must not navigate away"
                )

                page.screenshot(path=str(tmp_path / "ui.png"), full_page=True)
            finally:
                browser.close()
    finally:
        stop_server(proc, log)
    assert (tmp_path / "ui.png").stat().st_size > 10_000


# Each rank's figures on one line a cell, measured in the page: the cell's text makes one line box.
ONE_LINE_CELLS = """
root => [...root.querySelectorAll('th, td')].map(cell => {
  const range = document.createRange();
  range.selectNodeContents(cell);
  const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
  return [cell.innerText, lines.size, cell.getBoundingClientRect().width];
})
"""


@pytest.mark.slow
def test_the_page_at_desktop_and_phone_widths(
    tiny_checkpoints,
    tiny_whisper,  # noqa: F811 - the fixture
    talking_video,  # noqa: F811 - the fixture
    tmp_path,
):
    """At a desktop's and a phone's width, a video picked from the allowed folders loads on 2
    ranks; each rank's figures keep every word whole (one line a cell), the load's notes stay
    after an answer, and the transcript's top is in the first screen, above the chat when the
    columns stack."""
    import shutil

    from playwright.sync_api import sync_playwright

    folder = tmp_path / "videos"
    folder.mkdir()
    talk = shutil.copy(talking_video, folder / "talk.mp4")
    log = tmp_path / "serve.log"
    args = [
        *("--gpus", "0", "--ranks", "2", "--model", tiny_checkpoints["g2"]),
        *("--cache-dir", str(tmp_path / "cache"), "--allow-paths", str(folder)),
        *("--max-new-tokens", "4", "--speech-model", tiny_whisper),
    ]
    proc, url = start_server(args, log)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                for width, height in ((1280, 900), (390, 844)):
                    page = browser.new_page(viewport={"width": width, "height": height})
                    _load_ask_and_measure(page, url, folder, talk, height)
                    page.screenshot(path=str(tmp_path / f"page-{width}.png"), full_page=True)
                    page.close()
            finally:
                browser.close()
    finally:
        stop_server(proc, log)


def _load_ask_and_measure(page, url: str, folder, talk, height: int) -> None:
    """Pick and load `talk`, ask a question, and check the page's cells and where the transcript
    starts, at the page's width."""
    from playwright.sync_api import expect

    page.goto(url, timeout=TIMEOUT_MS)
    path_box = page.locator("#lvx-path textarea, #lvx-path input").first
    assert path_box.get_attribute("placeholder") == f"e.g. {folder / 'movie.mp4'}"
    page.locator("#lvx-pick input").click()
    page.get_by_role("option", name=str(talk)).click()
    expect(path_box).to_have_value(str(talk), timeout=TIMEOUT_MS)
    page.locator("#lvx-load").click()
    status = page.locator("#lvx-status")
    expect(status).to_contain_text("frames at", timeout=TIMEOUT_MS)
    expect(status.locator("table td").first).to_be_visible()
    transcript = page.locator("#lvx-transcript")
    expect(transcript).to_contain_text("Transcript", timeout=TIMEOUT_MS)

    question = page.locator("#lvx-question textarea")
    question.fill(QUESTIONS[0])
    question.press("Enter")
    chat = page.locator("#lvx-chat")
    expect(chat).to_contain_text("tok/s", timeout=TIMEOUT_MS)
    expect(status).to_contain_text("kv mode", timeout=TIMEOUT_MS)  # the load's notes
    cells = status.locator("table").evaluate(ONE_LINE_CELLS)
    assert len(cells) >= 3 * 2, cells  # a header and a row per rank
    broken = [(text, lines, w) for text, lines, w in cells if text and lines != 1]
    assert not broken, f"cells broken over lines: {broken}"

    page.evaluate("window.scrollTo(0, 0)")
    top = transcript.bounding_box()["y"]
    assert top < height, f"the transcript starts at {top} px, below the first screen"
    if page.viewport_size["width"] < 600:  # the columns stack: the transcript comes before the chat
        assert top < chat.bounding_box()["y"]
