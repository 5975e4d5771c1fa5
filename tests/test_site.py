"""The course as a website (issue 31): ``./course site`` builds it offline with warnings as errors, and every
internal link, anchor, image, script and stylesheet of the built site resolves to a file of the site.

The build (``docs/site.py``: Sphinx + MyST-NB, execution off) writes ``build/site/``; it is shared with
``tests/test_site_browser.py`` through :func:`built_site` (one build per test run, under a lock, so two pytest
workers never write the folder at once). Skipped, saying why, only where the ``docs`` extra is missing.
"""

from __future__ import annotations

import ast
import fcntl
import importlib.util
import json
import os
import re
import subprocess
import sys
from html import unescape
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "build" / "site"
_BUILT: dict[str, str] = {}


def built_site() -> Path:
    """Build the site once per test run (incremental: unchanged pages are not rebuilt); fail on any warning."""
    if importlib.util.find_spec("sphinx") is None or importlib.util.find_spec("myst_nb") is None:
        pytest.skip("the docs extra is missing: pip install -e '.[docs]' (./course test installs it)")
    if "log" not in _BUILT:
        (ROOT / "build").mkdir(exist_ok=True)
        # One build per test run, shared by the pytest workers: a second build while another worker reads the
        # site would delete its source pages (_modules/) under it, so the worker that builds leaves the run's id
        # beside the site and the others read that build.
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid-{os.getpid()}")
        marker = ROOT / "build" / "site.built-by"
        with open(ROOT / "build" / "site.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if marker.exists() and marker.read_text() == run_id and (SITE / "index.html").exists():
                _BUILT["log"] = "built by another worker of this run"
                return SITE
            marker.unlink(missing_ok=True)
            run = subprocess.run([sys.executable, str(ROOT / "docs" / "site.py")], cwd=ROOT, capture_output=True,
                                 text=True, timeout=900)
            if run.returncode != 0:
                raise AssertionError(f"./course site failed (warnings are errors):\n{run.stdout[-4000:]}\n"
                                     f"{run.stderr[-8000:]}")
            marker.write_text(run_id)
        _BUILT["log"] = run.stdout
    return SITE


def text_of(html: str) -> str:
    """A page's text: tags out, entities decoded, whitespace runs as one space."""
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html)).split())


def site_module():
    spec = importlib.util.spec_from_file_location("course_site", ROOT / "docs" / "site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Page(HTMLParser):
    """The links (a, link), sources (img, script) and ids of one HTML page."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []  # (tag, url)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        for attr in ("href", "src"):
            if attrs.get(attr) is not None and tag in ("a", "link", "img", "script", "source", "iframe"):
                self.links.append((tag, attrs[attr]))


@pytest.fixture(scope="module")
def site() -> Path:
    return built_site()


@pytest.fixture(scope="module")
def pages(site) -> dict[Path, Page]:
    parsed = {}
    # read under the build's lock (shared): the browser tests' worker may rebuild the same folder meanwhile
    with open(ROOT / "build" / "site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        for path in site.rglob("*.html"):
            if path.relative_to(site).parts[0] == "_static":  # the theme's template fragments, not pages
                continue
            page = Page()
            page.feed(path.read_text(encoding="utf-8"))
            parsed[path] = page
    return parsed


def test_every_internal_link_image_and_script_resolves(site, pages):
    broken, external = [], []
    for path, page in pages.items():
        for tag, url in page.links:
            parts = urlsplit(url)
            if parts.scheme in ("http", "https", "mailto") or url.startswith("//"):
                if tag != "a":  # an image, script or stylesheet from the network: the site must work offline
                    external.append(f"{path.relative_to(site)}: <{tag}> {url}")
                continue
            if parts.scheme or url.startswith("javascript:") or (url == "" and tag == "a"):
                continue
            target = path if not parts.path else (path.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or site.resolve() not in target.resolve().parents:
                broken.append(f"{path.relative_to(site)}: <{tag}> {url} (no file)")
            elif parts.fragment and target.suffix == ".html" and tag == "a":
                ids = pages[target].ids if target in pages else set()
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: <a> {url} (no such anchor)")
    assert not external, "pages load from the network:\n" + "\n".join(external[:30])
    assert not broken, f"{len(broken)} broken internal links or images:\n" + "\n".join(broken[:40])
    n_images = sum(tag == "img" for page in pages.values() for tag, _ in page.links)
    assert n_images > 20, f"only {n_images} images in the whole site: are the committed figures rendered?"


def test_every_chapter_has_its_pages_and_the_home_page_maps_them(site):
    home = (site / "index.html").read_text(encoding="utf-8")
    lessons = sorted(p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert len(lessons) >= 13
    for i, lesson in enumerate(lessons):
        page = site / "notebooks" / f"{lesson.stem}.html"
        assert page.is_file(), f"no page for {lesson.name}"
        assert f'href="notebooks/{lesson.stem}.html"' in home, f"the chapter map does not link {lesson.name}"
        html = page.read_text(encoding="utf-8")
        text = text_of(html)
        assert f"notebooks/{lesson.stem}.ipynb" in text, f"{page.name} does not say which notebook it is"
        assert "./course lab" in text and "./course test" in text, f"{page.name} does not say how to run it"
        if (ROOT / "exercises" / lesson.name).exists():
            assert f'href="../exercises/{lesson.stem}.html' in html, f"{page.name} does not link its exercises"
            assert (site / "exercises" / f"{lesson.stem}.html").is_file()
        if i + 1 < len(lessons):
            assert f'href="{lessons[i + 1].stem}.html' in html, f"{page.name} does not link the next lesson"
        if (ROOT / "solutions" / lesson.name).exists():
            assert (site / "solutions" / f"{lesson.stem}.html").is_file()
    assert (site / "solutions" / "index.html").is_file() and (site / "design.html").is_file()


def test_lessons_keep_their_committed_outputs_and_math(site):
    """Figures and outputs are the committed ones (execution is off), and math is left for the local MathJax."""
    for lesson in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(lesson.read_text(encoding="utf-8"))
        pngs = sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []))
        html = (site / "notebooks" / f"{lesson.stem}.html").read_text(encoding="utf-8")
        assert html.count("<img") >= pngs, f"{lesson.name}: {pngs} committed figures, fewer <img> on its page"
        for alt in re.findall(r'<img alt="([^"]*)"', html):  # words for a screen reader, not the hashed file name
            assert alt.startswith(("Figure: ", "A figure of")) and not alt.endswith(".png"), (lesson.name, alt)
        has_math = any("$" in "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
        if has_math:
            assert "math notranslate" in html, f"{lesson.name}: its $...$ math is not marked up as math"
        assert "_static/mathjax/tex-chtml.js" in html
    assert (site / "_static" / "mathjax" / "tex-chtml.js").is_file()
    assert any((site / "_static" / "mathjax" / "output" / "chtml" / "fonts").rglob("*.woff")), "no MathJax fonts"


def test_api_reference_documents_every_module_and_every_exported_name(site):
    api = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    modules = [p.stem for p in (ROOT / "attncourse").glob("*.py")
               if not p.stem.startswith("_") and p.stem not in ("grade", "nbtools", "release")]
    missing = [m for m in modules if f'id="module-attncourse.{m}"' not in api]
    assert not missing, f"modules with no API page: {missing}"
    init = ast.parse((ROOT / "attncourse" / "__init__.py").read_text(encoding="utf-8"))
    index = text_of((site / "api" / "index.html").read_text(encoding="utf-8")).split()
    for node in init.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                name = alias.name if node.module else f"attncourse.{alias.name}"
                assert name in index, f"the API index does not list {name}"
    assert "viewcode-link" in api, "no source links in the API reference"
    assert api.count('class="sig sig-object py"') > 100


def test_without_solutions_nothing_links_or_leads_to_them(tmp_path, monkeypatch):
    site = site_module()
    monkeypatch.setattr(site, "SRC", tmp_path / "src")
    monkeypatch.setattr(site, "OUT", tmp_path / "out")
    site.stage(solutions=True)
    assert list((tmp_path / "src" / "solutions").glob("*.ipynb"))
    site.stage(solutions=False)
    assert not (tmp_path / "src" / "solutions").exists() or not any((tmp_path / "src" / "solutions").iterdir())
    leaks = [str(p.relative_to(tmp_path)) for p in (tmp_path / "src").rglob("*") if p.is_file()
             and p.suffix in (".md", ".ipynb") and re.search(r"\]\((\.\./)?solutions/", p.read_text("utf-8"))]
    assert not leaks, f"links into solutions/ left in a build without them: {leaks}"
    assert "solutions/index" not in (tmp_path / "src" / "index.md").read_text(encoding="utf-8")


def test_chapters_are_found_by_globbing(tmp_path, monkeypatch):
    """A chapter added as notebooks/NN_x.ipynb (chapters 13 and 14) gets its pages without an edit to docs/."""
    site = site_module()
    root = tmp_path / "course"
    for folder in ("notebooks", "exercises"):
        (root / folder).mkdir(parents=True)
    nb = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# 42 · Attention at the end\n", "\n",
                                                                         "Text."]}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    for folder in ("notebooks", "exercises"):
        (root / folder / "42_the_end.ipynb").write_text(json.dumps(nb))
    monkeypatch.setattr(site, "ROOT", root)
    chs = site.chapters()
    assert [(c["nn"], c["title"], c["exercises"], c["solutions"]) for c in chs] == [
        ("42", "Attention at the end", True, False)]
    box = site.lesson_box(chs[0], None)
    assert "notebooks/42_the_end.ipynb" in box and "../exercises/42_the_end.ipynb" in box
