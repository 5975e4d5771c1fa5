"""The learner's JupyterLab, driven in a real browser the way a learner uses it (issue 14).

A copy of the course (the ``course`` script, notebooks/, exercises/, solutions/) is served by ``./course lab`` itself
on 127.0.0.1 (``SKIP_SETUP=1``: the environment running the tests, with fresh Jupyter settings and workspaces), and
the system's Chromium (or Chrome) is driven through Playwright's ``executable_path``; Playwright never downloads a
browser. One test walks through the steps, each leaving a screenshot in ``browser-test-screenshots/`` (gitignored,
uploaded by CI) and its time in ``steps.txt`` there:

1. ``/`` opens chapter 00 from the learner's own copies (``my-work/notebooks/``), not marked as modified; the server
   lists notebooks/, exercises/, solutions/ and my-work/, and a terminal starts in the course root;
2. chapter 00's link to a lesson opens it; Restart and Run All: every cell runs (counts 1..N), no error output,
   figures shown, math typeset by MathJax, progress bars rendered as widgets;
3. the lesson's link to its exercise notebook opens the learner's copy, whose tab title differs from the lesson's;
4. Restart and Run All on the untouched exercises: the first check says "not attempted yet" in two lines, as a
   note (stdout), and no cell shows an error or a traceback, yet the notebook runs to its last cell;
5. a wrong answer typed into the first exercise cell (every value 1.5 times too large): its check names the case,
   what differs, and a hint naming that mistake, without a traceback; then the right answer and the success line;
6. the check cell cannot be edited or deleted;
7. the learner saves: their answer is in my-work/, the course's tracked notebooks are byte for byte as committed
   (so `./course test` reads what was committed, and the exercises are still in sync with the solutions), and a
   course update (a solution changed, exercises regenerated, ``./course lab`` again) keeps the answer while an
   untouched copy takes the new version.

Skipped, saying why, only where no Chromium/Chrome is found (``.ci/run`` installs Debian's ``chromium``) or the
``browser`` extra (playwright) is missing. ``CHROMIUM=/path`` picks a browser; ``BROWSER_TEST_LESSON=NN`` a lesson.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

from attncourse.classroom import checks, nbtools, workspace

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "browser-test-screenshots"
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in the current tab
WIDGET = "application/vnd.jupyter.widget-view+json"
SETTINGS = {  # no news or update pop-ups over the page; every cell in the DOM (no virtual scrolling)
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


def find_browser() -> str | None:
    names = [os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
    return next((shutil.which(n) for n in names if n and shutil.which(n)), None)


def choose_lesson() -> str:
    """The first lesson whose stored outputs have a progress widget and a figure, and whose text has math."""
    wanted = os.environ.get("BROWSER_TEST_LESSON", "")
    for path in sorted((ROOT / "notebooks").glob(f"{wanted}*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        data = [o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        if (any(WIDGET in d for d in data) and any("image/png" in d for d in data)
                and any("$" in c.source for c in nb.cells if c.cell_type == "markdown")):
            return path.stem
    raise AssertionError("no lesson has stored progress widgets, figures and math to check in the browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """`./course lab` serving a copy of the course; yields (base url, token, copy's root)."""
    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium or Chrome on PATH: install Debian's `chromium` (apt-get install chromium; .ci/run "
                    "does) or set CHROMIUM=/path/to/browser")
    pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[browser]'")
    tmp = tmp_path_factory.mktemp("lab")
    course = tmp / "course-copy"
    course.mkdir()
    shutil.copy2(ROOT / "course", course / "course")
    for folder in ("notebooks", "exercises", "solutions"):
        shutil.copytree(ROOT / folder, course / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    for name, values in SETTINGS.items():
        path = tmp / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "TRITON_INTERPRET"))}
    env.update(SKIP_SETUP="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    log = (tmp / "lab.log").open("w")
    server = subprocess.Popen(
        ["bash", str(course / "course"), "lab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         f"--IdentityProvider.token={token}"], cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"./course lab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token, course, browser
    finally:
        server.send_signal(signal.SIGINT)  # Jupyter's own shutdown stops the kernels it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


class Steps:
    """Times each step and saves a screenshot after it (or when it fails)."""

    def __init__(self, page):
        self.page, self.n, self.times = page, 0, []
        SHOTS.mkdir(exist_ok=True)
        for old in SHOTS.glob("*.png"):
            old.unlink()

    @contextmanager
    def __call__(self, name: str):
        self.n += 1
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            self.page.screenshot(path=str(SHOTS / f"{self.n:02d}-{name}-FAILED.png"))
            self.times.append((name, time.perf_counter() - start, "FAILED"))
            raise
        finally:
            (SHOTS / "steps.txt").write_text("".join(f"{i:02d} {n:<28} {t:6.1f} s {s}\n"
                                                     for i, (n, t, s) in enumerate(self.times, 1)))
        self.page.screenshot(path=str(SHOTS / f"{self.n:02d}-{name}.png"))
        self.times.append((name, time.perf_counter() - start, "ok"))
        (SHOTS / "steps.txt").write_text("".join(f"{i:02d} {n:<28} {t:6.1f} s {s}\n"
                                                 for i, (n, t, s) in enumerate(self.times, 1)))


# ----------------------------------------------------------------------------- JupyterLab, as a learner sees it


def cells(page):
    return page.locator(f"{PANEL} .jp-Notebook .jp-Cell")


def prompts(page) -> list[str]:
    return page.eval_on_selector_all(f"{PANEL} .jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.innerText)")


def open_tab(page, name: str, timeout: float = 60) -> None:
    """Wait for `name` to be the current tab, its cells shown and its kernel idle; it must not be modified."""
    page.wait_for_selector(f".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current:has-text('{name}')",
                           timeout=timeout * 1000)
    page.wait_for_selector(f"{PANEL} .jp-Cell", timeout=timeout * 1000)
    page.wait_for_selector(f"{PANEL} .jp-Notebook-ExecutionIndicator[data-status='idle']", state="attached",
                           timeout=timeout * 1000)
    page.wait_for_timeout(1500)  # a kernel that renames itself marks the notebook modified about now
    tab = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")
    assert "jp-mod-dirty" not in (tab.get_attribute("class") or ""), f"{name} opened marked as modified"


def restart_and_run_all(page, timeout: float, while_running=None) -> list[str]:
    """Kernel > Restart Kernel and Run All Cells; wait for every code cell to have run; return the prompts.
    `while_running(page)` is called once the cells are queued."""
    page.locator(f"{PANEL} [data-command='notebook:restart-run-all']").click()
    page.locator(".jp-Dialog .jp-mod-accept").click()
    page.wait_for_function(  # queued: the prompts still show the stored counts until then
        "panel => [...document.querySelectorAll(panel + ' .jp-CodeCell .jp-InputPrompt')].pop().innerText.includes('*')",
        arg=PANEL, timeout=60_000)
    if while_running is not None:
        while_running(page)
    page.wait_for_function(
        """panel => { const p = [...document.querySelectorAll(panel + ' .jp-CodeCell .jp-InputPrompt')]
                        .map(e => e.innerText);
                      return p.length && /\\d/.test(p[p.length - 1]) && !p.some(x => x.includes('*')); }""",
        arg=PANEL, timeout=timeout * 1000)
    return prompts(page)


def run_cell(page, index: int, timeout: float = 60) -> str:
    """Select cell `index`, run it (Ctrl+Enter) and return its output text once its prompt shows a new count."""
    cell = cells(page).nth(index)
    before = cell.locator(".jp-InputPrompt").inner_text()
    cell.locator(".jp-InputPrompt").click()  # selects the cell in command mode
    page.keyboard.press("Control+Enter")
    page.wait_for_function(
        """([panel, i, before]) => { const c = document.querySelectorAll(panel + ' .jp-Notebook .jp-Cell')[i];
                                     const p = c.querySelector('.jp-InputPrompt').innerText;
                                     return /\\d/.test(p) && p !== before; }""",
        arg=[PANEL, index, before], timeout=timeout * 1000)
    return output_text(page, index)


def output_text(page, index: int) -> str:
    area = cells(page).nth(index).locator(".jp-OutputArea")
    return area.inner_text().strip() if area.count() else ""


def type_into(page, index: int, source: str) -> None:
    """Replace cell `index`'s text as a learner would: click into it, select all, type."""
    cells(page).nth(index).locator(".cm-content").click()
    page.keyboard.press("Control+a")
    page.keyboard.insert_text(source)
    page.keyboard.press("Escape")


def editor_text(page, index: int) -> str:
    return cells(page).nth(index).locator(".cm-content").inner_text()


def cell_source(path: Path, index: int) -> str:
    return nbformat.read(path, as_version=4).cells[index].source


def no_traceback(text: str) -> bool:
    return not re.search(r"Traceback|File \"|site-packages|attncourse/classroom|^-{20,}", text, re.M)


def first_exercise(exercise_nb: Path, solution_nb: Path) -> tuple[checks.Exercise, int, str]:
    """The first exercise asking for a function: (exercise, index of its answer cell, the solution's source)."""
    nb = nbformat.read(exercise_nb, as_version=4)
    for index, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and meta.get("solution"):
            ex = checks.get(meta["grade_id"].removesuffix("-answer"))
            if ex.kind == "function" and nbtools.is_check_cell(nb.cells[index + 1]):
                break
    else:
        raise AssertionError(f"{exercise_nb.name} has no function exercise")
    solution = next(c for c in nbformat.read(solution_nb, as_version=4).cells
                    if c.metadata.get("nbgrader", {}).get("grade_id") == meta["grade_id"])
    right = "\n".join(line for line in solution.source.split("\n")
                      if line.strip() not in (nbtools.BEGIN_SOLUTION, nbtools.END_SOLUTION))
    return ex, index, right


def wrong_version(right: str, target: str) -> str:
    """The right answer with a mistake a learner could make: every value returned is 1.5 times too large."""
    return (f"{right}\n\n\n_right = {target}\n\n\ndef {target}(*args, **kwargs):\n    out = _right(*args, **kwargs)\n"
            "    return tuple(o * 1.5 for o in out) if isinstance(out, tuple) else out * 1.5\n")


def terminal_cwd(page, base: str, token: str) -> str:
    """What `pwd` prints in a new JupyterLab terminal (the websocket JupyterLab's terminal panel uses)."""
    request = urllib.request.Request(f"{base}/api/terminals", method="POST", data=b"",
                                     headers={"Authorization": f"token {token}"})
    name = json.load(urllib.request.urlopen(request, timeout=30))["name"]
    ws = f"{base.replace('http', 'ws')}/terminals/websocket/{name}?token={token}"
    out = page.evaluate("""url => new Promise(resolve => {
        const ws = new WebSocket(url); let out = '';
        ws.onopen = () => ws.send(JSON.stringify(['stdin', 'echo CWD=$(pwd)\\r']));
        ws.onmessage = e => { const m = JSON.parse(e.data); if (m[0] === 'stdout') out += m[1];
                              if (/CWD=\\//.test(out)) { ws.close(); resolve(out); } };
        setTimeout(() => { ws.close(); resolve(out); }, 20000); })""", ws)
    urllib.request.urlopen(urllib.request.Request(f"{base}/api/terminals/{name}", method="DELETE",
                                                  headers={"Authorization": f"token {token}"}), timeout=30)
    found = re.search(r"CWD=(/\S*)", out)
    return found.group(1) if found else out


# ----------------------------------------------------------------------------- the walk-through


def test_learner_walkthrough(lab):
    from playwright.sync_api import sync_playwright

    base, token, course, browser = lab
    lesson = choose_lesson()
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=browser, args=["--no-sandbox"])
        try:
            page = chromium.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            walk(page, Steps(page), base, token, course, lesson)
        finally:
            chromium.close()


def walk(page, step, base, token, course, lesson):
    tracked = {p: p.read_bytes() for folder in ("notebooks", "exercises", "solutions")
               for p in sorted((course / folder).glob("*.ipynb"))}
    with step("chapter-00-from-root"):
        page.goto(f"{base}/?token={token}")
        assert page.url.endswith("/lab/tree/my-work/notebooks/00_start_here.ipynb"), page.url
        open_tab(page, "00_start_here.ipynb", timeout=120)
        listing = json.load(urllib.request.urlopen(f"{base}/api/contents?token={token}", timeout=30))
        assert {"notebooks", "exercises", "solutions", "my-work"} <= {item["name"] for item in listing["content"]}
        assert terminal_cwd(page, base, token) == str(course.resolve()), "a terminal starts in the course root"

    with step("lesson-from-chapter-00"):
        link = page.locator(f"{PANEL} .jp-RenderedMarkdown a[href*='/notebooks/{lesson}.ipynb']").first
        link.scroll_into_view_if_needed()
        link.click()
        open_tab(page, f"{lesson}.ipynb")

    def progress_bar_shown(page):  # tqdm.auto draws an ipywidgets bar (some remove themselves when finished)
        bar = page.locator(f"{PANEL} .jp-OutputArea .widget-hprogress").first
        bar.wait_for(timeout=180_000)
        bar.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"{step.n:02d}-lesson-progress-widget.png"))

    with step("lesson-restart-run-all"):
        counts = restart_and_run_all(page, timeout=240, while_running=progress_bar_shown)
        assert counts == [f"[{i}]:" for i in range(1, len(counts) + 1)], f"Run All stopped: prompts {counts}"
        outputs = page.eval_on_selector_all(f"{PANEL} .jp-OutputArea-output", "els => els.map(e => e.innerText)")
        errors = [text[:300] for text in outputs if not no_traceback(text)]
        assert not errors, f"error output in {lesson}: {errors}"
        assert page.eval_on_selector_all(f"{PANEL} .jp-RenderedImage img", "els => els.filter(e => e.naturalWidth > 0)"
                                         ".length") > 0, "no figure shown"
        assert page.locator(f"{PANEL} .jp-RenderedMarkdown mjx-container").count() > 0, "no math typeset"
        assert not any("Loading widget" in text or "HBox(children" in text for text in outputs)

    mine = workspace.work_name("exercises", f"{lesson}.ipynb")
    with step("exercises-from-lesson"):
        link = page.locator(f"{PANEL} .jp-RenderedMarkdown a[href*='/exercises/{mine}']").first
        link.scroll_into_view_if_needed()
        link.click()
        open_tab(page, mine)
        assert "/lab/tree/my-work/exercises/" in page.url, page.url
        titles = page.eval_on_selector_all(".lm-DockPanel-tabBar .lm-TabBar-tab .lm-TabBar-tabLabel",
                                           "els => els.map(e => e.innerText)")
        assert len(set(titles)) == len(titles), f"two tabs with the same title: {titles}"

    ex, answer, right = first_exercise(course / "my-work" / "exercises" / mine, course / "solutions" / f"{lesson}.ipynb")
    check = answer + 1
    with step("exercises-run-all-untouched"):
        counts = restart_and_run_all(page, timeout=180)
        assert all(re.fullmatch(r"\[\d+\]:", c) for c in counts), f"Run All stopped: prompts {counts}"
        lines = output_text(page, check).splitlines()
        assert lines[0] == f"exercise {ex.id}: not attempted yet; write your answer in the cell above", lines
        assert len(lines) == 2 and no_traceback("\n".join(lines)), lines
        red = page.eval_on_selector_all(  # errors and stderr: JupyterLab's red; a note is stdout
            f"{PANEL} .jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
            "els => els.map(e => e.innerText)")
        assert not [t for t in red if re.search(r"Error|Traceback|not attempted", t)], f"errors shown: {red[:3]}"
        outputs = page.eval_on_selector_all(f"{PANEL} .jp-OutputArea-output", "els => els.map(e => e.innerText)")
        assert all(no_traceback(t) for t in outputs), [t[:200] for t in outputs if not no_traceback(t)]
        cells(page).nth(check).scroll_into_view_if_needed()

    with step("wrong-answer"):
        type_into(page, answer, wrong_version(right, ex.target))
        run_cell(page, answer)
        text = run_cell(page, check)
        lines = text.splitlines()
        assert lines[0].startswith(f"✗ {ex.id}: case “") and lines[0].endswith("” failed"), text
        assert re.search(r"expected .+, got ", " ".join(text.split())), text
        hint = " ".join(text[text.index("hint: "):].split())
        assert "1.5 times the right one" in hint and no_traceback(text), text  # the mistake, named

    with step("right-answer"):
        type_into(page, answer, right)
        run_cell(page, answer)
        text = run_cell(page, check)
        assert re.fullmatch(rf"✓ {re.escape(ex.id)}: all \d+ case\(s\) passed", text), text

    with step("check-cell-read-only"):
        before = editor_text(page, check)
        cells(page).nth(check).locator(".cm-content").click()
        page.keyboard.type("x = 1")
        assert editor_text(page, check) == before, "the check cell could be edited"
        page.keyboard.press("Escape")
        n = cells(page).count()
        cells(page).nth(check).locator(".jp-InputPrompt").click()
        page.keyboard.press("d")
        page.keyboard.press("d")
        page.wait_for_timeout(500)
        assert cells(page).count() == n, "the check cell could be deleted"

    with step("work-saved-course-untouched-and-updated"):
        page.keyboard.press("Control+s")
        saved = course / "my-work" / "exercises" / mine
        deadline = time.monotonic() + 30
        while "YOUR CODE HERE" in cell_source(saved, answer) and time.monotonic() < deadline:
            page.wait_for_timeout(500)
        assert cell_source(saved, answer).strip() == right.strip(), "the answer was not saved in my-work/"
        changed = [p.name for p, data in tracked.items() if p.read_bytes() != data]
        assert not changed, f"the learner's session changed tracked notebooks: {changed}"
        assert nbtools.generate_exercises(course, check_only=True) == [], "exercises/ out of sync after a session"
        solution = course / "solutions" / f"{lesson}.ipynb"  # a course update: a solution notebook changes
        nb = nbformat.read(solution, as_version=4)
        nb.cells.append(nbtools.md("## Added by a course update"))
        nbformat.write(nb, solution)
        assert nbtools.generate_exercises(course) == [f"{lesson}.ipynb"]
        done = workspace.prepare(course, out=open(os.devnull, "w"))  # what the next ./course lab does
        assert f"my-work/exercises/{mine}" in done["kept"] and cell_source(saved, answer).strip() == right.strip()
        assert not list((course / "my-work").glob("backups/*")), "nothing needed a backup"
        assert "Added by a course update" in (course / "my-work" / "solutions" /
                                              workspace.work_name("solutions", f"{lesson}.ipynb")).read_text()
