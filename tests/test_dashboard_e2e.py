"""The dashboard end to end: the real daemon (embedded default config: real worker processes, the default
model, the lbss selector), `spind dashboard` serving the page, a mixed workload of chat and passage-copying
requests, and the page in headless Chromium (selenium + Debian's chromium / chromium-driver): the selection,
occupancy and throughput sections must show live data that changes between two looks. The screenshot is kept
in tests/artifacts/dashboard.png."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon_util import free_port, start_daemon
from dashboard_util import MixedLoad

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                                 reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")]
webdriver = pytest.importorskip("selenium.webdriver")
pytest.importorskip("streamlit")
from selenium.webdriver.common.by import By  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"
LIVE = ("selection", "occupancy", "throughput")


def is_up(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def start_page(daemon_url: str, port: int) -> Iterator[subprocess.Popen]:
    """`spind dashboard` for the daemon, until the page answers."""
    proc = subprocess.Popen([sys.executable, "-m", "spind.cli", "dashboard", "--url", daemon_url, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not is_up(f"http://127.0.0.1:{port}/_stcore/health"):
            assert proc.poll() is None and time.monotonic() < deadline, "the dashboard did not come up"
            time.sleep(0.3)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1600,1200"):
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(str(CHROMEDRIVER)))


def look(driver) -> dict[str, str]:
    """Each live section's visible text."""
    return {key: driver.find_element(By.CSS_SELECTOR, f".st-key-{key}").text for key in LIVE}


def wait_for(driver, ok, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            seen = look(driver)
            if ok(seen):
                return seen
        except Exception:  # noqa: BLE001 - the sections are not on the page yet
            seen = None
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed live data; last look: {seen}")
        time.sleep(0.5)


def is_live(seen: dict[str, str]) -> bool:
    """The target is busy; the draft worker may rightly idle: over the default 4-bit target the model drafters
    cost more than they save, and selection leaves them out (n-gram lookup drafts on the target)."""
    sel, occ, thr = seen["selection"], seen["occupancy"], seen["throughput"]
    return ("Epoch" in sel and "tok/s" in thr and "Goodput\n0.0 tok/s" not in thr and "target busy\n0%" not in occ)


def has_finished(seen: dict[str, str]) -> bool:
    return "Latency p50 / p99\n-" not in seen["throughput"]


def test_the_page_shows_live_selection_occupancy_and_throughput_under_a_mixed_load():
    ARTIFACTS.mkdir(exist_ok=True)
    port = free_port()
    with start_daemon() as daemon, start_page(daemon.url, port):
        driver = browser()
        try:
            driver.get(f"http://127.0.0.1:{port}")
            with MixedLoad(daemon.url, clients=4, max_tokens=32) as load:
                first = wait_for(driver, is_live, 90)
                time.sleep(3)
                second = wait_for(driver, lambda seen: is_live(seen) and has_finished(seen), 60)
                height = driver.execute_script("return document.querySelector('[data-testid=stMain]').scrollHeight")
                driver.set_window_size(1600, max(1200, height + 100))
                time.sleep(1.5)  # the charts lay out again at the new size
                driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))
                body = driver.find_element(By.TAG_NAME, "body").text
                (ARTIFACTS / "dashboard.txt").write_text(body)
                num_charts = len(driver.find_elements(By.CSS_SELECTOR, "[data-testid=stVegaLiteChart]"))
                num_tables = len(driver.find_elements(By.CSS_SELECTOR, ".st-key-workers [data-testid=stDataFrame]"))
        finally:
            driver.quit()
    assert not load.errors, load.errors[:1]
    for key in LIVE:
        assert first[key] != second[key], f"the {key} section did not change between two looks:\n{first[key]}"
    assert "Traceback" not in body, body[body.index("Traceback") - 500:][:3000]
    assert num_charts == 10 and num_tables == 1  # 8, and the verify-cost line and its fit (lbss, profiled)
