"""The partitions picture in docs/several-beats.md is drawn by the assignment code; keep it current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from celery_boundedbeat.core.partitions import assign

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("partitions_picture", DOCS / "partitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["partitions_picture"] = module  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["partitions_picture"]
    return module


def test_docs_partitions_svg_is_what_the_assignment_code_draws_today() -> None:
    """A change to the assignment must also redraw the picture operators read."""
    script = _script()
    drawn = script.render(script.steps())
    assert drawn == (DOCS / "partitions.svg").read_text(encoding="utf-8"), (
        "docs/partitions.svg is stale: run `python docs/partitions.py` and commit the result"
    )


def test_every_settled_step_is_the_assignment_of_its_live_beats() -> None:
    """The picture shows where the protocol settles: each running beat holds exactly its share."""
    script = _script()
    for step in script.steps():
        event = step.event
        if event.members == event.running:
            assert step.claims == assign(event.members, script.PARTITIONS), event.title
        else:  # a killed beat's claims stay as they were until they expire
            dead = event.members - event.running
            assert {p for p, o in step.claims.items() if o in dead}, event.title
