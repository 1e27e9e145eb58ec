"""The dashboard end to end, the way a newcomer meets it: the real daemon (embedded default config: real worker
processes, the default model, the lbss selector), `spind dashboard` serving the pages, a mixed workload of chat
and passage-copying requests, and the pages in headless Chromium (selenium + Debian's chromium / chromium-driver).

Each of the nine pages is opened exactly once (one navigation to its URL: its first load, never a refresh or a
retry) while the load runs, and its own content must show: the main chart's Vega marks, the table's rows, the
numbers with their units, drafters named alike everywhere. Overview is opened last and stays open while the load
stops: its rates must read 0 and "idle" within the rate window (SPIND_DASHBOARD_WINDOW_S, 3 s here) of the
daemon's last request. A screenshot of each page goes to SPIND_DASHBOARD_SCREENSHOTS (default
tests/artifacts/dashboard/, not in git).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
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

from spind.dashboard import views  # noqa: E402
from spind.dashboard.names import PLAIN_LABEL  # noqa: E402
from spind.dashboard.rates import WINDOW_ENV  # noqa: E402

SCREENSHOTS = Path(os.environ.get("SPIND_DASHBOARD_SCREENSHOTS") or Path(__file__).parent / "artifacts" / "dashboard")
WINDOW_S = 3  # the page's rate window: idle rates must reach 0 within it
PAGE_TIMEOUT_S = 90  # a page's content under load, on a small shared machine
IDLE_SLACK_S = 8  # beyond the window: the open second of the throughput samples, the 1 s refresh, a slow machine


def is_up(url: str) -> bool:
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def start_page(daemon_url: str, port: int, window_s: float | None = None) -> Iterator[subprocess.Popen]:
    """`spind dashboard` for the daemon, until the page answers."""
    env = os.environ | ({WINDOW_ENV: str(window_s)} if window_s is not None else {})
    proc = subprocess.Popen([sys.executable, "-m", "spind.cli", "dashboard", "--url", daemon_url, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
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
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1600,1200"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(str(CHROMEDRIVER)))


# ---- reading a page ----------------------------------------------------------------------------------------------
class Page:
    """What the browser shows of one page (its `.st-key-page-KEY` container) at one look."""

    def __init__(self, driver, key: str) -> None:
        self.driver, self.key = driver, key
        self.root = driver.find_element(By.CSS_SELECTOR, f".st-key-page-{key}")
        self.text = self.root.text

    def marks(self, chart: str) -> int:
        """Data marks Vega drew in the chart (paths, symbols, texts of its marks; not axes or legends)."""
        return len(self.root.find_elements(By.CSS_SELECTOR, f".st-key-chart-{chart} svg g.role-mark > *"))

    def rows(self, table: str) -> list[list[str]]:
        return [[td.text for td in tr.find_elements(By.CSS_SELECTOR, "td, th")]
                for tr in self.root.find_elements(By.CSS_SELECTOR, f".st-key-table-{table} table tbody tr")]

    def metrics(self) -> dict[str, tuple[str, str]]:
        """label -> (value, the note under it: "idle" or "")."""
        out = {}
        for m in self.root.find_elements(By.CSS_SELECTOR, "[data-testid=stMetric]"):
            label = m.find_element(By.CSS_SELECTOR, "[data-testid=stMetricLabel]").text.strip()
            value = m.find_element(By.CSS_SELECTOR, "[data-testid=stMetricValue]").text.strip()
            delta = m.find_elements(By.CSS_SELECTOR, "[data-testid=stMetricDelta]")
            out[label] = (value, delta[0].text.strip() if delta else "")
        return out


def number(value: str) -> float | None:
    """The number a metric shows ('1,234.5 tok/s' -> 1234.5; '37%' -> 37); None for '-' or 'measuring…'."""
    found = re.match(r"^-?[\d,]+(\.\d+)?", value)
    return float(found.group(0).replace(",", "")) if found else None


def wait_for(driver, key: str, check: Callable[[Page], list[str]], timeout_s: float = PAGE_TIMEOUT_S) -> Page:
    """Look at the page until `check` finds nothing missing (it returns what is missing); the page is never
    reloaded: its fragment redraws it in place once a second."""
    deadline, missing = time.monotonic() + timeout_s, ["the page's content"]
    while True:
        try:
            page = Page(driver, key)
            missing = check(page)
            if not missing:
                return page
        except Exception as e:  # noqa: BLE001 - the content is not drawn yet, or was redrawn while read
            missing = [f"{type(e).__name__}: {str(e)[:200]}"]
        if time.monotonic() > deadline:
            raise AssertionError(f"page {key}: after {timeout_s} s still missing {missing}")
        time.sleep(0.5)


# ---- what each page must show -----------------------------------------------------------------------------------
def needs(**conditions: bool) -> list[str]:
    return [name for name, ok in conditions.items() if not ok]


def overview(p: Page) -> list[str]:
    m = p.metrics()
    return needs(generated=(number(m.get("Generated", ("",))[0]) or 0) > 0 and m["Generated"][0].endswith(" tok/s"),
                 # a rate, 0 included: where its ledger says no draft pays at this load, selection keeps every
                 # request plain through the 3 s window (the counter's rate itself: test_dashboard.py)
                 switches=number(m.get("Switches / min", ("",))[0]) is not None,
                 precompute=m.get("KV precompute", ("",))[0].endswith(" ms/s"),
                 busy=(number(m.get("target busy", ("",))[0]) or 0) > 0,
                 tokens_chart=p.marks("tokens") > 0, queue_chart=p.marks("queue") > 0)


def selection(p: Page) -> list[str]:
    m = p.metrics()
    return needs(epoch=number(m.get("Epoch", ("",))[0]) is not None, heatmap=p.marks("estimates") > 0,
                 assignment=p.marks("assignment") > 0, legend="Rows: the running requests" in p.text,
                 arm_names=" k=" in p.text and PLAIN_LABEL in p.text and "@" not in p.text)


def requests(p: Page) -> list[str]:
    return needs(rows=len(p.rows("requests")) > 0)


def drafters(p: Page) -> list[str]:
    return needs(rows=len(p.rows("drafters")) >= 2, accepted_chart=p.marks("accepted-at") > 0)


def verify_cost(p: Page) -> list[str]:
    return needs(cost_line=p.marks("verify-cost") > 0, fit=p.marks("verify-fit") > 0,
                 summary="verify ms = " in p.text)


def occupancy(p: Page) -> list[str]:
    return needs(timeline=p.marks("occupancy") > 0, utilisation=p.marks("utilisation") > 0,
                 busy=(number(p.metrics().get("target busy", ("",))[0]) or 0) > 0)


def throughput(p: Page) -> list[str]:
    m = p.metrics()
    return needs(goodput=(number(m.get("Goodput", ("",))[0]) or 0) > 0, goodput_chart=p.marks("goodput") > 0,
                 acceptance_chart=p.marks("acceptance") > 0, length_chart=p.marks("accepted-length") > 0,
                 queue_chart=p.marks("queue") > 0)


def latency(p: Page) -> list[str]:
    rows = p.rows("latency")
    return needs(rows=[r[0] for r in rows] == ["time to first token", "request latency"]
                 and all(number(c) for r in rows for c in r[1:]), chart=p.marks("latency") > 0)


def workers(p: Page) -> list[str]:
    rows = p.rows("workers")
    return needs(rows=[r[:2] for r in rows] == [["target", "alive"], ["draft", "alive"]]
                 and all(r[7].endswith(" MiB") for r in rows))


CHECKS = {"selection": selection, "requests": requests, "drafters": drafters, "verify-cost": verify_cost,
          "occupancy": occupancy, "throughput": throughput, "latency": latency, "workers": workers,
          "overview": overview}  # overview last: it stays open while the daemon goes idle


def idle(p: Page) -> list[str]:
    m = p.metrics()
    zero = {"Generated": "0.0 tok/s", "Prefilled": "0 tok/s", "Switches / min": "0.0 /min", "KV precompute": "0.0 ms/s",
            "target busy": "0%", "draft busy": "0%"}
    return [f"{label} {m.get(label)}" for label, value in zero.items() if m.get(label) != (value, "idle")] + \
        needs(status="idle: nothing ran in the last" in p.text)


def screenshot(driver, name: str) -> Path:
    """The whole page, however long: the window grown to its height for the shot."""
    height = driver.execute_script("return document.querySelector('[data-testid=stMain]').scrollHeight")
    driver.set_window_size(1600, max(1200, height + 100))
    time.sleep(1.0)  # the charts lay out again at the new size
    path = SCREENSHOTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1600, 1200)
    return path


def page_url(base: str, key: str) -> str:
    return base + ("/" if key == views.PAGES[0].key else f"/{key}")  # the default page is the root


def test_every_page_shows_its_data_on_its_first_load_and_the_rates_fall_to_idle():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert set(CHECKS) == {p.key for p in views.PAGES}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    seen: dict[str, Page] = {}
    with start_daemon() as daemon, start_page(daemon.url, port, window_s=WINDOW_S):
        driver = browser()
        try:
            with MixedLoad(daemon.url, clients=4, max_tokens=32) as load:
                deadline = time.monotonic() + 300
                while daemon.state()["latency"]["num_requests"] < 4:  # a few real requests answered first
                    assert time.monotonic() < deadline and not load.errors, load.errors[:1]
                    time.sleep(0.5)
                for key, check in CHECKS.items():
                    driver.get(page_url(base, key))  # the page's one load
                    seen[key] = wait_for(driver, key, check)
                    text = seen[key].text
                    logs = [e["message"] for e in driver.get_log("browser")]
                    assert "Traceback" not in text and not driver.find_elements(
                        By.CSS_SELECTOR, "[data-testid=stException]"), text[:3000]
                    assert "0.000000" not in text, text
                    assert not [m for m in logs if "Infinite extent" in m], f"{key}: an empty chart: {logs}"
                    screenshot(driver, key)
            # the load has stopped (its clients' last requests answered): Overview, still open, goes idle
            quiet = time.monotonic()
            page = wait_for(driver, "overview", idle, timeout_s=WINDOW_S + IDLE_SLACK_S)
            took = time.monotonic() - quiet
            screenshot(driver, "overview-idle")
        finally:
            driver.quit()
        final = daemon.state()
    assert not load.errors, load.errors[:1]
    assert final["num_running"] == final["num_waiting"] == 0
    assert took <= WINDOW_S + IDLE_SLACK_S and "idle" in page.text
