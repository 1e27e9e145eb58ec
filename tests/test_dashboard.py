"""The dashboard page (dashboard/app.py) rendered by Streamlit's AppTest from state snapshots recorded from the
real daemon (tests/data/{idle,busy}.json, see tests/dashboard_util.py), served by a stand-in daemon over HTTP;
and the daemon down, the key wrong, the versions apart, and recovery from each."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("altair")
from streamlit.testing.v1 import AppTest  # noqa: E402

from daemon_util import free_port  # noqa: E402
from spind.frontend.daemon_cli import summarize_state  # noqa: E402
from spind.state import STATE_VERSION, decode_state  # noqa: E402

APP = Path(__file__).parents[1] / "dashboard" / "app.py"
DATA = Path(__file__).parent / "data"
SECTIONS = ["Selection", "Pipeline occupancy", "Throughput", "Workers"]


def snapshot(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


class StandIn:
    """GET /v1/spind/state answered with a recorded snapshot, behind an optional API key."""

    def __init__(self, state: dict, api_key: str = "") -> None:
        self.state, self.api_key = state, api_key
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if stand_in.api_key and self.headers.get("Authorization") != f"Bearer {stand_in.api_key}":
                    self._send(401, {"error": {"message": "missing or incorrect API key"}})
                else:
                    self._send(200, stand_in.state)

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in():
    servers = []

    def make(state: dict, api_key: str = "") -> StandIn:
        servers.append(StandIn(state, api_key))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def page(url: str, api_key: str = "") -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.run()  # the sidebar's fields exist after the first run
    at.sidebar.text_input(key="url").set_value(url)
    at.sidebar.text_input(key="api_key").set_value(api_key)
    return at.run()


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def num_charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def test_recorded_snapshots_are_of_this_schema_version():
    for name in ("idle", "busy"):
        assert decode_state(snapshot(name)).version == STATE_VERSION


def test_busy_daemon_shows_every_section_with_its_numbers(stand_in):
    raw = snapshot("busy")
    state = decode_state(raw)
    at = page(stand_in(raw).url)
    assert not at.exception and not at.error
    assert [h.value for h in at.main.header] == SECTIONS
    m = metrics(at)
    sel = state.selection
    # selection: the bandit's epoch, stage and slot, its estimates as a heatmap, the assignment vs capacity
    assert any("policy **lbss**" in c.value for c in at.caption) and m["Epoch"] == str(sel.epoch)
    assert m["Stage"] == {"explore": "exploration", "exploit": "exploitation"}[sel.stage]
    assert m["Slot in stage"] == f"{sel.slot_in_stage} / {sel.stage_slots}"
    assert m["Switches / min"] == f"{sel.switches_per_minute:.1f}" and m["KV precompute"].endswith(" s")
    assert len(sel.estimates) >= 3 and sum(sel.assignment.values()) >= 3
    subheaders = [s.value for s in at.subheader]
    assert any(s.startswith("Estimated goodput") for s in subheaders) and "Assignment vs capacity" in subheaders
    # occupancy: one busy share per worker, from the recorded 30 s window
    for w in state.workers:
        assert m[f"{w.name} busy"] == f"{w.utilisation:.0%}" and w.utilisation > 0
    # throughput: headline numbers, percentiles
    assert float(m["Goodput"].split()[0]) > 0 and m["Running"] == str(state.num_running)
    p50, p99 = state.latency.ttft_ms["p50"] / 1e3, state.latency.ttft_ms["p99"] / 1e3
    assert m["TTFT p50 / p99"] == f"{p50:.2f} / {p99:.2f} s" and m["Latency p50 / p99"].endswith(" s")
    assert num_charts(at) == 8  # heatmap, assignment, timeline, utilisation, goodput, acceptance, length, queues
    # workers: one row each, alive, with memory
    workers = at.dataframe[-1].value
    assert list(workers["worker"]) == [w.name for w in state.workers]
    assert set(workers["health"]) == {"alive"} and (workers["memory (MiB)"] > 0).all()
    assert summarize_state(state)[1].startswith(f"selection: lbss, epoch {sel.epoch}")


def test_idle_daemon_says_nothing_runs(stand_in):
    at = page(stand_in(snapshot("idle")).url)
    assert not at.exception and not at.error
    m = metrics(at)
    assert m["Running"] == "0" and m["Waiting"] == "0" and m["Goodput"] == "0.0 tok/s"
    assert m["TTFT p50 / p99"] == "-" and m["Acceptance"] == "-"
    assert "No request has finished yet." in [c.value for c in at.main.caption]
    assert "No request is running." in [i.value for i in at.info]
    assert list(at.dataframe[-1].value["health"]) == ["alive", "alive"]


def test_daemon_down_is_a_message_and_the_page_recovers(stand_in):
    at = page(f"http://127.0.0.1:{free_port()}")
    assert not at.exception
    assert "not reachable" in at.error[0].value and not at.metric
    server = stand_in(snapshot("busy"))
    at.sidebar.text_input(key="url").set_value(server.url).run()
    assert not at.error and [h.value for h in at.main.header] == SECTIONS


def test_wrong_key_is_a_message_and_the_right_one_recovers(stand_in):
    raw = snapshot("busy")
    server = stand_in(raw, api_key="sesame")
    at = page(server.url, api_key="wrong")
    assert not at.exception and "refused the API key" in at.error[0].value
    at.sidebar.text_input(key="api_key").set_value("sesame").run()
    assert not at.error and metrics(at)["Epoch"] == str(raw["selection"]["epoch"])


def test_another_state_version_is_a_message(stand_in):
    raw = snapshot("busy") | {"version": STATE_VERSION + 1}
    at = page(stand_in(raw).url)
    assert not at.exception and "different spind versions" in at.error[0].value


def test_spind_dashboard_runs_the_installed_page_for_the_configs_daemon(monkeypatch, tmp_path, capsys):
    from spind.cli import main

    config = tmp_path / "config.toml"
    config.write_text('[server]\nport = 8123\napi_key = "sesame"\n')
    calls = []
    monkeypatch.setattr("os.execv", lambda path, argv: calls.append(argv))
    main(["dashboard", "--config", str(config), "--run-dir", str(tmp_path / "run"), "--port", "8600"])
    argv = calls[0]
    assert argv[1:4] == ["-m", "streamlit", "run"] and Path(argv[4]).name == "app.py"
    assert Path(argv[4]).read_text() == APP.read_text()  # the page of this checkout, as installed
    assert argv[argv.index("--server.port") + 1] == "8600"
    assert argv[argv.index("--url") + 1] == "http://127.0.0.1:8123"  # no daemon runs: the config's address
    assert argv[argv.index("--config") + 1] == str(config)
    assert "sesame" not in " ".join(argv)  # the page reads the key from the config, never from a command line
