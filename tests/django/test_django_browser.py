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
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
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
HEIGHT = 900


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
    options.add_argument(f"--window-size={WIDTH},{HEIGHT}")
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
    # Wait for the page the login redirects to. The login page's own address ends with
    # ``?next=SCHEDULES`` too, so a check of the address alone passed while the form was still
    # posting, and the next page asked for could be overtaken by the redirect (a loaded machine).
    open_page(browser, None, "#user-tools", wait_for=lambda b: "/login/" not in b.current_url)
    assert browser.current_url.endswith(SCHEDULES), browser.current_url


def open_page(
    browser: Any,
    url: str | None,
    expect: str,
    timeout: float = 15,
    wait_for: Callable[[Any], bool] = lambda b: True,
) -> None:
    """Load ``url`` (``None``: the page the browser is going to) and wait until an element
    matching ``expect`` is there and ``wait_for`` holds (a loaded CI machine can be slow to hand
    the page over); fails with what the page shows instead."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if url is not None:
        browser.get(url)
    try:
        WebDriverWait(browser, timeout).until(
            lambda b: wait_for(b) and b.find_elements(By.CSS_SELECTOR, expect)
        )
    except TimeoutException:
        body = browser.find_element(By.TAG_NAME, "body").text[:600]
        where = f"{browser.current_url} ({browser.title!r})"
        pytest.fail(f"{expect!r} not on {where} within {timeout} s:\n{body}")


def press(browser: Any, selector: str, timeout: float = 15) -> None:
    """Click the button matching ``selector`` and wait for the page its form posts to."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    button = browser.find_element(By.CSS_SELECTOR, selector)
    button.click()
    WebDriverWait(browser, timeout).until(expected_conditions.staleness_of(button))
    WebDriverWait(browser, timeout).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#content"))


def console_errors(browser: Any) -> list[dict[str, Any]]:
    """Everything the page logged at error level since the last call (reading clears the log)."""
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def screenshot(browser: Any, name: str, capsys: pytest.CaptureFixture[str]) -> Path:
    """A full-page PNG under tests/artifacts/, its path printed in the test output."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(WIDTH, max(HEIGHT, min(int(height) + 40, 4000)))
    assert browser.save_screenshot(str(path)), path
    browser.set_window_size(WIDTH, HEIGHT)
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


#: Pairs of a picture's labels that touch each other, a point or a bar, as the browser drew them.
COLLISIONS = """
const svg = document.querySelector(arguments[0]);
const box = (e) => {
  const b = e.getBBox();
  return {e: e, x0: b.x, y0: b.y, x1: b.x + b.width, y1: b.y + b.height};
};
const texts = [...svg.querySelectorAll('text')].map(box);
const marks = [...svg.querySelectorAll('circle, rect.bb-run, rect.bb-wait')].map(box);
const meet = (a, b) => a.x0 < b.x1 && b.x0 < a.x1 && a.y0 < b.y1 && b.y0 < a.y1;
const name = (a) => a.e.tagName + ':' + (a.e.textContent || a.e.getAttribute('class'));
const found = [];
texts.forEach((a, i) => {
  texts.slice(i + 1).forEach((b) => { if (meet(a, b)) found.push([name(a), name(b)]); });
  marks.forEach((b) => { if (meet(a, b)) found.push([name(a), name(b)]); });
});
return found;
"""


def test_schedule_page_draws_the_timeline_and_the_duration_drift_chart(
    store: Store, browser: Any, live_server: str, staff: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A schedule's page draws one bar per recent run in its state's colour, outlines overlapping
    runs, plots duration and drift per run with no label touching another label, a point or a
    bar, and logs no console error."""
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
    for picture in ("svg.bb-timeline", "svg.bb-chart"):
        assert browser.execute_script(COLLISIONS, picture) == [], picture
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


#: Where a cell ends and how many lines it takes, as the browser laid it out.
CELL_BOX = """
const box = arguments[0].getBoundingClientRect();
const style = getComputedStyle(arguments[0]);
const line = parseFloat(style.lineHeight) || parseFloat(style.fontSize) * 1.2;
return {right: box.right, height: box.height, line: line, inner: window.innerWidth};
"""


def test_failed_runs_list_fits_1400_px_with_worker_and_error_in_view(
    store: Store, browser: Any, live_server: str, staff: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 1,400 x 900 the failed-runs list shows each run's worker and error inside the window
    (a long error cut, whole in its tooltip) and every time on one line, with no horizontal scroll."""
    from selenium.webdriver.common.by import By

    now = datetime.now(UTC).replace(microsecond=0)
    long_error = "ConnectionError: " + "the partner's gateway answered 503 Service Unavailable " * 4
    for n in range(5):
        add_run(
            store,
            "export-report",
            "failed",
            now - timedelta(minutes=n),
            published_at=now - timedelta(minutes=n),
            started_at=now - timedelta(minutes=n, seconds=-1),
            finished_at=now - timedelta(minutes=n, seconds=-3),
            elapsed_ms=2000,
            drift_ms=1234,
            worker="celery@ip-10-0-12-201.eu-central-1.compute.internal",
            error=long_error + "\n\nTraceback (most recent call last):\n  ...",
        )
    log_in(browser, live_server, staff)
    console_errors(browser)
    open_page(browser, f"{live_server}{RUNS}?state__exact=failed", "td.field-short_error")

    rows = browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
    assert len(rows) == 5
    for row in rows:
        for column in ("worker_cell", "short_error", "duration_and_drift"):
            cell = browser.execute_script(CELL_BOX, row.find_element(By.CSS_SELECTOR, f"td.field-{column}"))
            assert cell["right"] <= WIDTH and cell["right"] <= cell["inner"], (column, cell)
        times = row.find_elements(By.CSS_SELECTOR, "td.field-scheduled_and_started .bb-when")
        assert len(times) == 2
        for time in times:
            box = browser.execute_script(CELL_BOX, time)
            assert box["height"] < 1.5 * box["line"] and box["right"] <= WIDTH, box
    error = rows[0].find_element(By.CSS_SELECTOR, "td.field-short_error .bb-clip")
    assert error.get_attribute("title").startswith(long_error) and "Traceback" in error.get_attribute("title")
    assert error.text.startswith("ConnectionError:") and len(error.text) < len(long_error)
    widths = browser.execute_script(
        "const r = document.querySelector('#changelist .results');"
        "return [document.documentElement.scrollWidth, window.innerWidth, r.scrollWidth, r.clientWidth];"
    )
    headers = browser.find_element(By.CSS_SELECTOR, "#result_list thead").text
    screenshot(browser, "admin-failed-runs.png", capsys)
    assert widths[0] <= widths[1] and widths[2] <= widths[3], widths
    assert "(UTC)" in headers, headers
    assert console_errors(browser) == []


def test_schedule_page_buttons_pause_resume_and_trigger_and_show_state_first(
    store: Store, browser: Any, live_server: str, users: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator's schedule page shows status and next due (with their zone) above the policy, links
    to the schedule's runs, and its Pause, Resume and Trigger buttons change the row; a viewer gets
    the link but no button."""
    from selenium.webdriver.common.by import By

    for name in ("operator", "viewer"):
        users[name].set_password(PASSWORD)
        users[name].save()
    log_in(browser, live_server, "operator")
    console_errors(browser)
    page_url = f"{live_server}{SCHEDULES}poll-partner/change/"
    open_page(browser, page_url, "button.bb-pause_schedules")

    def top(selector: str) -> float:
        return float(browser.find_element(By.CSS_SELECTOR, selector).rect["y"])

    assert top("div.field-status") < top("div.field-next_due_time") < top("div.field-policy")
    assert browser.find_element(By.CSS_SELECTOR, "div.field-next_due_time").text.endswith("UTC")
    link = browser.find_element(By.CSS_SELECTOR, "a.bb-runs-link")
    assert link.text.lower() == "runs of this schedule"
    assert link.get_attribute("href").endswith(f"{RUNS}?schedule=poll-partner")
    assert browser.find_elements(By.CSS_SELECTOR, "button.bb-resume_schedules") == []
    screenshot(browser, "admin-schedule-buttons.png", capsys)

    press(browser, "button.bb-pause_schedules")
    assert browser.current_url == page_url
    assert "Schedule 'poll-partner' paused." in browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
    assert store.schedules(["poll-partner"])[0].paused is True
    assert browser.find_elements(By.CSS_SELECTOR, "button.bb-pause_schedules") == []

    press(browser, "button.bb-resume_schedules")
    assert browser.find_elements(By.CSS_SELECTOR, "button.bb-pause_schedules")
    assert store.schedules(["poll-partner"])[0].paused is False

    press(browser, "button.bb-trigger_schedules")
    assert "triggered" in browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
    assert store.schedules(["poll-partner"])[0].pending_runs == 1
    assert console_errors(browser) == []

    log_in(browser, live_server, "viewer")
    open_page(browser, page_url, "a.bb-runs-link")
    assert browser.find_elements(By.CSS_SELECTOR, "form.bb-operate") == []
