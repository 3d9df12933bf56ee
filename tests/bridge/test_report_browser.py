"""``kvpath bridge report`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which scripts/setup.sh installs) driven by selenium opens the page
``write_report`` wrote. Every image has loaded with a non-zero size, the console has no
error, the title and sections are there; a screenshot of the whole page is kept. The same
checks are run on pages with a broken image and a console error, which they must report.

Skips only where chromium or chromedriver is not installed."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from kvpath.bridge import report
from kvpath.bridge.serving_sim import ServingConfig, simulate
from kvpath.fabric import FabricSpec
from kvpath.iteration_time import IterationTimeModel
from kvpath.workloads import load_workload

logger = logging.getLogger(__name__)

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
MISSING = [name for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if path is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"headless browser missing ({' and '.join(MISSING)} not on PATH): "
           "scripts/setup.sh installs Debian's chromium and chromium-driver when run as root with apt, "
           "or run `apt-get install chromium chromium-driver`")

WIDTH = 1280
MAX_HEIGHT = 16000  # the full-page screenshot's cap, in CSS pixels
LOAD_TIMEOUT_S = 30
# slow links so that pushes overlap, as in test_bridge_report: every figure has something to show
SPEC = dataclasses.replace(FabricSpec.resolve("small"), host_link_gbps=20.0, spine_link_gbps=20.0)
# every <img> with what the browser made of it
IMAGES_JS = """return Array.from(document.images).map(i => ({
    src: i.getAttribute('src'), complete: i.complete, naturalWidth: i.naturalWidth,
    naturalHeight: i.naturalHeight, width: i.getBoundingClientRect().width,
    height: i.getBoundingClientRect().height}));"""
LOADED_JS = "return document.readyState === 'complete' && Array.from(document.images).every(i => i.complete);"


# -- the checks (also run on the broken pages below) ------------------------------------------
def open_page(driver: webdriver.Chrome, url: str) -> None:
    """Loads ``url`` with the console log emptied first, so that ``console_errors`` reads
    this page's entries only; waits until the document and every image are done (a broken
    image is done too)."""
    driver.get_log("browser")  # reading the log empties it
    driver.get(url)
    try:
        WebDriverWait(driver, LOAD_TIMEOUT_S).until(lambda d: d.execute_script(LOADED_JS))
    except TimeoutException:
        pass  # image_problems names what did not load


def images(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    return driver.execute_script(IMAGES_JS)


def image_problems(driver: webdriver.Chrome) -> list[str]:
    """One line per <img> that has not loaded, has no intrinsic size (a missing or
    undecodable file) or is laid out with no size."""
    bad = []
    for im in images(driver):
        if not (im["complete"] and im["naturalWidth"] > 0 and im["naturalHeight"] > 0
                and im["width"] > 0 and im["height"] > 0):
            bad.append(f"{im['src']}: complete={im['complete']} natural={im['naturalWidth']}x{im['naturalHeight']} "
                       f"shown={im['width']:g}x{im['height']:g}")
    return bad


def console_errors(driver: webdriver.Chrome) -> list[str]:
    """The SEVERE entries of the browser's console log since the page was opened: console.error
    calls, uncaught exceptions and failed loads."""
    return [f"{e.get('source', '?')}: {e['message']}" for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver: webdriver.Chrome, path: Path) -> Path:
    """The whole page as a PNG: the window grown so that its viewport holds the document's
    height (up to MAX_HEIGHT); the window's own frame is the outer minus the inner height."""
    height, frame = driver.execute_script("return [Math.ceil(document.documentElement.scrollHeight), "
                                          "window.outerHeight - window.innerHeight];")
    driver.set_window_size(WIDTH, min(max(int(height), 600), MAX_HEIGHT) + max(int(frame), 0))
    assert driver.save_screenshot(str(path)), f"no screenshot written to {path}"
    return path


def keep(path: Path) -> Path:
    """Copies ``path`` into ``$KVPATH_TEST_ARTIFACTS`` when set; returns where it is kept."""
    dest_dir = os.environ.get("KVPATH_TEST_ARTIFACTS")
    if not dest_dir:
        return path
    dest = Path(dest_dir) / path.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dest)
    return dest


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[webdriver.Chrome]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new",
                "--no-sandbox",  # root (CI) cannot use the sandbox; the page is our own local file
                "--disable-gpu", "--disable-dev-shm-usage", f"--window-size={WIDTH},1000",
                f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # explicit paths: selenium's driver manager (which would try the network) is not used
    d = webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))
    d.set_page_load_timeout(LOAD_TIMEOUT_S)
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> report.Report:
    """One small simulated trace (20 requests): one figure of each kind."""
    reqs = list(load_workload("zipf", n=20, qps=30.0, seed=3).requests)
    trace = simulate(SPEC, reqs, ServingConfig(pools=(2, 2), mode="ecmp"), IterationTimeModel.preset())[0]
    return report.write_report([("ecmp.jsonl", trace)], tmp_path_factory.mktemp("report"), dc_delays=[0.0, 0.01],
                               gantt_requests=10, show_progress=False)


# -- the report ----------------------------------------------------------------------------------
def test_the_report_loads_in_chromium_with_every_image_and_no_console_error(
        driver: webdriver.Chrome, written: report.Report, tmp_path: Path) -> None:
    open_page(driver, written.index.resolve().as_uri())
    errors = console_errors(driver)
    page_height = driver.execute_script("return document.documentElement.scrollHeight;")
    shot = screenshot(driver, tmp_path / "report-screenshot.png")  # kept before any check can fail
    logger.info("screenshot of the report: %s", keep(shot))

    assert driver.title == report.PROG
    assert driver.find_element(By.TAG_NAME, "h1").text == report.PROG
    assert {s.get_attribute("id") for s in driver.find_elements(By.TAG_NAME, "section")} == set(report.KINDS)
    assert len(driver.find_elements(By.CSS_SELECTOR, "#summary tbody tr")) == 1

    written_figures = [p.name for ps in written.figures.values() for p in ps]
    shown = images(driver)
    assert len(written_figures) == len(report.KINDS) and not written.notes  # one figure of each kind
    assert len(shown) == len(written_figures) > 0
    assert sorted(im["src"] for im in shown) == sorted(written_figures)
    assert image_problems(driver) == []
    assert errors == []

    with Image.open(shot) as im:
        assert im.format == "PNG" and im.width >= WIDTH // 2
        assert im.height >= min(page_height, MAX_HEIGHT)  # the whole page, not its first screen
        colours = im.convert("RGB").getcolors(maxcolors=1 << 16)
    assert shot.stat().st_size > 20_000
    assert colours is None or len(colours) > 64, f"the screenshot is nearly one colour: {colours[:4]}"


# -- the checks can fail ------------------------------------------------------------------------------
def test_the_checks_report_a_broken_image_and_a_console_error(driver: webdriver.Chrome, written: report.Report,
                                                              tmp_path: Path) -> None:
    good = written.figures["gantt"][0]
    shutil.copyfile(good, tmp_path / good.name)
    (tmp_path / "broken.html").write_text(
        f'<!doctype html><html><head><title>broken</title></head><body><img src="{good.name}" alt="fine">'
        '<img src="missing.png" alt="missing"></body></html>')
    (tmp_path / "console.html").write_text(
        f'<!doctype html><html><head><title>console</title></head><body><img src="{good.name}" alt="fine">'
        '<script>console.error("kvpath-test: x")</script></body></html>')

    open_page(driver, (tmp_path / "broken.html").as_uri())
    problems = image_problems(driver)
    assert len(problems) == 1 and problems[0].startswith("missing.png: ") and "natural=0x0" in problems[0]
    assert any("missing.png" in e for e in console_errors(driver))  # the failed load is logged too

    open_page(driver, (tmp_path / "console.html").as_uri())
    assert image_problems(driver) == []
    errors = console_errors(driver)
    assert len(errors) == 1 and "kvpath-test: x" in errors[0] and errors[0].startswith("console-api: ")
