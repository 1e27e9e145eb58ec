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
    assert "This daemon's selector reports no verify-cost model." in [c.value for c in at.caption]  # recorded before
    # workers: one row each, alive, with memory
    workers = at.dataframe[-1].value
    assert list(workers["worker"]) == [w.name for w in state.workers]
    assert set(workers["health"]) == {"alive"} and (workers["memory (MiB)"] > 0).all()
    assert summarize_state(state)[1].startswith(f"selection: lbss, epoch {sel.epoch}")


VERIFY_COST = {"c0_ms": 10.0, "per_request_ms": 0.5, "per_token_ms": 0.25, "prior_points": 6, "observations": 42.0}
VERIFY_FIT = [[11.0, 12.5], [13.25, 12.0], [14.0, 15.5]]


def with_pricing(raw: dict, **keys) -> dict:
    """A recorded snapshot whose lbss selector also reports batch pricing (the keys of a newer daemon)."""
    priced = {"batch_pricing": True, "price": 812.345, "verify_cost": VERIFY_COST, "verify_fit": VERIFY_FIT} | keys
    return raw | {"selector": raw["selector"] | priced}


def test_verify_cost_frame_is_the_fitted_line_for_each_batch_size():
    from spind.dashboard import charts

    df = charts.verify_cost_frame(decode_state(with_pricing(snapshot("busy"))))
    assert list(df.columns) == ["requests", "tokens", "predicted_ms"]
    assert sorted(set(df["requests"])) == [1, 4, 8, 16]
    for b, rows in df.groupby("requests"):
        assert list(rows["tokens"]) == [b * m for m in range(1, 10)]  # T from B to 9B
        assert list(rows["predicted_ms"]) == pytest.approx([10.0 + 0.5 * b + 0.25 * t for t in rows["tokens"]])
    assert charts.verify_cost_frame(decode_state(with_pricing(snapshot("busy"))), batches=(2,))[
        "predicted_ms"].iloc[-1] == pytest.approx(10.0 + 0.5 * 2 + 0.25 * 18)
    # a batch size with its own line (a newer daemon's by_batch) is drawn with it; the others keep the global line
    own = VERIFY_COST | {"by_batch": {"1": {"c0_ms": 5.0, "per_token_ms": 1.2, "observations": 9.0}}}
    df = charts.verify_cost_frame(decode_state(with_pricing(snapshot("busy"), verify_cost=own)))
    assert list(df[df["requests"] == 1]["predicted_ms"]) == pytest.approx([5.0 + 1.2 * t for t in range(1, 10)])
    assert list(df[df["requests"] == 4]["predicted_ms"]) == pytest.approx([12.0 + 0.25 * 4 * m for m in range(1, 10)])
    assert charts.verify_cost_summary(decode_state(with_pricing(snapshot("busy"), verify_cost=own))).endswith(
        " · ms per token by batch size B=1: 1.2")


def test_verify_fit_frame_is_predicted_and_measured_per_forward_oldest_first():
    from spind.dashboard import charts

    df = charts.verify_fit_frame(decode_state(with_pricing(snapshot("busy"))))
    assert df.to_dict("records") == [{"forward": i, "predicted_ms": p, "measured_ms": m}
                                     for i, (p, m) in enumerate(VERIFY_FIT)]
    # a pair with an unknown side (NaN is encoded as null) or of the wrong shape is left out; the rest keep their place
    odd = decode_state(with_pricing(snapshot("busy"), verify_fit=[[None, 3.0], [1.0], [2.0, 4.0]]))
    assert charts.verify_fit_frame(odd).to_dict("records") == [{"forward": 2, "predicted_ms": 2.0, "measured_ms": 4.0}]


def test_verify_cost_summary_names_pricing_price_and_coefficients():
    from spind.dashboard import charts

    text = charts.verify_cost_summary(decode_state(with_pricing(snapshot("busy"))))
    assert text == ("batch pricing **on** · price 812.3 tok/s · verify ms = 10 + 0.5·B + 0.25·T "
                    "(6 profile points, 42 forwards observed)")
    cut = decode_state(with_pricing(snapshot("busy"), cut_slots={"shorter": 12, "plain": 30}))
    assert " · drafts cut to what pays: 12 request slots shortened, 30 made plain · " in charts.verify_cost_summary(cut)
    unfitted = decode_state(with_pricing(snapshot("busy"), batch_pricing=False, price=0.0, verify_cost=None))
    assert charts.verify_cost_summary(unfitted) == "batch pricing **off** · no price yet · verify cost not fitted yet"
    assert charts.verify_cost(unfitted) is None and charts.verify_cost_frame(unfitted).empty


def test_verify_cost_is_absent_for_other_selectors_and_older_daemons():
    from spind.dashboard import charts

    older = snapshot("busy")  # recorded before the selector priced the batch: none of the keys
    static = older | {"selector": {"policy": "static"}}
    none = older | {"selector": None}
    for raw in (older, static, none):
        state = decode_state(raw)
        assert charts.verify_cost(state) is None and charts.verify_cost_summary(state) is None
        assert charts.verify_cost_frame(state).empty and charts.verify_fit_frame(state).empty
        assert all(c.to_dict() for c in (charts.verify_cost_chart(state), charts.verify_fit_chart(state)))  # they build


def test_priced_selector_shows_the_verify_cost_line_and_its_fit(stand_in):
    at = page(stand_in(with_pricing(snapshot("busy"))).url)
    assert not at.exception and not at.error
    subheaders = [s.value for s in at.subheader]
    assert "Verify cost model (ms vs tokens)" in subheaders and "Verify time, predicted vs measured" in subheaders
    assert any(c.value.startswith("batch pricing **on** · price 812.3 tok/s") for c in at.caption)
    assert num_charts(at) == 10  # the busy page's 8, the cost line, predicted vs measured
    at = page(stand_in(with_pricing(snapshot("busy"), verify_cost=None, verify_fit=[])).url)
    assert not at.exception and num_charts(at) == 8
    assert {"The verify cost is not fitted yet.", "No verify forward has been timed yet."} <= {i.value for i in at.info}


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
