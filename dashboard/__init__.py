"""spind's live dashboard: Streamlit pages over GET /v1/spind/state (`spind dashboard`).

Installed as `spind.dashboard`; only this package imports streamlit and altair (the `dashboard` extra).
    app.py      the entry: sidebar (daemon, API key, rate window) and the navigation between the pages
    views.py    the nine pages, each redrawn once a second inside one fragment
    source.py   the daemon's state, or why there is none (no streamlit)
    rates.py    rates over a recent window of the daemon's timestamps, which fall to 0 when it idles (no streamlit)
    names.py    one label per drafter on every page (no streamlit)
    charts.py   state -> pandas frames -> Altair charts and display tables (no streamlit)
"""
