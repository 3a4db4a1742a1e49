"""Sphinx configuration of the celery_boundedbeat manual (Markdown pages read by MyST-Parser).

Built by scripts/test with ``sphinx-build -W --keep-going -n -b html docs docs/_build/html``:
every warning fails the build, and heading anchors are generated so a link such as
``policies.md#catch-up-window`` is checked like any other reference. No extension fetches
anything from the network.
"""

from __future__ import annotations

from typing import Any

project = "celery_boundedbeat"
author = "celery_boundedbeat contributors"
copyright = "celery_boundedbeat contributors"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# GitHub-style anchors for headings down to ###, so `page.md#anchor` links resolve (and an
# anchor that does not exist is a warning, hence a failed build).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = "celery_boundedbeat"
html_static_path: list[str] = []
# A page's own source is in the repository; do not copy it into the site as well.
html_copy_source = False
html_show_sourcelink = False


def setup(app: Any) -> None:
    """docs/architecture.md draws its layers in a ``mermaid`` block (GitHub renders it).

    Pygments has no lexer for it; show the block as plain text instead of warning.
    """
    from pygments.lexers.special import TextLexer

    app.add_lexer("mermaid", TextLexer)
