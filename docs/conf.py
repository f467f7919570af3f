"""Sphinx configuration for the pipedialect documentation."""

from __future__ import annotations

import pipedialect

project = "pipedialect"
author = "The pipedialect developers"
copyright = "2026, The pipedialect developers"
release = pipedialect.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

exclude_patterns = ["_build"]
# Literal blocks ("::") are text: code is shown with an explicit ``code-block`` and a
# ``pipedialect-example`` marker, which tests/project/test_docs_examples.py runs.
highlight_language = "text"
html_theme = "alabaster"
html_theme_options = {
    "description": "One partitioned model, several pipeline runtimes",
    "fixed_sidebar": True,
}
