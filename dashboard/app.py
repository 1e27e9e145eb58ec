"""spind's live dashboard: `spind dashboard`, or `streamlit run dashboard/app.py [-- --url URL --config FILE]`.

The sidebar holds the daemon's address and API key (defaults: the config's daemon) and the window the rates
are averaged over (default SPIND_DASHBOARD_WINDOW_S, else 10 s), then the pages (views.py): Overview,
Selection, Requests, Drafters, Verify cost, Occupancy, Throughput, Latency, Workers. Each page re-reads
GET /v1/spind/state once a second inside one fragment, so only its content reruns, in place.

The sidebar is drawn before the page runs on every script run: the page's fragment reads the widgets' values
from st.session_state, which is therefore set before any page asks for it, on the first load of any page.
"""

from __future__ import annotations

import argparse
import sys

import streamlit as st

from spind.dashboard import views
from spind.dashboard.rates import MAX_WINDOW_S, MIN_WINDOW_S, window_from_env
from spind.frontend.daemon_cli import daemon_url, load_daemon_config

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
    pages = st.navigation(views.navigation_pages(), position="sidebar", expanded=True)
    with st.sidebar:
        if problem:
            st.warning(problem)
        st.header("Daemon")
        st.text_input("Address", value=url, key=views.URL_KEY)
        st.text_input("API key", value=api_key, type="password", key=views.API_KEY_KEY,
                      help="[server].api_key of the daemon's config; empty when it has none")
        st.number_input("Rate window (s)", min_value=MIN_WINDOW_S, max_value=MAX_WINDOW_S, value=window_from_env(),
                        step=1.0, format="%g", key=views.WINDOW_KEY,
                        help="tokens/s, switches/min, KV precompute and busy shares are averaged over the last "
                             "this many seconds, so they fall to 0 this long after the daemon goes idle")
        st.caption(f"Refreshes every {views.REFRESH_S:g} s.")
    pages.run()


main()
