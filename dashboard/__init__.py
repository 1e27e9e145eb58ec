"""spind's live dashboard: a Streamlit page over GET /v1/spind/state (`spind dashboard`).

Installed as `spind.dashboard`; only this package imports streamlit and altair (the `dashboard` extra).
    app.py      the page: sidebar, the one-second refresh, the four sections
    source.py   the daemon's state, or why there is none (no streamlit)
    charts.py   state -> pandas frames -> Altair charts (no streamlit)
"""
