"""The dashboard's pure parts and its pages.

- Rates over a window (dashboard/rates.py): throughput samples and busy spans made by the coordinator's own
  `History` from a scripted stretch of traffic, then read as the daemon would at later times: every rate is
  the traffic's while it runs and 0 one window after it stops; the switch counter's rate likewise.
- Names (dashboard/names.py): one label per drafter in the heat map, the assignment, the requests table, the
  throughput and occupancy charts; plain decoding "none (plain)".
- Axes: every quantitative axis and legend of every chart has a unit in its title and a d3 format.
- The pages (dashboard/views.py), each rendered by Streamlit's AppTest from state snapshots recorded from the
  real daemon (tests/data/{idle,busy}.json, see tests/dashboard_util.py) and served by a stand-in daemon over
  HTTP; the whole app (dashboard/app.py) with the daemon down, the key wrong, the versions apart, and recovery.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("streamlit")
pytest.importorskip("altair")
from streamlit.testing.v1 import AppTest  # noqa: E402

from daemon_util import free_port  # noqa: E402
from spind import protocol as P  # noqa: E402
from spind.coordinator.history import History  # noqa: E402
from spind.dashboard import charts, views  # noqa: E402
from spind.dashboard.names import PLAIN_LABEL, arm_label, drafter_label, drafter_of  # noqa: E402
from spind.dashboard.rates import (DEFAULT_WINDOW_S, MAX_WINDOW_S, MIN_WINDOW_S, WINDOW_ENV,  # noqa: E402
                                   CounterWindow, rate_text, window_from_env, window_rates)
from spind.frontend.daemon_cli import summarize_state  # noqa: E402
from spind.state import STATE_VERSION, SpindState, decode_state  # noqa: E402

APP = Path(__file__).parents[1] / "dashboard" / "app.py"
DATA = Path(__file__).parent / "data"


def snapshot(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def test_recorded_snapshots_are_of_this_schema_version():
    for name in ("idle", "busy"):
        assert decode_state(snapshot(name)).version == STATE_VERSION


# ---- rates over a window ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


TRAFFIC_FROM, TRAFFIC_TO = 1000, 1020  # seconds of the scripted traffic
STEP_S = 0.05  # one verification step, 3 tokens committed, every 50 ms: 60 tok/s
VERIFY_S = 0.04  # of which the target verifies 40 ms: 80 % busy


def traffic() -> tuple[History, Clock]:
    """The coordinator's History fed 20 s of steady traffic: a step every 50 ms (ngram drafts 4, 2 accepted, 3
    committed), 10 prompt tokens a second, and 5 ms of KV precompute on the draft worker every second."""
    clock = Clock(float(TRAFFIC_FROM))
    history = History(clock=clock)
    for i in range((TRAFFIC_TO - TRAFFIC_FROM) * 20):
        clock.t = TRAFFIC_FROM + i / 20
        history.add_step("ngram", 3, 4, 2)
        history.add_busy("target", P.BusyInterval(kind="verify", start=clock.t, end=clock.t + VERIFY_S))
        if i % 20 == 0:
            history.add_prompt_tokens(10)
            history.add_busy("draft", P.BusyInterval(kind="precompute", start=clock.t, end=clock.t + 0.005,
                                                     drafter="int8"))
        history.add_queue(1, 0)
    return history, clock


def state_at(history: History, clock: Clock, now: float, num_running: int = 0) -> SpindState:
    """The busy snapshot's daemon as it would answer at `now`: History's samples and spans for that time."""
    clock.t = now
    base = decode_state(snapshot("busy"))
    return msgspec.structs.replace(
        base, now=now, num_running=num_running, num_waiting=0, throughput=history.throughput(now),
        workers=[msgspec.structs.replace(w, busy=history.busy_spans(w.name, now)) for w in base.workers])


def test_rates_are_the_traffics_while_it_runs():
    history, clock = traffic()
    rates = window_rates(state_at(history, clock, TRAFFIC_TO, num_running=1), 10.0)
    assert rates.committed_tok_s == pytest.approx(60.0) and rates.prefill_tok_s == pytest.approx(10.0)
    assert rates.acceptance == pytest.approx(0.5) and rates.accepted_length == pytest.approx(3.0)
    assert rates.busy["target"] == pytest.approx(0.8, abs=0.01)
    assert rates.precompute_ms_per_s == pytest.approx(5.0, rel=0.05) and not rates.idle


@pytest.mark.parametrize("window_s", [3.0, 10.0])
def test_rates_fall_with_the_window_and_are_zero_one_window_after_the_traffic(window_s):
    history, clock = traffic()
    half = window_rates(state_at(history, clock, TRAFFIC_TO + window_s / 2), window_s)
    assert 0 < half.committed_tok_s < 60 and 0 < half.busy["target"] < 0.8 and not half.idle
    # a whole window (and the one-second sample still open at its start) after the last step: nothing left
    after = window_rates(state_at(history, clock, TRAFFIC_TO + window_s + 1.0), window_s)
    assert after.committed_tok_s == 0 and after.prefill_tok_s == 0 and after.precompute_ms_per_s == 0
    assert after.busy == {"target": 0.0, "draft": 0.0} and after.acceptance is None and after.idle
    # the snapshot's own 30 s utilisation is still high then: that is what the page used to show
    assert History.utilisation(history.busy_spans("target", clock.t), clock.t) > 0


def test_a_window_longer_than_the_snapshot_is_cut_to_it():
    history, clock = traffic()
    assert window_rates(state_at(history, clock, TRAFFIC_TO), 300.0).window_s == 30.0


def test_switches_per_minute_is_over_the_window_and_falls_to_zero_when_the_count_stops():
    counter = CounterWindow()
    assert counter.per_minute(5.0) is None  # no look yet
    counter.add(100.0, 0)
    assert counter.per_minute(5.0) is None  # one look: no rate yet
    for t in range(101, 121):  # 2 switches a second for 20 s, seen once a second
        counter.add(float(t), 2 * (t - 100))
    assert counter.per_minute(5.0) == pytest.approx(120.0)
    counter.add(122.0, 40)  # quiet from t = 120 on
    assert 0 < counter.per_minute(5.0) < 120
    for t in range(123, 127):
        counter.add(float(t), 40)
    assert counter.per_minute(5.0) == 0.0
    counter.add(127.0, 3)  # a restarted daemon's count: start over, never a negative rate
    assert counter.per_minute(5.0) is None and list(counter.samples) == [(127.0, 3)]


def test_window_rates_feed_the_switch_counter_with_the_snapshots_count():
    history, clock = traffic()
    counter = CounterWindow()
    for t, n in ((1015.0, 10), (1016.0, 16), (1017.0, 22)):
        state = state_at(history, clock, t)
        state = msgspec.structs.replace(state, selection=msgspec.structs.replace(state.selection, num_switches=n))
        rates = window_rates(state, 10.0, counter)
    assert rates.switches_per_min == pytest.approx(360.0)  # 12 switches in 2 s
    static = msgspec.structs.replace(state, selection=msgspec.structs.replace(state.selection, num_switches=None))
    assert window_rates(static, 10.0, CounterWindow()).switches_per_min is None


def test_the_window_comes_from_the_environment_within_what_a_snapshot_covers():
    assert window_from_env({}) == DEFAULT_WINDOW_S
    assert window_from_env({WINDOW_ENV: "4"}) == 4.0
    assert window_from_env({WINDOW_ENV: "0"}) == MIN_WINDOW_S and window_from_env({WINDOW_ENV: "600"}) == MAX_WINDOW_S
    assert window_from_env({WINDOW_ENV: "soon"}) == DEFAULT_WINDOW_S
    assert window_from_env({WINDOW_ENV: "nan"}) == DEFAULT_WINDOW_S


def test_rate_text_has_its_unit_and_a_few_digits():
    assert rate_text(1234.5678, "tok/s") == "1,234.6 tok/s" and rate_text(0.0, "/min") == "0.0 /min"
    assert rate_text(2.0, "tok/step", 2) == "2.00 tok/step"
    assert rate_text(None, "tok/s") == "-" and rate_text(float("nan"), "ms/s") == "-"


# ---- names ------------------------------------------------------------------------------------------------------
def test_drafters_and_arms_have_one_label():
    assert drafter_label("none") == drafter_label(None) == drafter_label("") == PLAIN_LABEL == "none (plain)"
    assert drafter_label("ngram") == "ngram" and drafter_label("int8") == "int8"
    assert arm_label("ngram@4") == "ngram k=4" and arm_label("none") == PLAIN_LABEL
    assert drafter_of("suffix@8") == "suffix" and drafter_of("none") == "none"


def test_every_chart_and_table_names_drafters_alike():
    state = decode_state(snapshot("busy"))
    domain = set(charts.drafter_domain(state))
    assert domain == {PLAIN_LABEL, *state.drafters}
    heat = {a.split(" k=")[0] for a in charts.estimate_frame(state.selection)["arm"]}
    assigned = set(charts.assignment_frame(state)["drafter"])
    ran = set(charts.requests_frame(state)["drafter"])
    picked = {a.split(" k=")[0] for a in charts.requests_frame(state)["selector's pick"]}
    streams = set(charts.goodput_frame(state)["drafter"]) | set(charts.throughput_frame(state)["drafter"])
    occupied = {a.split(" ", 1)[1] for a in charts.occupancy_frame(state)["activity"] if " " in a}
    listed = set(charts.drafters_frame(state)["drafter"])
    for names in (heat, assigned, ran, picked, streams, occupied, listed):
        assert names and names <= domain, names
    assert PLAIN_LABEL in heat and PLAIN_LABEL in assigned and PLAIN_LABEL in ran  # plain decoding, one name
    everything = json.dumps([charts.estimate_frame(state.selection).to_dict(), charts.requests_frame(state).to_dict()])
    assert "@" not in everything and '"none"' not in everything


# ---- axes -------------------------------------------------------------------------------------------------------
def all_charts(state: SpindState) -> dict:
    return {"estimates": charts.estimate_heatmap(state.selection), "assignment": charts.assignment_chart(state),
            "accepted_at": charts.accepted_at_chart(state), "verify_cost": charts.verify_cost_chart(state),
            "verify_fit": charts.verify_fit_chart(state), "occupancy": charts.occupancy_timeline(state),
            "calibration": charts.calibration_chart(state),
            "utilisation": charts.utilisation_chart(state), "goodput": charts.goodput_chart(state),
            "acceptance": charts.per_drafter_line(state, "acceptance", "accepted / drafted (%)", "share"),
            "length": charts.per_drafter_line(state, "accepted_length", "tokens per verification step",
                                              "tokens/step"),
            "tokens": charts.tokens_chart(state), "queue": charts.queue_chart(state),
            "latency": charts.latency_chart(state)}


def encodings(spec: dict):
    """Every encoding of a (layered) Vega-Lite spec."""
    for layer in [spec, *spec.get("layer", [])]:
        yield from layer.get("encoding", {}).items()


def test_every_quantitative_axis_has_a_unit_and_a_format():
    state = decode_state(with_pricing(snapshot("busy")))
    formats = set(charts.AXIS_FORMATS.values())
    checked = 0
    for name, chart in all_charts(state).items():
        for channel, enc in encodings(chart.to_dict()):
            if not isinstance(enc, dict) or enc.get("type") != "quantitative":
                continue
            if not {"title", "axis", "legend"} & set(enc):
                continue  # a layer drawn on another layer's axis (the capacity ticks)
            if channel in ("x", "y"):
                assert enc["axis"]["format"] in formats and enc["title"], (name, channel, enc)
                checked += 1
            elif channel == "color":
                assert enc["legend"]["format"] in formats and enc["title"], (name, channel, enc)
    assert checked == 21  # x and y of 8 charts, one axis of 5 (the other a category), none of the heat map's


def test_axis_titles_say_their_unit():
    state = decode_state(with_pricing(snapshot("busy")))
    specs = {name: chart.to_dict() for name, chart in all_charts(state).items()}
    titles = {name: {c: e.get("title") for c, e in encodings(spec) if c in ("x", "y")} for name, spec in specs.items()}
    assert titles["goodput"]["y"] == "committed tok/s" and titles["goodput"]["x"] == "time (s before now)"
    assert titles["verify_cost"]["y"] == "predicted verify time (ms)"
    assert titles["verify_fit"]["y"] == "verify time (ms)"
    assert titles["calibration"]["y"] == "tokens that survived (share)"
    assert titles["latency"]["x"] == "milliseconds (ms)" and titles["tokens"]["y"] == "tok/s"
    assert titles["acceptance"]["y"].endswith("(%)") and "(%)" in titles["utilisation"]["x"]
    assert charts.AXIS_FORMATS["ms"] == ",.3~r"  # 3 significant digits, trailing zeros trimmed: never 0.000000


def test_tables_show_numbers_with_their_unit_and_few_digits():
    state = decode_state(snapshot("busy"))
    lat = charts.latency_frame(state)
    assert list(lat.columns) == ["measure", "p50 (ms)", "p90 (ms)", "p99 (ms)"]
    assert lat.iloc[0]["p50 (ms)"] == f"{state.latency.ttft_ms['p50']:,.1f}"
    workers = charts.workers_frame(state.workers, {"target": 0.5})
    assert list(workers["busy"]) == ["50%", f"{state.workers[1].utilisation:.0%}"]
    assert all(m.endswith(" MiB") for m in workers["memory"])
    for df in (lat, workers, charts.drafters_frame(state), charts.requests_frame(state)):
        assert "0.000000" not in df.to_string()


VERIFY_COST = {"c0_ms": 10.0, "per_request_ms": 0.5, "per_token_ms": 0.25, "prior_points": 6, "observations": 42.0}
VERIFY_FIT = [[11.0, 12.5], [13.25, 12.0], [14.0, 15.5]]
CALIBRATION = {"ngram": [0.1, 0.1, 0.4, 0.9], "int8": None}  # int8: not calibrated yet


def with_pricing(raw: dict, **keys) -> dict:
    """A recorded snapshot whose lbss selector also reports batch pricing (the keys of a newer daemon)."""
    priced = {"batch_pricing": True, "price": 812.345, "verify_cost": VERIFY_COST, "verify_fit": VERIFY_FIT,
              "calibration": CALIBRATION} | keys
    return raw | {"selector": raw["selector"] | priced}


def test_verify_cost_frame_is_the_fitted_line_for_each_batch_size():
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
    steps = own | {"batch1_position_ms": [1.62, 1.21, 1.2, 1.19]}  # batch 1's draft positions (`StepCurve`)
    assert charts.verify_cost_summary(decode_state(with_pricing(snapshot("busy"), verify_cost=steps))).endswith(
        " · ms per token by batch size B=1: 1.2 · batch 1's draft positions add 1.6, 1.2, 1.2, 1.2 ms")


def test_verify_fit_frame_is_predicted_and_measured_per_forward_oldest_first():
    df = charts.verify_fit_frame(decode_state(with_pricing(snapshot("busy"))))
    assert df.to_dict("records") == [{"forward": i, "predicted_ms": p, "measured_ms": m}
                                     for i, (p, m) in enumerate(VERIFY_FIT)]
    # a pair with an unknown side (NaN is encoded as null) or of the wrong shape is left out; the rest keep their place
    odd = decode_state(with_pricing(snapshot("busy"), verify_fit=[[None, 3.0], [1.0], [2.0, 4.0]]))
    assert charts.verify_fit_frame(odd).to_dict("records") == [{"forward": 2, "predicted_ms": 2.0, "measured_ms": 4.0}]


def test_verify_cost_summary_names_pricing_price_and_coefficients():
    text = charts.verify_cost_summary(decode_state(with_pricing(snapshot("busy"))))
    assert text == ("batch pricing **on** · price 812.3 tok/s · verify ms = 10 + 0.5·B + 0.25·T "
                    "(6 profile points, 42 forwards observed)")
    cut = decode_state(with_pricing(snapshot("busy"), cut_slots={"shorter": 12, "plain": 30}))
    assert " · drafts cut to what pays: 12 request slots shortened, 30 made plain · " in charts.verify_cost_summary(cut)
    idle = decode_state(with_pricing(snapshot("busy"), idle=True, overhead_ms=0.31, dominated=["ngram"]))
    assert (" · selection **idle**: the drafts are worth less than selecting costs (0.31 ms a slot) · left out: ngram "
            "(another free drafter does better on the same text) · ") in charts.verify_cost_summary(idle)
    trial = {"slots": {"select": 900, "plain": 700}, "buckets": {
        "0": {"pairs": 6, "exploited": 40, "advantage": 1.1234, "spread": 0.02, "regime": "select"},
        "2": {"pairs": 9, "exploited": 30, "advantage": 0.951, "spread": 0.01, "regime": "plain"},
        "3": {"pairs": 0, "exploited": 0, "advantage": None, "spread": None, "regime": "select"}}}
    measured = decode_state(with_pricing(snapshot("busy"), regime=trial))
    assert (" · selection vs plain, measured: B=1: 1.12x (6 pairs, select now), B=3-4: 0.95x (9 pairs, plain now) · "
            in charts.verify_cost_summary(measured))
    assert charts.regime_summary({"buckets": {"3": {"pairs": 0, "advantage": None}}}) is None
    assert charts.regime_summary(None) is None and charts.regime_summary({"buckets": []}) is None
    unfitted = decode_state(with_pricing(snapshot("busy"), batch_pricing=False, price=0.0, verify_cost=None))
    assert charts.verify_cost_summary(unfitted) == "batch pricing **off** · no price yet · verify cost not fitted yet"
    assert charts.verify_cost(unfitted) is None and charts.verify_cost_frame(unfitted).empty


def test_verify_cost_is_absent_for_other_selectors_and_older_daemons():
    older = snapshot("busy")  # recorded before the selector priced the batch: none of the keys
    static = older | {"selector": {"policy": "static"}}
    none = older | {"selector": None}
    for raw in (older, static, none):
        state = decode_state(raw)
        assert charts.verify_cost(state) is None and charts.verify_cost_summary(state) is None
        assert charts.verify_cost_frame(state).empty and charts.verify_fit_frame(state).empty
        assert all(c.to_dict() for c in (charts.verify_cost_chart(state), charts.verify_fit_chart(state)))  # they build



# ---- the pages --------------------------------------------------------------------------------------------------
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


def one_page(key: str, url: str) -> None:
    """An AppTest script: the page `key` as st.navigation runs it, with the sidebar's values set."""
    import streamlit as st

    from spind.dashboard import views

    st.session_state.setdefault(views.URL_KEY, url)
    st.session_state.setdefault(views.API_KEY_KEY, "")
    st.session_state.setdefault(views.WINDOW_KEY, 10.0)
    views.page(next(p for p in views.PAGES if p.key == key))


def render(key: str, url: str) -> AppTest:
    at = AppTest.from_function(one_page, args=(key, url), default_timeout=30).run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def num_charts(at: AppTest) -> int:
    return len(at.get("vega_lite_chart"))


def infos(at: AppTest) -> set[str]:
    return {i.value for i in at.info}


def test_there_are_nine_pages_with_their_own_paths():
    assert [p.key for p in views.PAGES] == ["overview", "selection", "requests", "drafters", "verify-cost",
                                            "occupancy", "throughput", "latency", "workers"]
    assert set(views.RENDER) == {p.key for p in views.PAGES}


def test_busy_daemon_every_page_shows_its_data(stand_in):
    raw = snapshot("busy")
    state = decode_state(raw)
    rates = window_rates(state, 10.0)
    url = stand_in(raw).url
    # overview: windowed rates, queues, latency medians, busy shares, two charts
    at = render("overview", url)
    m = metrics(at)
    assert m["Generated"] == rate_text(rates.committed_tok_s, "tok/s") and rates.committed_tok_s > 0
    assert m["KV precompute"] == rate_text(rates.precompute_ms_per_s, "ms/s") and rates.precompute_ms_per_s > 0
    assert m["Switches / min"] == "measuring…"  # the page's first look; a rate from its second on
    assert m["Running"] == str(state.num_running) and m["target busy"] == f"{rates.busy['target']:.0%}"
    assert m["TTFT p50 / p99"] == f"{state.latency.ttft_ms['p50']:,.0f} / {state.latency.ttft_ms['p99']:,.0f} ms"
    assert num_charts(at) == 2 and not any(mm.delta for mm in at.metric)  # busy: nothing says idle
    # selection: the bandit's epoch, stage and slot; the heat map with its legend; the assignment
    at = render("selection", url)
    m, sel = metrics(at), state.selection
    assert any("policy **lbss**" in c.value for c in at.caption) and m["Epoch"] == str(sel.epoch)
    assert m["Stage"] == {"explore": "exploration", "exploit": "exploitation"}[sel.stage]
    assert m["Slot in stage"] == f"{sel.slot_in_stage} / {sel.stage_slots}"
    assert num_charts(at) == 2 and charts.HEATMAP_LEGEND in [c.value for c in at.caption]
    # requests: one row per request, drafters named as in the heat map
    at = render("requests", url)
    table = at.table[0].value
    assert len(table) == len(state.requests) == 4 and set(table["drafter"]) <= set(charts.drafter_domain(state))
    # drafters: one row per configured drafter; the accepted-by-position chart
    at = render("drafters", url)
    assert list(at.table[0].value["drafter"]) == list(state.drafters) and num_charts(at) == 1
    # verify cost: recorded before the selector priced the batch, so it says it has none
    at = render("verify-cost", url)
    assert "The daemon's selector reports no verify-cost model (policy lbss)." in infos(at) and num_charts(at) == 0
    # occupancy: a busy share per worker; the timeline and the utilisation
    at = render("occupancy", url)
    assert metrics(at)["draft busy"] == f"{rates.busy['draft']:.0%}" and num_charts(at) == 2
    # throughput: windowed headline numbers; goodput, acceptance, length, queues
    at = render("throughput", url)
    m = metrics(at)
    assert m["Acceptance"] == f"{rates.acceptance:.0%}" and m["Mean accepted length"].endswith(" tok/step")
    assert num_charts(at) == 4
    # latency: a row per measure, a chart
    at = render("latency", url)
    assert list(at.table[0].value["measure"]) == ["time to first token", "request latency"] and num_charts(at) == 1
    # workers: one row each, alive, with memory
    at = render("workers", url)
    workers = at.table[0].value
    assert list(workers["worker"]) == [w.name for w in state.workers] and set(workers["health"]) == {"alive"}
    assert summarize_state(state)[1].startswith(f"selection: lbss, epoch {sel.epoch}")


def test_idle_daemon_every_page_renders_and_says_so(stand_in):
    raw = snapshot("idle")
    state = decode_state(raw)
    assert window_rates(state, 10.0).idle
    url = stand_in(raw).url
    at = render("overview", url)
    m = metrics(at)
    assert m["Generated"] == "0.0 tok/s" and m["KV precompute"] == "0.0 ms/s" and m["TTFT p50 / p99"] == "-"
    assert {mm.delta for mm in at.metric if mm.label in ("Generated", "Switches / min", "KV precompute")} == {"idle"}
    assert any("**idle**: nothing ran in the last 10 s" in c.value for c in at.caption)
    assert num_charts(at) == 2  # tokens and queues: a line at 0, not an empty box
    at = render("selection", url)
    assert "No request is running, so there is nothing to estimate (idle)." in infos(at) and num_charts(at) == 1
    assert charts.HEATMAP_LEGEND in [c.value for c in at.caption]
    at = render("requests", url)
    assert any(i.startswith("No request is running or waiting (idle).") for i in infos(at)) and not at.table
    at = render("drafters", url)
    assert len(at.table[0].value) == len(state.drafters) and "No drafted token has been accepted yet." in infos(at)
    at = render("occupancy", url)
    assert "No worker did anything in the last 30 s (idle)." in infos(at) and num_charts(at) == 0
    at = render("throughput", url)
    assert infos(at) == {"No drafted token in the last 30 s."} and num_charts(at) == 2  # goodput at 0, queues
    assert metrics(at)["Acceptance"] == "-"
    at = render("latency", url)
    assert infos(at) == {"No request has finished yet."}
    at = render("workers", url)
    assert list(at.table[0].value["health"]) == ["alive", "alive"]


def test_priced_selector_shows_the_verify_cost_line_and_its_fit(stand_in):
    at = render("verify-cost", stand_in(with_pricing(snapshot("busy"))).url)
    subheaders = [s.value for s in at.subheader]
    assert "Verify cost model (ms vs tokens)" in subheaders and "Verify time, predicted vs measured" in subheaders
    assert any(c.value.startswith("batch pricing **on** · price 812.3 tok/s") for c in at.caption)
    assert num_charts(at) == 3
    at = render("verify-cost", stand_in(with_pricing(snapshot("busy"), verify_cost=None, verify_fit=[],
                                                     calibration={"ngram": None})).url)
    assert num_charts(at) == 0
    assert {"The verify cost is not fitted yet.", "No verify forward has been timed yet.",
            "No drafter's confidence is calibrated yet (it needs greedy requests' shadow drafts)."} <= infos(at)


def test_calibration_frame_is_each_calibrated_drafters_curve_by_bin():
    df = charts.calibration_frame(decode_state(with_pricing(snapshot("busy"))))
    assert list(df["confidence"]) == pytest.approx([0.125, 0.375, 0.625, 0.875])  # bin middles
    assert list(df["survival"]) == [0.1, 0.1, 0.4, 0.9] and set(df["drafter"]) == {"ngram"}  # int8: not yet
    bad = with_pricing(snapshot("busy"), calibration={"ngram": [0.1, "x"], "int8": "y"})
    assert charts.calibration_frame(decode_state(bad)).empty  # malformed curves are left out


def app(url: str, api_key: str = "") -> AppTest:
    """The whole app (sidebar, navigation, the default page) pointed at `url`."""
    at = AppTest.from_file(str(APP), default_timeout=30)
    at.run()  # the sidebar's fields exist after the first run
    at.sidebar.text_input(key="url").set_value(url)
    at.sidebar.text_input(key="api_key").set_value(api_key)
    return at.run()


def test_the_app_opens_on_the_overview_with_the_sidebar_and_nine_pages(stand_in):
    at = app(stand_in(snapshot("busy")).url)
    assert not at.exception and not at.error
    assert [t.value for t in at.title] == ["Overview"] and "Generated" in metrics(at)
    assert at.sidebar.number_input(key=views.WINDOW_KEY).value == window_from_env()


def test_daemon_down_is_a_message_and_the_page_recovers(stand_in):
    at = app(f"http://127.0.0.1:{free_port()}")
    assert not at.exception
    assert "not reachable" in at.error[0].value and not at.metric
    server = stand_in(snapshot("busy"))
    at.sidebar.text_input(key="url").set_value(server.url).run()
    assert not at.error and "Generated" in metrics(at)


def test_wrong_key_is_a_message_and_the_right_one_recovers(stand_in):
    raw = snapshot("busy")
    server = stand_in(raw, api_key="sesame")
    at = app(server.url, api_key="wrong")
    assert not at.exception and "refused the API key" in at.error[0].value
    at.sidebar.text_input(key="api_key").set_value("sesame").run()
    assert not at.error and metrics(at)["Running"] == str(raw["num_running"])


def test_another_state_version_is_a_message(stand_in):
    raw = snapshot("busy") | {"version": STATE_VERSION + 1}
    at = app(stand_in(raw).url)
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
