"""The admin's pictures in a real headless Chromium against Django's live server.

Chromium and its driver come from Debian (``apt-get install chromium chromium-driver``;
scripts/test installs them when missing). Without them the tests skip, except under CI
(``CI=true``), where they fail. Screenshots are kept under tests/artifacts/ (gitignored);
``BOUNDEDBEAT_DOCS_SCREENSHOT=path`` also writes the picture of docs/django.md there
(``scripts/admin-screenshot``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from bbtest_admin import RUNS, SCHEDULES, add_history, add_run

from celery_boundedbeat.contrib.django.charts import STATE_COLOURS
from celery_boundedbeat.db.store import Store

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(180)]

CHROMIUM = os.environ.get("BOUNDEDBEAT_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("BOUNDEDBEAT_TEST_CHROMEDRIVER", "/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PASSWORD = "browser-test-password"
WIDTH = 1400


def _hex(rgb: str) -> str:
    """``rgb(46, 125, 50)`` (what the browser reports for a fill) as ``#2e7d32``."""
    parts = rgb.removeprefix("rgb(").removesuffix(")").split(",")
    return "#" + "".join(f"{int(p):02x}" for p in parts)


@pytest.fixture(scope="module")
def live_server() -> Iterator[str]:
    """Django's live server thread (the one LiveServerTestCase runs), serving the admin's static files."""
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.test.testcases import LiveServerThread

    thread = LiveServerThread("127.0.0.1", StaticFilesHandler, port=0)
    thread.daemon = True
    thread.start()
    thread.is_ready.wait()
    if thread.error:
        raise thread.error
    try:
        yield f"http://127.0.0.1:{thread.port}"
    finally:
        thread.terminate()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium through Selenium, logging the console; fails instead of skipping under CI."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not shutil.which(p)]
    if missing:
        why = f"{', '.join(missing)} not found: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    options.add_argument(f"--window-size={WIDTH},1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def staff(users: dict[str, Any]) -> str:
    """The viewer (staff, view permissions only) with a password to type into the login form."""
    user = users["viewer"]
    user.set_password(PASSWORD)
    user.save()
    return str(user.username)


def log_in(browser: Any, live_server: str, username: str) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(f"{live_server}/admin/login/?next={SCHEDULES}")
    browser.find_element(By.NAME, "username").send_keys(username)
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    assert browser.current_url.endswith(SCHEDULES), browser.current_url


def open_page(browser: Any, url: str, expect: str, timeout: float = 15) -> None:
    """Load ``url`` and wait until an element matching ``expect`` is there (a loaded CI machine
    can be slow to hand the page over); fails with what the page shows instead."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    try:
        WebDriverWait(browser, timeout).until(lambda b: b.find_elements(By.CSS_SELECTOR, expect))
    except TimeoutException:
        body = browser.find_element(By.TAG_NAME, "body").text[:600]
        where = f"{browser.current_url} ({browser.title!r})"
        pytest.fail(f"{expect!r} not on {where} within {timeout} s:\n{body}")


def console_errors(browser: Any) -> list[dict[str, Any]]:
    """Everything the page logged at error level since the last call (reading clears the log)."""
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(browser: Any, name: str, capsys: pytest.CaptureFixture[str]) -> Path:
    """A full-page PNG under tests/artifacts/, its path printed in the test output."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, max(1000, min(int(height) + 40, 4000)))
    assert browser.save_screenshot(str(path)), path
    browser.set_window_size(WIDTH, 1000)
    with capsys.disabled():
        print(f"\nscreenshot: {path}")
    return path


def test_change_list_shows_a_sparkline_per_schedule_without_scrolling(
    store: Store, browser: Any, live_server: str, staff: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 1,400 px a staff user sees every schedule with a sparkline of its last 20 runs in state
    colours, its last run and next due, with no horizontal scroll and no console error."""
    from selenium.webdriver.common.by import By

    now = datetime.now(UTC).replace(microsecond=0)
    add_history(store, "poll-partner", now)
    add_run(store, "export-report", "failed", now, started_at=now, finished_at=now, elapsed_ms=5, error="x")
    log_in(browser, live_server, staff)
    console_errors(browser)
    open_page(browser, f"{live_server}{SCHEDULES}", "svg.bb-sparkline rect.bb-spark")

    rows = {
        row.find_element(By.CSS_SELECTOR, "th.field-name").text: row
        for row in browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    }
    assert set(rows) == {"refresh-cache", "export-report", "poll-partner"}
    bars = rows["poll-partner"].find_elements(By.CSS_SELECTOR, "svg.bb-sparkline rect.bb-spark")
    assert len(bars) == 20
    assert _hex(bars[-1].value_of_css_property("fill")) == STATE_COLOURS["started"]
    (failed,) = rows["export-report"].find_elements(By.CSS_SELECTOR, "rect.bb-spark")
    assert _hex(failed.value_of_css_property("fill")) == STATE_COLOURS["failed"]
    assert rows["refresh-cache"].find_elements(By.CSS_SELECTOR, "svg.bb-sparkline") == []
    assert "started" in rows["poll-partner"].find_element(By.CSS_SELECTOR, "td.field-last_run").text
    assert ":" in rows["poll-partner"].find_element(By.CSS_SELECTOR, "td.field-next_due").text

    widths = browser.execute_script(
        "const r = document.querySelector('#changelist .results');"
        "return [document.documentElement.scrollWidth, window.innerWidth, r.scrollWidth, r.clientWidth];"
    )
    screenshot(browser, "admin-schedule-changelist.png", capsys)
    assert widths[0] <= widths[1] and widths[2] <= widths[3], widths
    assert console_errors(browser) == []


def test_schedule_page_draws_the_timeline_and_the_duration_drift_chart(
    store: Store, browser: Any, live_server: str, staff: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A schedule's page draws one bar per recent run in its state's colour, outlines overlapping
    runs, plots duration and drift per run, and logs no console error."""
    from selenium.webdriver.common.by import By

    now = datetime.now(UTC).replace(microsecond=0)
    ids = add_history(store, "poll-partner", now)
    log_in(browser, live_server, staff)
    console_errors(browser)
    open_page(browser, f"{live_server}{SCHEDULES}poll-partner/change/", "svg.bb-timeline rect.bb-run")

    bars = browser.find_elements(By.CSS_SELECTOR, "svg.bb-timeline rect.bb-run")
    assert sorted(b.find_element(By.XPATH, "..").get_attribute("data-run") for b in bars) == sorted(ids)
    states = {b.get_attribute("data-state") for b in bars}
    assert states == {"completed", "failed", "timed_out", "started"}
    for bar in bars:
        assert _hex(bar.value_of_css_property("fill")) == STATE_COLOURS[bar.get_attribute("data-state")]
    assert browser.find_elements(By.CSS_SELECTOR, "svg.bb-timeline rect.bb-overlap")
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.bb-chart circle.bb-duration")) == len(ids) - 1
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.bb-chart circle.bb-drift")) == len(ids)
    assert browser.find_element(By.CSS_SELECTOR, "svg.bb-timeline").size["width"] > 600
    path = screenshot(browser, "admin-schedule-timeline.png", capsys)
    docs = os.environ.get("BOUNDEDBEAT_DOCS_SCREENSHOT")
    if docs:
        fieldset = browser.execute_script(
            "return document.querySelector('svg.bb-timeline').closest('fieldset')"
        )
        browser.execute_script("arguments[0].scrollIntoView()", fieldset)
        assert fieldset.screenshot(docs), docs
    assert path.stat().st_size > 10_000
    assert console_errors(browser) == []

    browser.get(f"{live_server}{RUNS}?schedule=poll-partner")
    assert browser.find_elements(By.CSS_SELECTOR, "td.field-state_label .bb-state-failed")
    assert console_errors(browser) == []
