"""The course website in a real browser (issue 31): the built site (``./course site``) served over a local HTTP
server on 127.0.0.1, and the system's Chromium driven through Playwright's ``executable_path`` (Playwright never
downloads a browser; see tests/test_browser.py). Every request that leaves 127.0.0.1 is refused, so the site is
checked offline. On chapter 03's page and on the API reference:

1. math typeset by the site's own MathJax (``mjx-container`` elements, no raw ``$`` left in the text);
2. every figure loaded (``naturalWidth > 0``);
3. the sidebar navigates from chapter 03 to chapter 04;
4. the search page finds "GQA" (chapter 05's pages among the results).

Screenshots go to ``browser-test-screenshots/site/`` (beside the JupyterLab test's, gitignored, uploaded by CI).
Skipped, saying why, only where no Chromium/Chrome is found, playwright or the docs extra is missing.
"""

from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path

import pytest

from test_browser import find_browser  # noqa: E402 (tests/ is on sys.path under pytest)
from test_site import built_site  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "browser-test-screenshots" / "site"
LESSON = "notebooks/03_scaled_dot_product_attention.html"
API = "api/ch03.html"

# Text of the page's prose with code, outputs and typeset math taken out: what is left must hold no `$`.
PROSE = """() => {
  const article = document.querySelector('article.bd-article').cloneNode(true);
  article.querySelectorAll('div.cell_output, div.highlight, pre, code, mjx-container, script, .sig')
    .forEach(e => e.remove());
  return article.innerText;
}"""
IMAGES = """() => Array.from(document.querySelectorAll('article.bd-article img')).map(
  i => ({src: i.getAttribute('src'), complete: i.complete, width: i.naturalWidth}))"""


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002
        pass


@pytest.fixture(scope="module")
def served():
    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium or Chrome on PATH: install Debian's `chromium` (apt-get install chromium; .ci/run "
                    "does) or set CHROMIUM=/path/to/browser")
    pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[browser]'")
    site = built_site()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", browser
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def page(served):
    from playwright.sync_api import sync_playwright

    base, browser = served
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()
    offsite: list[str] = []
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=browser, args=["--no-sandbox"])
        context = chromium.new_context(viewport={"width": 1400, "height": 1000})

        def only_local(route):
            if route.request.url.startswith(base):
                route.continue_()
            else:
                offsite.append(route.request.url)
                route.abort()

        context.route("**/*", only_local)
        pg = context.new_page()
        pg.base = base
        pg.offsite = offsite
        try:
            yield pg
        finally:
            chromium.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def open_typeset(page, path: str) -> None:
    page.goto(f"{page.base}/{path}")
    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=60_000)
    page.evaluate("() => MathJax.startup.promise")
    page.wait_for_load_state("load")


@pytest.mark.parametrize("path", [LESSON, API], ids=["chapter-03", "api-reference"])
def test_math_typeset_and_figures_loaded(page, path):
    open_typeset(page, path)
    name = "01-chapter-03" if path == LESSON else "03-api-reference"
    try:
        typeset = page.locator("article.bd-article mjx-container").count()
        assert typeset >= (20 if path == LESSON else 1), (
            f"{path}: only {typeset} typeset formulas (is MathJax loading from _static/mathjax?)")
        prose = page.evaluate(PROSE)
        dollars = [line for line in prose.splitlines() if "$" in line]
        assert not dollars, f"{path}: raw $ left in the text (math not typeset): {dollars[:3]}"
        for img in page.locator("article.bd-article img").all():
            img.scroll_into_view_if_needed()
        page.wait_for_function("() => Array.from(document.querySelectorAll('article.bd-article img'))"
                               ".every(i => i.complete)", timeout=30_000)
        images = page.evaluate(IMAGES)
        if path == LESSON:
            assert len(images) >= 5, f"{path}: {len(images)} figures"
        broken = [i["src"] for i in images if i["width"] == 0]
        assert not broken, f"{path}: figures that did not load: {broken}"
        page.evaluate("() => window.scrollTo(0, 0)")
        if path == LESSON:  # a figure in view for the screenshot
            page.locator("article.bd-article img").first.scroll_into_view_if_needed()
        assert not page.offsite, f"requests off the local server: {page.offsite[:5]}"
    finally:
        shot(page, name)
    if path == LESSON:
        page.evaluate("() => window.scrollTo(0, 0)")
        shot(page, "00-chapter-03-top")


def test_sidebar_navigates_to_chapter_04(page):
    page.goto(f"{page.base}/{LESSON}")
    link = page.locator("nav.bd-links a[href*='04_multi_head_attention']").first
    link.click()
    page.wait_for_url("**/notebooks/04_multi_head_attention.html")
    heading = page.locator("article.bd-article h1").first.inner_text()
    shot(page, "02-sidebar-to-chapter-04")
    assert heading.startswith("04"), f"the sidebar link led to {page.url} titled {heading!r}"


def test_search_finds_gqa(page):
    page.goto(f"{page.base}/search.html?q=GQA")
    results = page.locator("#search-results ul.search li")
    results.first.wait_for(timeout=60_000)
    links = [a.get_attribute("href") for a in page.locator("#search-results ul.search li a").all()]
    shot(page, "04-search-gqa")
    assert any("05_mqa_gqa" in (h or "") for h in links), f"searching GQA does not find chapter 05: {links[:10]}"
    assert not page.offsite, f"requests off the local server: {page.offsite[:5]}"
