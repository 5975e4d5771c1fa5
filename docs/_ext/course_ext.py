"""The course site's own Sphinx extension: the offline MathJax copy, JupyterLab-style heading anchors, and a
build failure for a reference to a name the package does not have."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import shutil
from pathlib import Path

from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

# What the site needs of MathJax 3 (tex-chtml and what it loads on demand: TeX extensions, fonts, menu,
# accessibility, English speech rules); the package ships more (SVG output, other languages).
_MATHJAX_KEEP = ("tex-chtml.js", "input/tex/", "output/chtml/", "ui/", "a11y/", "adaptors/",
                 "sre/speech-worker.js", "sre/mathmaps/base.json", "sre/mathmaps/en.json")


def jupyterlab_slug(text: str) -> str:
    """JupyterLab's anchor for a heading: its text with spaces as dashes, case kept (``#Summary``)."""
    return text.strip().replace(" ", "-")


def _mathjax_dir() -> Path:
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MathJax is not installed: pip install -e '.[docs]' (package sphinx-mathjax-offline)")
    return Path(next(iter(spec.submodule_search_locations))) / "static" / "mathjax"


def _copy_mathjax(app, exc) -> None:
    if exc is not None or app.builder.format != "html":
        return
    src, dest = _mathjax_dir(), Path(app.outdir) / "_static" / "mathjax"
    for f in src.rglob("*"):
        rel = f.relative_to(src).as_posix()
        if f.is_file() and any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in _MATHJAX_KEEP):
            if "sre/mathmaps" in rel or not rel.startswith("sre/") or rel == "sre/speech-worker.js":
                target = dest / rel
                if not target.exists() or target.stat().st_size != f.stat().st_size:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, target)


_log = logging.getLogger("attncourse.site")


def _canonical(target: str) -> str | None:
    """``attncourse.flash_attention`` (a re-export) -> ``attncourse.flash.flash_attention`` (where autodoc put it)."""
    module_name, _, attr = target.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    if inspect.ismodule(obj):
        return obj.__name__
    home, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if home and qualname and home.startswith("attncourse") and f"{home}.{qualname}" != target:
        return f"{home}.{qualname}"
    return None


def _missing_reference(app, env, node, contnode):
    """Resolve the package's re-exported names to where they are documented; a reference to a public name the
    package does not have (or that no API page documents) fails the build (with -W)."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("attncourse"):
        return None
    canonical = _canonical(target)
    if canonical:
        domain = env.domains["py"]
        for typ in (node.get("reftype", "obj"), "obj"):
            found = domain.resolve_xref(env, node.get("refdoc", ""), app.builder, typ, canonical, node, contnode)
            if found is not None:
                return found
    if any(part.startswith("_") for part in target.split(".")):
        return None  # a private base class (show-inheritance): shown as text
    _log.warning("the API reference has no %s", target, location=node)
    return None


_LITERAL = re.compile(r"(``.*?``)")
_DOLLAR = re.compile(r"(?<![\\$\w])\$([^$\n]+?)\$(?![\w$])")


def _dollar_math(app, what, name, obj, options, lines) -> None:
    """Docstrings written for Jupyter's help use $...$ for math: the site typesets it as :math:`...`."""
    for i, line in enumerate(lines):
        if "$" in line:
            parts = _LITERAL.split(line)
            lines[i] = "".join(p if p.startswith("``") else _DOLLAR.sub(r":math:`\1`", p) for p in parts)


def _signature(obj) -> str:
    """``(query, key, value, attn_mask=None, *, is_causal=False, ...)``: names and defaults, no annotations."""
    params, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.VAR_POSITIONAL:
            params.append(f"*{p.name}")
            star = True
            continue
        if p.kind is p.VAR_KEYWORD:
            params.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            params.append("*")
            star = True
        text = p.name
        if p.default is not p.empty:
            value = repr(p.default)
            text += "=" + ("<required>" if value.startswith("<") else value)
        params.append(text)
    return "(" + ", ".join(params) + ")"


class Signatures(SphinxDirective):
    """A code block of the named objects' signatures, read from the package when the site is built."""

    has_content = True

    def run(self):
        lines = []
        for name in (line.strip() for line in self.content):
            if not name:
                continue
            module_name, obj = name, None
            rest: list[str] = []
            while module_name:
                try:
                    obj = importlib.import_module(module_name)
                    break
                except ImportError:
                    module_name, _, last = module_name.rpartition(".")
                    rest.insert(0, last)
            try:
                for attr in rest:
                    obj = getattr(obj, attr)
            except AttributeError:
                obj = None
            if obj is None or not callable(obj):
                _log.warning("the API has no %s (course-signatures)", name, location=self.get_location())
                continue
            lines.append(name.removeprefix("attncourse.") + _signature(obj))
        text = "\n".join(lines)
        block = nodes.literal_block(text, text)
        block["language"] = "python"
        return [block]


_TITLE = re.compile(r"""(?:set_title|suptitle|title)\s*[(=]\s*f?(["'])(.+?)\1""")


def _figure_alt(app, doctree, docname=None) -> None:
    """A figure from a cell's output gets words for alt text (MyST-NB leaves it empty, and the HTML writer then
    writes the image's hashed file name): the titles the cell's code gives its axes, else the section's title."""
    for image in doctree.findall(nodes.image):
        if image.get("alt") and image["alt"] != image.get("uri"):
            continue
        titles, section, parent = [], None, image.parent
        while parent is not None:
            if parent.get("nb_element") == "cell_code" and not titles:
                code = "\n".join(b.astext() for b in parent.findall(nodes.literal_block))
                titles = [m.group(2) for m in _TITLE.finditer(code)]
            if isinstance(parent, nodes.section) and section is None:
                section = parent.next_node(nodes.title)
            parent = parent.parent
        where = f" (section “{section.astext()}”)" if section is not None else ""
        titles = [" ".join(re.sub(r"\{[^{}]*\}", "…", t).replace("\\n", " ").split()) for t in titles]
        image["alt"] = ("Figure: " + "; ".join(list(dict.fromkeys(titles))[:3]) if titles else
                        "A figure of the cell above") + where


def setup(app):
    app.connect("doctree-resolved", _figure_alt)  # after MyST-NB has chosen each output's image
    _mathjax_dir()  # fail early, before any page is read
    app.connect("build-finished", _copy_mathjax)
    app.connect("missing-reference", _missing_reference)
    app.connect("autodoc-process-docstring", _dollar_math)
    app.add_directive("course-signatures", Signatures)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
