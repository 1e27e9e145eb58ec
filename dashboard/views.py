"""The dashboard's pages: what each one shows of a SpindState, inside one fragment that re-reads the daemon
once a second (only the fragment reruns, in place).

    Overview      tokens per second, switches per minute, KV precompute, queues, latency medians, workers busy
    Selection     epoch, stage and slot; estimated goodput per request x drafter (with its legend); requests per
                  drafter against its capacity
    Requests      the requests in the daemon now: the drafter each ran with, the selector's pick, its tokens
    Drafters      each configured drafter: worker, capacity, drafted and accepted tokens; accepted by position
    Verify cost   the learning selector's verify-cost line and how well it predicts
    Occupancy     what each worker did over the last 30 s, and its busy share
    Throughput    goodput, acceptance and mean accepted length per drafter over time; queues
    Latency       TTFT and request latency percentiles
    Workers       device, model, dtype, memory, health, restarts, hangs the watchdog killed

Every page renders whatever the first snapshot holds: a chart is drawn only from a frame with rows, and where
there are none (a daemon that just started, or idle) the page says so in words next to what it does have; it
never returns before its headline numbers. Rates are over the sidebar's window (`rates`), and say "idle" when
nothing happened in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import streamlit as st

from spind.dashboard import charts
from spind.dashboard.names import drafter_label
from spind.dashboard.rates import CounterWindow, Rates, rate_text, window_from_env, window_rates
from spind.dashboard.source import Unavailable, fetch_state
from spind.state import SpindState

REFRESH_S = 1.0
# the sidebar's widgets (app.py), read by every page's fragment
URL_KEY, API_KEY_KEY, WINDOW_KEY = "url", "api_key", "window_s"
SWITCH_COUNTS_KEY = "switch_counts"  # daemon URL -> CounterWindow of the selector's switches, across page changes


# ---- the live fragment -----------------------------------------------------------------------------------------
def switch_counter(url: str) -> CounterWindow:
    """This browser session's samples of the daemon's switch count (kept across pages: st.session_state)."""
    by_url = st.session_state.setdefault(SWITCH_COUNTS_KEY, {})
    return by_url.setdefault(url, CounterWindow())


@st.fragment(run_every=REFRESH_S)
def live(page: str) -> None:
    """Read the daemon and draw `page`; Streamlit reruns only this, once a second."""
    url, api_key = st.session_state.get(URL_KEY, ""), st.session_state.get(API_KEY_KEY, "")
    window_s = float(st.session_state.get(WINDOW_KEY) or window_from_env())
    state = fetch_state(url, api_key)
    if isinstance(state, Unavailable):
        st.error(f"**{state.title}.** {state.detail}", icon="🔌")
        return
    rates = window_rates(state, window_s, switch_counter(url))
    status_line(state, url, rates)
    RENDER[page](state, rates)


def status_line(state: SpindState, url: str, rates: Rates) -> None:
    serving = "failed: " + state.failure if state.failure else ("serving" if state.accepting else "not accepting")
    idle = f" · **idle**: nothing ran in the last {rates.window_s:g} s" if rates.idle else ""
    st.caption(f"model **{state.model}** at {url} · {serving} · {state.num_running} running, "
               f"{state.num_waiting} waiting{idle} · updated {time.strftime('%H:%M:%S')}")


def rate_metric(col, label: str, value: str, rates: Rates, help: str) -> None:
    """A windowed rate; 'idle' under it when nothing ran in the window (so a 0 reads as idle, not as broken)."""
    col.metric(label, value, delta="idle" if rates.idle else None, delta_color="off", delta_arrow="off",
               help=f"{help}, over the last {rates.window_s:g} s")


def switches_text(state: SpindState, rates: Rates) -> str:
    if state.selection is None or state.selection.num_switches is None:
        return "-"  # a selector that counts no switches
    return rate_text(rates.switches_per_min, "/min") if rates.switches_per_min is not None else "measuring…"


def show(chart, key: str) -> None:
    """An Altair chart across the page, at the height it asks for (a fixed one, or a step per row), in a container
    the browser test finds by its key."""
    with st.container(key=f"chart-{key}"):
        st.altair_chart(chart, width="stretch", height=chart.height if isinstance(chart.height, int) else "content")


def section(title: str, empty: bool, note: str, draw) -> None:
    """A titled chart, or where its data is empty the note saying why: a page never shows an empty chart."""
    st.subheader(title)
    if empty:
        st.info(note)
    else:
        draw()


def table(df, key: str) -> None:
    with st.container(key=f"table-{key}"):
        st.table(df, hide_index=True)


def _ms_pair(ms: dict[str, float]) -> str:
    return f"{ms['p50']:,.0f} / {ms['p99']:,.0f} ms" if ms else "-"


# ---- pages ----------------------------------------------------------------------------------------------------
def overview(state: SpindState, rates: Rates) -> None:
    cols = st.columns(4)
    rate_metric(cols[0], "Generated", rate_text(rates.committed_tok_s, "tok/s"), rates, "committed tokens per second")
    rate_metric(cols[1], "Prefilled", rate_text(rates.prefill_tok_s, "tok/s", 0), rates, "prompt tokens admitted")
    rate_metric(cols[2], "Switches / min", switches_text(state, rates), rates,
                "drafter switches of running requests per minute")
    rate_metric(cols[3], "KV precompute", rate_text(rates.precompute_ms_per_s, "ms/s"), rates,
                "worker milliseconds per second spent catching drafters' KV up ahead of a switch")
    cols = st.columns(4)
    cols[0].metric("Running", state.num_running)
    cols[1].metric("Waiting", state.num_waiting)
    cols[2].metric("TTFT p50 / p99", _ms_pair(state.latency.ttft_ms),
                   help=f"time to first token, last {state.latency.num_requests} finished requests")
    cols[3].metric("Latency p50 / p99", _ms_pair(state.latency.latency_ms),
                   help=f"arrival to last token, last {state.latency.num_requests} finished requests")
    cols = st.columns(max(1, len(state.workers)))
    for col, w in zip(cols, state.workers):
        rate_metric(col, f"{w.name} busy", f"{rates.busy.get(w.name, 0.0):.0%}", rates, "share of the time busy")
    left, right = st.columns(2)
    with left:
        st.subheader("Tokens per second")
        show(charts.tokens_chart(state), "tokens")
    with right:
        st.subheader("Requests running and waiting")
        show(charts.queue_chart(state), "queue")


def selection(state: SpindState, rates: Rates) -> None:
    sel = state.selection
    if sel is None:
        st.info("The selector has not started yet: the daemon is still loading its workers.")
        return
    st.caption(f"policy **{sel.policy}**" + ("" if sel.num_slots is None else f" · {sel.num_slots:,} slots selected"))
    cols = st.columns(5)
    cols[0].metric("Epoch", "-" if sel.epoch is None else sel.epoch)
    cols[1].metric("Stage", {"explore": "exploration", "exploit": "exploitation"}.get(sel.stage, sel.stage or "-"))
    cols[2].metric("Slot in stage", "-" if sel.slot_in_stage is None else f"{sel.slot_in_stage} / {sel.stage_slots}")
    rate_metric(cols[3], "Switches / min", switches_text(state, rates), rates,
                "drafter switches of running requests per minute")
    rate_metric(cols[4], "KV precompute", rate_text(rates.precompute_ms_per_s, "ms/s"), rates,
                f"worker ms per second catching drafters' KV up ahead of a switch "
                f"({sel.precompute_s:.2f} s since start)")
    left, right = st.columns([3, 2])
    with left:
        st.subheader("Estimated goodput, request × drafter (tok/s)")
        if sel.estimates:
            show(charts.estimate_heatmap(sel), "estimates")
        elif sel.epoch is None:
            st.info(f"The {sel.policy} selector keeps no estimates; the learning selector (lbss) fills this in.")
        else:
            st.info("No request is running, so there is nothing to estimate (idle).")
        st.caption(charts.HEATMAP_LEGEND)
    with right:
        st.subheader("Requests per drafter vs capacity")
        show(charts.assignment_chart(state), "assignment")
        st.caption("Bars: requests the selector gave each drafter at its last slot; red ticks: the drafter's capacity "
                   "B_j then (none (plain) has none).")


def requests(state: SpindState, rates: Rates) -> None:
    cols = st.columns(3)
    cols[0].metric("Running", state.num_running)
    cols[1].metric("Waiting", state.num_waiting)
    rate_metric(cols[2], "Generated", rate_text(rates.committed_tok_s, "tok/s"), rates, "committed tokens per second")
    df = charts.requests_frame(state)
    section("Requests in the daemon now", df.empty,
            "No request is running or waiting (idle). Send one, e.g. `spind generate --prompt hello`.",
            lambda: table(df, "requests"))
    st.caption("drafter / k: what the request's last verification step drafted with (none (plain): no drafting); "
               "selector's pick: the drafter the selector assigned it for its next slot, named as in the heat map "
               "of the Selection page; asked for: the request's own `drafter` (auto: the selector chooses).")


def drafters(state: SpindState, rates: Rates) -> None:
    df = charts.drafters_frame(state)
    section("Configured drafters (since start)", df.empty,
            "This daemon has no drafters configured: every request decodes plainly (none (plain)).",
            lambda: table(df, "drafters"))
    section("Accepted draft tokens by position", charts.accepted_at_frame(state).empty,
            "No drafted token has been accepted yet.", lambda: show(charts.accepted_at_chart(state), "accepted-at"))


def verify_cost(state: SpindState, rates: Rates) -> None:
    """The learning selector's verify-cost line and how well it predicts; a message for a selector without one."""
    summary = charts.verify_cost_summary(state)
    if summary is None:
        policy = state.selection.policy if state.selection is not None else None
        st.info("The daemon's selector reports no verify-cost model" + (f" (policy {policy})." if policy else "."))
        return
    st.caption(summary)
    left, right = st.columns(2)
    with left:
        section("Verify cost model (ms vs tokens)", charts.verify_cost(state) is None,
                "The verify cost is not fitted yet.", lambda: show(charts.verify_cost_chart(state), "verify-cost"))
    with right:
        section("Verify time, predicted vs measured", charts.verify_fit_frame(state).empty,
                "No verify forward has been timed yet.", lambda: show(charts.verify_fit_chart(state), "verify-fit"))
    section("Draft confidence, calibrated (each slot's drafts are cut where a token's chance no longer pays)",
            charts.calibration_frame(state).empty,
            "No drafter's confidence is calibrated yet (it needs greedy requests' shadow drafts).",
            lambda: show(charts.calibration_chart(state), "calibration"))


def occupancy(state: SpindState, rates: Rates) -> None:
    cols = st.columns(max(1, len(state.workers)))
    for col, w in zip(cols, state.workers):
        rate_metric(col, f"{w.name} busy", f"{rates.busy.get(w.name, 0.0):.0%}", rates, "share of the time busy")
    section(f"What each worker did, last {state.window_s:.0f} s", charts.occupancy_frame(state).empty,
            f"No worker did anything in the last {state.window_s:.0f} s (idle).",
            lambda: _occupancy_charts(state))


def throughput(state: SpindState, rates: Rates) -> None:
    cols = st.columns(4)
    rate_metric(cols[0], "Goodput", rate_text(rates.committed_tok_s, "tok/s"), rates, "committed tokens per second")
    rate_metric(cols[1], "Prefill", rate_text(rates.prefill_tok_s, "tok/s", 0), rates, "prompt tokens admitted")
    rate_metric(cols[2], "Acceptance", "-" if rates.acceptance is None else f"{rates.acceptance:.0%}", rates,
                "accepted / drafted tokens")
    rate_metric(cols[3], "Mean accepted length", rate_text(rates.accepted_length, "tok/step", 2), rates,
                "tokens committed per verification step")
    left, right = st.columns(2)
    with left:
        st.subheader("Goodput per drafter")
        show(charts.goodput_chart(state), "goodput")
        st.subheader("Acceptance rate per drafter")
        _drafter_line(state, "acceptance", "accepted / drafted (%)", "share")
    with right:
        st.subheader("Requests running and waiting")
        show(charts.queue_chart(state), "queue")
        st.subheader("Mean accepted length per drafter")
        _drafter_line(state, "accepted_length", "tokens per verification step", "tokens/step")


def _occupancy_charts(state: SpindState) -> None:
    show(charts.occupancy_timeline(state), "occupancy")
    show(charts.utilisation_chart(state), "utilisation")


def _drafter_line(state: SpindState, field: str, title: str, unit: str) -> None:
    if charts.per_drafter_frame(state, field).empty:
        st.info(f"No drafted token in the last {state.window_s:.0f} s.")
    else:
        show(charts.per_drafter_line(state, field, title, unit), field.replace("_", "-"))


def latency(state: SpindState, rates: Rates) -> None:
    lat = state.latency
    if not lat.num_requests:
        st.info("No request has finished yet.")
        return
    st.subheader(f"Percentiles over the last {lat.num_requests:,} finished requests")
    table(charts.latency_frame(state), "latency")
    show(charts.latency_chart(state), "latency")


def workers(state: SpindState, rates: Rates) -> None:
    st.subheader("Worker processes")
    table(charts.workers_frame(state.workers, rates.busy), "workers")
    st.caption(f"busy: share of the last {rates.window_s:g} s · hung (killed): times the watchdog restarted it · "
               f"drafters: " + ", ".join(f"{drafter_label(n)} on {d.worker}" for n, d in state.drafters.items()))


# ---- navigation -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PageSpec:
    key: str  # its URL path, the container key of its content, its renderer in RENDER
    title: str
    icon: str
    render: Callable[[SpindState, Rates], None]


PAGES = (PageSpec("overview", "Overview", ":material/dashboard:", overview),
         PageSpec("selection", "Selection", ":material/alt_route:", selection),
         PageSpec("requests", "Requests", ":material/list:", requests),
         PageSpec("drafters", "Drafters", ":material/edit_note:", drafters),
         PageSpec("verify-cost", "Verify cost", ":material/functions:", verify_cost),
         PageSpec("occupancy", "Occupancy", ":material/view_timeline:", occupancy),
         PageSpec("throughput", "Throughput", ":material/speed:", throughput),
         PageSpec("latency", "Latency", ":material/timer:", latency),
         PageSpec("workers", "Workers", ":material/memory:", workers))
RENDER = {p.key: p.render for p in PAGES}


def page(spec: PageSpec) -> None:
    """One page: its title, then its live content in a container keyed by the page."""
    st.title(spec.title)
    with st.container(key=f"page-{spec.key}"):
        live(spec.key)


def navigation_pages() -> list:
    """The st.Page of each page, Overview first and the default."""
    def runner(spec: PageSpec) -> Callable[[], None]:
        def run() -> None:
            page(spec)
        run.__name__ = spec.key.replace("-", "_")
        return run

    return [st.Page(runner(p), title=p.title, icon=p.icon, url_path=p.key, default=i == 0)
            for i, p in enumerate(PAGES)]
