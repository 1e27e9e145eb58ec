"""Discrete-event simulation of SSM selection: replay any selector against per-request, per-arm outcome
distributions, synthetic (`workloads.py`) or profiled from real runs (`workload.py`), and measure its goodput,
switches and regret against the oracle (`simulator.py`)."""
