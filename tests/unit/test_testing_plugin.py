"""The pytest plugin loads from the installed package's entry point, next to Celery's fixtures.

Each test runs pytest in a subprocess on a user's test file in a directory of its own (no
project config), as a user's CI would: the fixture ``boundedbeat_simulate`` must be there
without any ``conftest.py`` or ``-p`` naming it, together with the in-process ``celery_app`` /
``celery_worker`` fixtures, however those are chosen.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

USER_TESTS = textwrap.dedent(
    """
    from celery_boundedbeat.testing import EventKind, Timeline

    ENTRY = {
        "task": "proj.tasks.export",
        "schedule": 60.0,
        "policy": {"mode": "fixed_rate_no_overlap", "missed_ticks": "coalesce_latest"},
    }


    def test_a_slow_export_never_overlaps(boundedbeat_simulate):
        timeline: Timeline = boundedbeat_simulate(ENTRY, hours=1, task_seconds=150)
        assert timeline.max_active == 1
        assert timeline.coalesced and not timeline.skipped
        assert [timeline.seconds(r.start) for r in timeline.runs][:3] == [0, 150, 300]


    def test_celery_config_reaches_the_simulation(boundedbeat_simulate, celery_app):
        assert celery_app.conf.boundedbeat_default_policy == {"mode": "fixed_delay"}
        timeline = boundedbeat_simulate({"task": "t", "schedule": 10}, hours=1 / 60, task_seconds=5)
        assert [timeline.seconds(r.start) for r in timeline.runs] == [0, 15, 30, 45]
    """
)

CONFTEST = textwrap.dedent(
    """
    import pytest


    @pytest.fixture(scope="session")
    def celery_config():
        return {"broker_url": "memory://", "result_backend": "cache+memory://",
                "boundedbeat_default_policy": {"mode": "fixed_delay"}}
    """
)

WORKER_TEST = textwrap.dedent(
    """
    def test_the_in_process_worker_runs_a_task(celery_app, celery_worker, boundedbeat_simulate):
        @celery_app.task
        def add(x, y):
            return x + y

        celery_worker.reload()
        assert add.delay(2, 3).get(timeout=20) == 5
        assert boundedbeat_simulate({"task": "t", "schedule": 5}, hours=1 / 360, task_seconds=1).runs
    """
)


def run_pytest(where: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.fixture
def user_project(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_schedules.py").write_text(USER_TESTS)
    return tmp_path


@pytest.mark.parametrize(
    "plugin_args",
    [
        pytest.param((), id="defaults"),
        pytest.param(("-p", "no:celery", "-p", "celery.contrib.pytest"), id="in-process-celery-by-name"),
        pytest.param(("-p", "no:celery"), id="celery-plugin-disabled"),
    ],
)
def test_the_entry_point_gives_the_fixture_with_celerys_fixtures(
    user_project: Path, plugin_args: tuple[str, ...]
) -> None:
    """Without any configuration naming it, boundedbeat_simulate works beside celery_app.

    ``-p no:celery -p celery.contrib.pytest`` is this project's own choice (in-process fixtures
    instead of pytest-celery's containers); with ``-p no:celery`` alone the plugin loads
    Celery's in-process fixtures itself.
    """
    done = run_pytest(user_project, *plugin_args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout


def test_the_in_process_worker_fixture_runs_beside_the_plugin(user_project: Path) -> None:
    """celery_worker (the classic in-process worker) and boundedbeat_simulate in one test."""
    (user_project / "test_worker.py").write_text(WORKER_TEST)
    done = run_pytest(user_project, "-p", "no:celery", "-p", "celery.contrib.pytest", "test_worker.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout, done.stdout


def test_disabling_the_plugin_by_its_entry_point_name_removes_the_fixture(user_project: Path) -> None:
    """``-p no:boundedbeat`` turns it off: proof that the entry point is what provided it."""
    done = run_pytest(user_project, "-p", "no:boundedbeat", "-p", "no:celery", "-p", "celery.contrib.pytest")
    assert done.returncode != 0
    assert "fixture 'boundedbeat_simulate' not found" in done.stdout, done.stdout
