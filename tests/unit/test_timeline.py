"""The README's timeline picture is drawn by the policy code; keep the committed copy current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_docs_timeline_svg_is_what_the_policy_functions_draw_today() -> None:
    """A policy change that alters behaviour must also redraw the picture users read."""
    spec = importlib.util.spec_from_file_location("timeline", DOCS / "timeline.py")
    assert spec is not None and spec.loader is not None
    timeline = importlib.util.module_from_spec(spec)
    sys.modules["timeline"] = timeline  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(timeline)
    finally:
        del sys.modules["timeline"]
    sims = [(timeline.STOCK, timeline.simulate_stock(timeline.STOCK))] + [
        (row, timeline.simulate(row)) for row in timeline.ROWS
    ]
    drawn = timeline.render(sims)
    assert drawn == (DOCS / "timeline.svg").read_text(encoding="utf-8"), (
        "docs/timeline.svg is stale: run `python docs/timeline.py` and commit the result"
    )
