"""The README's demo command, run for a few seconds: beat + worker on the embedded defaults."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_demo_runs_all_three_schedules_to_completion(tmp_path: Path) -> None:
    """`DEMO_SECONDS=15 scripts/demo` exits 0 and its history shows completed runs of each example;
    a second run installs nothing."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BOUNDEDBEAT_DEMO_DATABASE_URL", "BOUNDEDBEAT_DEMO_BROKER_URL")
    }
    env.update(DEMO_SECONDS="15", BOUNDEDBEAT_DEMO_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    history = output[output.rindex("ID ") :]
    for schedule in ("refresh-cache", "export-report", "poll-partner"):
        assert any(schedule in line and "completed" in line for line in history.splitlines()), output[-4000:]

    # Run again: pyproject.toml has not changed, so nothing is installed this time.
    env["DEMO_SECONDS"] = "1"
    again = subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert "demo: .venv is up to date" in again.stdout, again.stdout[-2000:]
    assert "installing" not in again.stdout
