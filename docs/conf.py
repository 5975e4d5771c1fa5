"""Sphinx configuration of the course website. Build it with ``./course site`` (docs/site.py stages the sources in
build/site-src/ and runs Sphinx there); nothing here reaches the network."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] if (Path(__file__).parent.name == "site-src") else Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

project = "Attention, from Bahdanau to FlashAttention"
author = "the attncourse authors"
copyright = "the attncourse authors, MIT licence"
release = "0.1.0"

sys.path.insert(0, str(Path(__file__).parent / "_ext"))
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode",
              "sphinx.ext.mathjax", "course_ext"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
if tags.has("no_solutions"):  # noqa: F821 (Sphinx defines `tags` in conf.py)
    exclude_patterns.append("solutions")

# --- notebooks: the committed outputs, never executed here
nb_execution_mode = "off"
nb_output_stderr = "show"
nb_ipywidgets_js = {}  # no widget manager from a CDN: progress bars show their final text instead
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
# JupyterLab's anchors: the heading's text with spaces as dashes, case kept (lessons link to "...ipynb#Summary")
myst_heading_slug_func = "course_ext.jupyterlab_slug"
suppress_warnings = ["mystnb.unknown_mime_type"]


# --- API reference
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # torch's own docstrings (nn.Module.forward, autograd.Function) stay in torch's docs
# members defined in each module (a package's __init__ re-exporting its submodules' names documents none twice)
autodoc_default_options = {"exclude-members": "__init__", "ignore-module-all": True}
napoleon_numpy_docstring = False
add_module_names = False
viewcode_line_numbers = True

# --- math from the installed MathJax (package sphinx-mathjax-offline), copied into _static/mathjax/
mathjax_path = "mathjax/tex-chtml.js"

# --- theme
html_theme = "sphinx_book_theme"
html_title = "Attention, from Bahdanau to FlashAttention"
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_theme_options = {
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "home_page_in_toc": True,
    "use_download_button": False,  # the lesson box says how to get and run the notebooks
    "navigation_with_keys": False,
}
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False


