"""spind's live dashboard: `spind dashboard`, or `streamlit run dashboard/app.py [-- --url URL --config FILE]`.

The sidebar holds the daemon's address and API key (defaults: the config's daemon); the sections below re-read
GET /v1/spind/state once a second inside one fragment, so only they rerun, in place:
    Selection           epoch, stage and slot of the selector; estimated goodput per request x arm; requests per
                        drafter against its capacity; switches per minute; KV precompute time; with lbss, batch
                        pricing, its price and the verify-cost line, predicted vs measured verify ms per forward
    Pipeline occupancy  what each worker did over the last 30 s, and its busy share
    Throughput          goodput, acceptance rate and mean accepted length per drafter over time; queues; TTFT and
                        latency percentiles
    Workers             device, model, dtype, memory, health, restarts, hangs the watchdog killed
"""

from __future__ import annotations

import argparse
import sys
import time

import streamlit as st

from spind.dashboard import charts
from spind.dashboard.source import Unavailable, fetch_state
from spind.frontend.daemon_cli import daemon_url, load_daemon_config
from spind.state import SpindState

REFRESH_S = 1.0
RECENT_S = 5  # the headline numbers average the last few whole seconds
# Streamlit fades what a running script has not redrawn yet; on a page redrawn every second, on a busy
# machine, that fade is a flicker. The numbers a second old are still the right ones to show.
NO_STALE_FADE = "<style>[data-stale='true'] { opacity: 1 !important; transition: none !important; }</style>"


@st.cache_resource
def defaults(argv: tuple[str, ...]) -> tuple[str, str, str | None]:
    """(daemon URL, API key, why the config could not be read) from `-- --url ... --config ...` and the config
    (the embedded one by default)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--url", default=None)
    p.add_argument("--config", default=None)
    args, _ = p.parse_known_args(list(argv))
    try:
        cfg = load_daemon_config(argparse.Namespace(config=args.config, run_dir=None))
    except (ValueError, OSError) as e:  # a ConfigError or an unreadable file: the sidebar can still name a daemon
        return args.url or "http://127.0.0.1:8000", "", f"cannot read the config: {e}"
    return args.url or daemon_url(cfg), cfg.server.api_key, None


def main() -> None:
    st.set_page_config(page_title="spind", page_icon="⚡", layout="wide")
    st.html(NO_STALE_FADE)
    url, api_key, problem = defaults(tuple(sys.argv[1:]))
    with st.sidebar:
        if problem:
            st.warning(problem)
        st.header("Daemon")
        url = st.text_input("Address", value=url, key="url")
        api_key = st.text_input("API key", value=api_key, type="password", key="api_key",
                                help="[server].api_key of the daemon's config; empty when it has none")
        st.caption(f"Refreshes every {REFRESH_S:g} s.")
    st.title("spind")
    live(url, api_key)


@st.fragment(run_every=REFRESH_S)
def live(url: str, api_key: str) -> None:
    state = fetch_state(url, api_key)
    if isinstance(state, Unavailable):
        st.error(f"**{state.title}.** {state.detail}", icon="🔌")
        return
    serving = "failed: " + state.failure if state.failure else ("serving" if state.accepting else "not accepting")
    st.caption(f"model **{state.model}** at {url} · {serving} · {state.num_running} running, "
               f"{state.num_waiting} waiting · updated {time.strftime('%H:%M:%S')}")
    with st.container(key="selection"):
        selection_section(state)
    with st.container(key="occupancy"):
        occupancy_section(state)
    with st.container(key="throughput"):
        throughput_section(state)
    with st.container(key="workers"):
        workers_section(state)


def selection_section(state: SpindState) -> None:
    st.header("Selection")
    sel = state.selection
    if sel is None:
        st.info("The selector has not started yet.")
        return
    st.caption(f"policy **{sel.policy}**" + ("" if sel.num_slots is None else f" · {sel.num_slots:,} slots selected"))
    cols = st.columns(5)
    cols[0].metric("Epoch", "-" if sel.epoch is None else sel.epoch)
    cols[1].metric("Stage", {"explore": "exploration", "exploit": "exploitation"}.get(sel.stage, sel.stage or "-"))
    cols[2].metric("Slot in stage", "-" if sel.slot_in_stage is None else f"{sel.slot_in_stage} / {sel.stage_slots}")
    cols[3].metric("Switches / min", "-" if sel.switches_per_minute is None else f"{sel.switches_per_minute:.1f}")
    cols[4].metric("KV precompute", f"{sel.precompute_s:.2f} s",
                   help="worker time spent catching drafters' KV up ahead of a switch, since start")
    left, right = st.columns([3, 2])
    with left:
        st.subheader("Estimated goodput (tok/s), request × drafter@k")
        if sel.estimates:
            show(charts.estimate_heatmap(sel))
        elif sel.epoch is None:
            st.info(f"The {sel.policy} selector keeps no estimates; the learning selector (lbss) fills this in.")
        else:
            st.info("No request is running.")
    with right:
        st.subheader("Assignment vs capacity")
        show(charts.assignment_chart(state))
    verify_cost_part(state)


def verify_cost_part(state: SpindState) -> None:
    """The learning selector's verify-cost line and how well it predicts; nothing for a selector without one,
    a caption for an lbss selector of a daemon that reports none."""
    summary = charts.verify_cost_summary(state)
    if summary is None:
        if state.selection is not None and state.selection.policy == "lbss":
            st.caption("This daemon's selector reports no verify-cost model.")
        return
    st.caption(summary)
    left, right = st.columns(2)
    with left:
        st.subheader("Verify cost model (ms vs tokens)")
        if charts.verify_cost(state) is None:
            st.info("The verify cost is not fitted yet.")
        else:
            show(charts.verify_cost_chart(state))
    with right:
        st.subheader("Verify time, predicted vs measured")
        if charts.verify_fit_frame(state).empty:
            st.info("No verify forward has been timed yet.")
        else:
            show(charts.verify_fit_chart(state))


def occupancy_section(state: SpindState) -> None:
    st.header("Pipeline occupancy")
    cols = st.columns(max(1, len(state.workers)))
    for col, w in zip(cols, state.workers):
        col.metric(f"{w.name} busy", f"{w.utilisation:.0%}", help=f"share of the last {state.window_s:.0f} s")
    show(charts.occupancy_timeline(state))
    show(charts.utilisation_chart(state))


def throughput_section(state: SpindState) -> None:
    st.header("Throughput")
    recent = state.throughput[-RECENT_S:]
    seconds = max(1, len(recent))
    counts = [c for s in recent for c in s.drafters.values()]
    committed, drafted = sum(c.num_committed for c in counts), sum(c.num_drafted for c in counts)
    accepted, steps = sum(c.num_accepted for c in counts), sum(c.num_steps for c in counts)
    lat = state.latency
    cols = st.columns(4)
    cols[0].metric("Goodput", f"{committed / seconds:.1f} tok/s", help=f"committed tokens, last {seconds} s")
    cols[1].metric("Prefill", f"{sum(s.num_prompt_tokens for s in recent) / seconds:.0f} tok/s",
                   help=f"prompt tokens admitted, last {seconds} s")
    cols[2].metric("Acceptance", f"{accepted / drafted:.0%}" if drafted else "-", help="accepted / drafted tokens")
    cols[3].metric("Mean accepted length", f"{(accepted + steps) / steps:.2f}" if steps else "-",
                   help="tokens committed per verification step")
    cols = st.columns(4)
    cols[0].metric("Running", state.num_running)
    cols[1].metric("Waiting", state.num_waiting)
    cols[2].metric("TTFT p50 / p99", _pair(lat.ttft_ms))
    cols[3].metric("Latency p50 / p99", _pair(lat.latency_ms))
    grid = [("Goodput per drafter", charts.goodput_chart(state)),
            ("Acceptance rate per drafter", charts.per_drafter_line(state, "acceptance", "accepted / drafted", ".0%")),
            ("Mean accepted length per drafter",
             charts.per_drafter_line(state, "accepted_length", "tokens per step", ".2f")),
            ("Requests running and waiting", charts.queue_chart(state))]
    for row in (grid[:2], grid[2:]):
        for col, (title, chart) in zip(st.columns(2), row):
            with col:
                st.subheader(title)
                show(chart)
    latency = charts.latency_frame(state)
    if latency.empty:
        st.caption("No request has finished yet.")
    else:
        st.caption(f"Percentiles over the last {lat.num_requests} finished requests")
        st.dataframe(latency, width="content")


def show(chart) -> None:
    """An Altair chart across the page, at the height it asks for (a fixed one, or a step per row)."""
    st.altair_chart(chart, width="stretch", height=chart.height if isinstance(chart.height, int) else "content")


def _pair(ms: dict[str, float]) -> str:
    return f"{ms['p50'] / 1e3:.2f} / {ms['p99'] / 1e3:.2f} s" if ms else "-"


def workers_section(state: SpindState) -> None:
    st.header("Workers")
    st.dataframe(charts.workers_frame(state.workers), hide_index=True)


main()
