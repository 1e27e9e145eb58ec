"""SpindState -> pandas frames -> Altair charts and display tables, for the pages (no streamlit).

Times are plotted as seconds before the snapshot (`t - state.now`, so -30 .. 0), which needs no agreement between
the page's clock and the daemon's. Every drafter is named by `names` (its configured name, plain decoding
"none (plain)"), with the same colour in every chart. Every quantitative axis and legend says its unit in its
title and carries a d3 format (AXIS_FORMATS): Vega's default prints what a float holds, and a newcomer saw axes
of 0.000000. A chart is only built from a frame that has rows; the pages say "no data yet" instead of drawing an
empty one (an empty Vega chart is a blank box, which read as a page that had not loaded).
"""

from __future__ import annotations

import altair as alt
import pandas as pd

from spind.dashboard.names import PLAIN_LABEL, arm_label, drafter_label, drafter_of, short_id
from spind.state import BUSY_KINDS, SelectionState, SpindState, WorkerState

HEIGHT = 220
MERGE_GAP_S = 0.005  # busy spans of the same activity closer than this are drawn as one bar
# (dark, light) per drafter, in config order (Tableau's paired palette); the target's own work in blue / grey
DRAFTER_COLOURS = [("#f58518", "#ffbf79"), ("#54a24b", "#88d27a"), ("#e45756", "#ff9d98"), ("#b279a2", "#d6a5c9"),
                   ("#439894", "#83bcb6"), ("#d67195", "#fcbfd2"), ("#b79a20", "#f2cf5b")]
VERIFY_COLOUR, PREFILL_COLOUR, PLAIN_COLOUR = "#4c78a8", "#79706e", "#bab0ac"
KIND_COLOURS = alt.Scale(domain=list(BUSY_KINDS), range=["#f58518", VERIFY_COLOUR, PREFILL_COLOUR, "#ffbf79"])

# d3 formats of the axes and legends, by unit: whole seconds, tokens per second, milliseconds (3 significant
# digits, no trailing zeros), shares, counts (with whole-number ticks), tokens per step
AXIS_FORMATS = {"s": "d", "tok/s": ",.0f", "ms": ",.3~r", "share": ".0%", "count": ",d", "tokens/step": ".1f"}
MISSING = "—"  # an unknown cell of a table (st.table reads a bare "-" as a Markdown list bullet)
HEATMAP_LEGEND = ("Rows: the running requests (the last characters of their id, as on the Requests page) · "
                  "columns: a drafter and its draft length k (none (plain) = no drafting) · colour and number: "
                  "the selector's estimated goodput of that request with that drafter, in tok/s; blank = no "
                  "estimate yet.")


def axis(unit: str, **kw) -> alt.Axis:
    """An axis in `unit` (a key of AXIS_FORMATS); counts get whole-number ticks only."""
    return alt.Axis(format=AXIS_FORMATS[unit], **({"tickMinStep": 1} if unit == "count" else {}), **kw)


def legend(unit: str, **kw) -> alt.Legend:
    return alt.Legend(format=AXIS_FORMATS[unit], **kw)


def drafter_domain(state: SpindState) -> list[str]:
    """Plain decoding first, then the configured drafters in config order, as labels."""
    return [PLAIN_LABEL, *map(drafter_label, state.drafters)]


def drafter_colours(state: SpindState) -> alt.Scale:
    """The same colour for a drafter in every chart; plain decoding grey."""
    names = list(state.drafters)
    return alt.Scale(domain=drafter_domain(state),
                     range=[PLAIN_COLOUR, *(DRAFTER_COLOURS[i % len(DRAFTER_COLOURS)][0] for i in range(len(names)))])


def _time_axis(state: SpindState, field: str = "t") -> alt.X:
    return alt.X(f"{field}:Q", scale=alt.Scale(domain=[-state.window_s, 0]), title="time (s before now)",
                 axis=axis("s"))


# ---- selection ------------------------------------------------------------------------------------------------
def estimate_frame(sel: SelectionState) -> pd.DataFrame:
    """request x arm -> the selector's estimated goodput (tok/s; None: no estimate yet)."""
    rows = [{"request": short_id(r), "arm": arm_label(arm), "goodput": g}
            for r, by_arm in sel.estimates.items() for arm, g in by_arm.items()]
    return pd.DataFrame(rows, columns=["request", "arm", "goodput"])


def estimate_heatmap(sel: SelectionState) -> alt.Chart:
    """Estimated goodput (tok/s) per running request x arm; blank = not known yet (HEATMAP_LEGEND)."""
    df = estimate_frame(sel)
    base = alt.Chart(df).encode(
        x=alt.X("arm:N", sort=[arm_label(a) for a in sel.arms], title="drafter and draft length k",
                axis=alt.Axis(labelAngle=-40)),
        y=alt.Y("request:N", title="request"))
    cells = base.mark_rect().encode(
        color=alt.Color("goodput:Q", title="estimated tok/s", scale=alt.Scale(scheme="viridis"),
                        legend=legend("tok/s")),
        tooltip=["request:N", alt.Tooltip("arm:N", title="drafter"),
                 alt.Tooltip("goodput:Q", title="estimated tok/s", format=".1f")])
    labels = base.transform_filter("isValid(datum.goodput)").mark_text(fontSize=10, color="white").encode(
        text=alt.Text("goodput:Q", format=".0f"))
    return (cells + labels).properties(height=alt.Step(22))


def assignment_frame(state: SpindState) -> pd.DataFrame:
    """Requests per drafter at the selector's last slot against its capacity B_j then (plain decoding: unlimited)."""
    sel = state.selection
    assigned: dict[str, int] = {}
    for arm, n in (sel.assignment if sel else {}).items():
        label = drafter_label(drafter_of(arm))
        assigned[label] = assigned.get(label, 0) + n
    capacity = {drafter_label(n): c for n, c in (sel.capacity if sel else {}).items()}
    names = drafter_domain(state)
    return pd.DataFrame({"drafter": names, "requests": [assigned.get(n, 0) for n in names],
                         "capacity": [capacity.get(n) for n in names]})


def assignment_chart(state: SpindState) -> alt.Chart:
    df = assignment_frame(state)
    base = alt.Chart(df).encode(y=alt.Y("drafter:N", sort=list(df["drafter"]), title=None))
    bars = base.mark_bar().encode(
        x=alt.X("requests:Q", title="requests (bar) / capacity B_j (tick)", axis=axis("count")),
        color=alt.Color("drafter:N", scale=drafter_colours(state), legend=None),
        tooltip=["drafter:N", "requests:Q", "capacity:Q"])
    ticks = base.mark_tick(color="crimson", thickness=3, size=22).encode(x="capacity:Q")
    return (bars + ticks).properties(height=alt.Step(26))


def requests_frame(state: SpindState) -> pd.DataFrame:
    """The requests in the daemon now, one row each: the drafter its last step ran with and the arm the selector
    picked for it (they differ for a slot when the pick comes into force at the next one), named as in the heat
    map."""
    picked = {r: v.get("arm") for r, v in ((state.selector or {}).get("requests") or {}).items()
              if isinstance(v, dict)}
    rows = [{"request": short_id(r.req_id), "status": r.status, "drafter": drafter_label(r.drafter),
             "k": str(r.k) if r.k else MISSING,
             "selector's pick": arm_label(picked[r.req_id]) if picked.get(r.req_id) else MISSING,
             "asked for": "auto" if r.requested_drafter == "auto" else drafter_label(r.requested_drafter),
             "prompt tokens": f"{r.num_prompt_tokens:,}", "output tokens": f"{r.num_output_tokens:,}",
             "steps": f"{r.num_steps:,}"} for r in state.requests]
    return pd.DataFrame(rows, columns=["request", "status", "drafter", "k", "selector's pick", "asked for",
                                       "prompt tokens", "output tokens", "steps"])


# ---- drafters -------------------------------------------------------------------------------------------------
def drafters_frame(state: SpindState) -> pd.DataFrame:
    """One row per configured drafter: where it runs, its capacity, and what it drafted since start."""
    rows = [{"drafter": drafter_label(n), "worker": d.worker, "capacity B_j": "unbounded" if d.capacity is None
             else f"{d.capacity:,}", "drafted tokens": f"{d.drafted:,}", "accepted tokens": f"{d.accepted:,}",
             "acceptance": f"{d.accepted / d.drafted:.0%}" if d.drafted else MISSING,
             "steps": f"{d.num_steps:,}",
             "tokens / step": f"{(d.accepted + d.num_steps) / d.num_steps:.2f}" if d.num_steps else MISSING}
            for n, d in state.drafters.items()]
    return pd.DataFrame(rows, columns=["drafter", "worker", "capacity B_j", "drafted tokens", "accepted tokens",
                                       "acceptance", "steps", "tokens / step"])


def accepted_at_frame(state: SpindState) -> pd.DataFrame:
    """Accepted draft tokens per drafter and draft position (1 = the first drafted token), since start."""
    rows = [{"drafter": drafter_label(n), "position": i + 1, "accepted": a}
            for n, d in state.drafters.items() for i, a in enumerate(d.accepted_at) if a]
    return pd.DataFrame(rows, columns=["drafter", "position", "accepted"])


def accepted_at_chart(state: SpindState) -> alt.Chart:
    return alt.Chart(accepted_at_frame(state)).mark_bar().encode(
        x=alt.X("position:O", title="draft position (1 = first drafted token)", axis=alt.Axis(labelAngle=0)),
        xOffset="drafter:N",
        y=alt.Y("accepted:Q", title="accepted tokens since start", axis=axis("count")),
        color=alt.Color("drafter:N", scale=drafter_colours(state)),
        tooltip=["drafter:N", "position:O", alt.Tooltip("accepted:Q", format=",d")]).properties(height=HEIGHT)


# ---- verify cost (lbss with batch pricing) --------------------------------------------------------------------
# state.selector (the selector's own describe()) has batch_pricing, price, verify_cost and verify_fit only from
# the learning selector of a daemon that prices the batch's verify; every function below yields None / an empty
# frame without them.
COST_BATCHES = (1, 4, 8, 16)  # B of the drawn lines
COST_TOKENS_PER_REQUEST = range(1, 10)  # T = B .. 9B: no drafts up to 8 drafted tokens per request
COST_KEYS = ("c0_ms", "per_request_ms", "per_token_ms")
PREDICTED_COLOUR = "#f58518"


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def verify_cost(state: SpindState) -> dict | None:
    """The selector's fitted line verify_ms(B, T) = c0_ms + per_request_ms B + per_token_ms T, or None (another
    policy, an older daemon, no fit yet)."""
    cost = (state.selector or {}).get("verify_cost")
    if not isinstance(cost, dict) or any(_number(cost.get(k)) is None for k in COST_KEYS):
        return None
    return cost


def _batch_line(cost: dict, b: int) -> tuple[float, float]:
    """(intercept, ms per token) of batch size b: its own line where the selector has one (`by_batch`), else the
    global line at b."""
    own = cost.get("by_batch")
    own = own.get(str(b)) if isinstance(own, dict) else None
    if isinstance(own, dict) and _number(own.get("c0_ms")) is not None and _number(own.get("per_token_ms")) is not None:
        return float(own["c0_ms"]), float(own["per_token_ms"])
    return cost["c0_ms"] + cost["per_request_ms"] * b, cost["per_token_ms"]


def verify_cost_frame(state: SpindState, batches: tuple[int, ...] = COST_BATCHES) -> pd.DataFrame:
    """Predicted verify ms against the forward's tokens T, one line per batch size B (T from B to 9B): each B's own
    line where the selector fitted one, else the global line."""
    cost = verify_cost(state)
    rows = []
    for b in batches if cost is not None else ():
        c0, per_token = _batch_line(cost, b)
        rows += [{"requests": b, "tokens": b * m, "predicted_ms": c0 + per_token * b * m}
                 for m in COST_TOKENS_PER_REQUEST]
    return pd.DataFrame(rows, columns=["requests", "tokens", "predicted_ms"])


def verify_cost_chart(state: SpindState) -> alt.Chart:
    df = verify_cost_frame(state)
    return alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("tokens:Q", title="tokens in the forward, T", axis=axis("count")),
        y=alt.Y("predicted_ms:Q", title="predicted verify time (ms)", axis=axis("ms")),
        color=alt.Color("requests:O", title="requests (B)", scale=alt.Scale(scheme="blues")),
        tooltip=["requests:O", "tokens:Q", alt.Tooltip("predicted_ms:Q", title="ms", format=".2f")],
    ).properties(height=HEIGHT)


def verify_fit_frame(state: SpindState) -> pd.DataFrame:
    """[predicted, measured] ms of the last verify forwards, oldest first; a malformed pair is left out, the
    others keep their place."""
    fit = (state.selector or {}).get("verify_fit")
    rows = []
    for i, pair in enumerate(fit if isinstance(fit, list) else []):
        if isinstance(pair, (list, tuple)) and len(pair) == 2:
            predicted, measured = _number(pair[0]), _number(pair[1])
            if predicted is not None and measured is not None:
                rows.append({"forward": i, "predicted_ms": predicted, "measured_ms": measured})
    return pd.DataFrame(rows, columns=["forward", "predicted_ms", "measured_ms"])


def verify_fit_chart(state: SpindState) -> alt.Chart:
    """Measured verify ms per forward, and what the line predicted for it."""
    df = verify_fit_frame(state).rename(columns={"predicted_ms": "predicted", "measured_ms": "measured"})
    folded = alt.Chart(df).transform_fold(["measured", "predicted"], as_=["series", "ms"])
    return folded.mark_line(point=True).encode(
        x=alt.X("forward:Q", title="verify forward (oldest → newest)", axis=axis("count")),
        y=alt.Y("ms:Q", title="verify time (ms)", axis=axis("ms")),
        color=alt.Color("series:N", title=None,
                        scale=alt.Scale(domain=["measured", "predicted"], range=[VERIFY_COLOUR, PREDICTED_COLOUR])),
        tooltip=["forward:Q", "series:N", alt.Tooltip("ms:Q", format=".2f")]).properties(height=HEIGHT)


BATCH_BUCKETS = ("1", "2", "3-4", "5-8", "9-16", "17+")  # the selector's batch-size buckets (lbss.bucket_of)


def regime_summary(regime: object) -> str | None:
    """The regime trial (selection/regime.py) in words: per batch-size bucket with measured pairs, what selection's
    slots made against plain, unselected ones (x), and which runs now; None when there is nothing measured."""
    buckets = regime.get("buckets") if isinstance(regime, dict) else None
    if not isinstance(buckets, dict):
        return None
    parts = []
    for key, b in sorted(buckets.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 99):
        adv = _number(b.get("advantage")) if isinstance(b, dict) else None
        if adv is None or not str(key).isdigit() or int(key) >= len(BATCH_BUCKETS):
            continue
        parts.append(f"B={BATCH_BUCKETS[int(key)]}: {adv:.2f}x ({_number(b.get('pairs')) or 0:g} pairs, "
                     f"{b.get('regime')} now)")
    return "selection vs plain, measured: " + ", ".join(parts) if parts else None


def verify_cost_summary(state: SpindState) -> str | None:
    """One line: batch pricing on/off, the price, the fitted coefficients; None when the selector reports none
    of them."""
    sel = state.selector or {}
    if not any(k in sel for k in ("batch_pricing", "price", "verify_cost")):
        return None
    parts = [f"batch pricing **{'on' if sel.get('batch_pricing') else 'off'}**"]
    price = _number(sel.get("price"))
    parts.append(f"price {price:,.1f} tok/s" if price else "no price yet")
    cuts = sel.get("cut_slots") if isinstance(sel.get("cut_slots"), dict) else {}
    shorter, plain = _number(cuts.get("shorter")), _number(cuts.get("plain"))
    if shorter is not None and plain is not None:
        parts.append(f"drafts cut to what pays: {shorter:g} request slots shortened, {plain:g} made plain")
    if sel.get("idle") is True:
        overhead = _number(sel.get("overhead_ms"))
        parts.append("selection **idle**: the drafts are worth less than selecting costs"
                     + (f" ({overhead:.2g} ms a slot)" if overhead else ""))
    regime = regime_summary(sel.get("regime"))
    if regime:
        parts.append(regime)
    left_out = sel.get("dominated")
    if isinstance(left_out, list) and left_out:
        parts.append(f"left out: {', '.join(drafter_label(str(d)) for d in left_out)} (another free drafter does "
                     f"better on the same text)")
    cost = verify_cost(state)
    if cost is None:
        parts.append("verify cost not fitted yet")
    else:
        basis = [f"{n:g} {what}" for n, what in ((_number(cost.get("prior_points")), "profile points"),
                                                (_number(cost.get("observations")), "forwards observed"))
                 if n is not None]
        line = f"{cost['c0_ms']:.3g} + {cost['per_request_ms']:.3g}·B + {cost['per_token_ms']:.3g}·T"
        parts.append(f"verify ms = {line}" + (f" ({', '.join(basis)})" if basis else ""))
        own = cost.get("by_batch") if isinstance(cost.get("by_batch"), dict) else {}
        slopes = [f"B={b}: {_number(v.get('per_token_ms')):.3g}" for b, v in own.items()
                  if isinstance(v, dict) and _number(v.get("per_token_ms")) is not None]
        if slopes:
            parts.append("ms per token by batch size " + ", ".join(slopes[:6]))
        steps = cost.get("batch1_position_ms")
        if isinstance(steps, list) and steps and all(_number(x) is not None for x in steps):
            parts.append("batch 1's draft positions add " + ", ".join(f"{x:.2g}" for x in steps) + " ms")
    return " · ".join(parts)


def calibration_frame(state: SpindState) -> pd.DataFrame:
    """Per drafter that rates its draft tokens and is calibrated: the chance a token of each confidence bin
    survived with its prefix (x: the bin's middle). A drafter not yet calibrated (null) or a malformed curve is
    left out."""
    curves = (state.selector or {}).get("calibration")
    rows = []
    for drafter, curve in (curves.items() if isinstance(curves, dict) else ()):
        values = [_number(q) for q in curve] if isinstance(curve, list) else []
        if not values or any(q is None for q in values):
            continue
        rows += [{"drafter": drafter_label(drafter), "confidence": (b + 0.5) / len(values), "survival": q}
                 for b, q in enumerate(values)]
    return pd.DataFrame(rows, columns=["drafter", "confidence", "survival"])


def calibration_chart(state: SpindState) -> alt.Chart:
    """Each drafter's own confidence against the chance its token survived: above the diagonal it undersells its
    drafts, below it oversells them; the floor a slot's drafts are cut at is where the line crosses the price."""
    df = calibration_frame(state)
    return alt.Chart(df).mark_line(point=True, interpolate="step-after").encode(
        x=alt.X("confidence:Q", title="the drafter's confidence in a token (share)", axis=axis("share")),
        y=alt.Y("survival:Q", title="tokens that survived (share)", axis=axis("share")),
        color=alt.Color("drafter:N", scale=drafter_colours(state)),
        tooltip=["drafter:N", alt.Tooltip("confidence:Q", format=".0%"),
                 alt.Tooltip("survival:Q", format=".0%")]).properties(height=HEIGHT)


# ---- pipeline occupancy ---------------------------------------------------------------------------------------
def activity(kind: str, drafter: str) -> str:
    return f"{kind} {drafter_label(drafter)}" if drafter and kind in ("draft", "precompute") else kind


def activity_colours(state: SpindState) -> alt.Scale:
    """Each drafter's own hue, dark for drafting and light for precomputing its KV."""
    domain, colours = ["verify", "prefill"], [VERIFY_COLOUR, PREFILL_COLOUR]
    for i, name in enumerate(state.drafters):
        dark, light = DRAFTER_COLOURS[i % len(DRAFTER_COLOURS)]
        domain += [activity("draft", name), activity("precompute", name)]
        colours += [dark, light]
    return alt.Scale(domain=domain, range=colours)


def occupancy_frame(state: SpindState) -> pd.DataFrame:
    """One row per drawn bar: worker, activity, start/end in seconds before the snapshot."""
    rows = []
    for w in state.workers:
        last = None
        for s in w.busy:
            what = activity(s.kind, s.drafter)
            if last is not None and last["activity"] == what and s.start - state.now - last["end"] < MERGE_GAP_S:
                last["end"] = max(last["end"], s.end - state.now)
                continue
            last = {"worker": w.name, "activity": what, "start": s.start - state.now, "end": s.end - state.now}
            rows.append(last)
    return pd.DataFrame(rows, columns=["worker", "activity", "start", "end"])


def occupancy_timeline(state: SpindState) -> alt.Chart:
    """What each worker did over the last window, per 0.2 s (spind.coordinator.history.RESOLUTION_S: each bin's
    busy seconds per activity side by side from its start); white = idle."""
    df = occupancy_frame(state)
    return alt.Chart(df).mark_bar(height=26).encode(
        x=_time_axis(state, "start"), x2="end:Q",
        y=alt.Y("worker:N", sort=[w.name for w in state.workers], title=None),
        color=alt.Color("activity:N", scale=activity_colours(state)),
        tooltip=["worker:N", "activity:N", alt.Tooltip("start:Q", title="start (s)", format=".2f"),
                 alt.Tooltip("end:Q", title="end (s)", format=".2f")],
    ).properties(height=max(60 * len(state.workers), 20 * (2 + 2 * len(state.drafters)) + 20))


def utilisation_frame(state: SpindState) -> pd.DataFrame:
    """Share of the window each worker spent per kind (overlaps count in each kind they belong to)."""
    rows = []
    for w in state.workers:
        since = state.now - state.window_s
        by_kind = {k: 0.0 for k in BUSY_KINDS}
        for s in w.busy:
            by_kind[s.kind] = by_kind.get(s.kind, 0.0) + max(0.0, s.end - max(s.start, since))
        rows += [{"worker": w.name, "kind": k, "share": v / state.window_s} for k, v in by_kind.items() if v > 0]
    return pd.DataFrame(rows, columns=["worker", "kind", "share"])


def utilisation_chart(state: SpindState) -> alt.Chart:
    df = utilisation_frame(state)
    return alt.Chart(df).mark_bar().encode(
        x=alt.X("share:Q", stack="zero", scale=alt.Scale(domain=[0, 1]), axis=axis("share"),
                title=f"busy share of the last {state.window_s:.0f} s (%)"),
        y=alt.Y("worker:N", sort=[w.name for w in state.workers], title=None),
        color=alt.Color("kind:N", scale=KIND_COLOURS),
        tooltip=["worker:N", "kind:N", alt.Tooltip("share:Q", format=".0%")],
    ).properties(height=40 * max(1, len(state.workers)) + 40)


# ---- throughput -----------------------------------------------------------------------------------------------
def throughput_frame(state: SpindState) -> pd.DataFrame:
    """Per second x drafter that ran that second: goodput (committed tok/s), acceptance, mean accepted length."""
    rows = []
    for s in state.throughput:
        for name, c in s.drafters.items():
            rows.append({"t": s.t - state.now, "drafter": drafter_label(name), "goodput": c.num_committed,
                         "acceptance": c.num_accepted / c.num_drafted if c.num_drafted else None,
                         "accepted_length": (c.num_accepted + c.num_steps) / c.num_steps if c.num_steps else None})
    return pd.DataFrame(rows, columns=["t", "drafter", "goodput", "acceptance", "accepted_length"])


def goodput_frame(state: SpindState) -> pd.DataFrame:
    """Committed tokens per second x drafter, every second of the window: 0 where a drafter committed nothing,
    so that the stack reads 0 tok/s when idle instead of leaving gaps (plain decoding alone when none ran)."""
    ran = {drafter_label(n) for s in state.throughput for n in s.drafters}
    domain = drafter_domain(state)
    names = [n for n in domain if n in ran] + sorted(ran - set(domain)) or [PLAIN_LABEL]
    rows = []
    for s in state.throughput:
        by_label = {drafter_label(n): c.num_committed for n, c in s.drafters.items()}
        rows += [{"t": s.t - state.now, "drafter": n, "goodput": by_label.get(n, 0)} for n in names]
    return pd.DataFrame(rows, columns=["t", "drafter", "goodput"])


def goodput_chart(state: SpindState) -> alt.Chart:
    """Committed tokens per second, stacked by the drafter the requests ran with."""
    return alt.Chart(goodput_frame(state)).mark_area(interpolate="step-after").encode(
        x=_time_axis(state), y=alt.Y("goodput:Q", stack="zero", title="committed tok/s", axis=axis("tok/s")),
        color=alt.Color("drafter:N", scale=drafter_colours(state)),
        tooltip=["drafter:N", alt.Tooltip("goodput:Q", title="tok/s", format=",d")]).properties(height=HEIGHT)


def per_drafter_frame(state: SpindState, field: str) -> pd.DataFrame:
    """`field` (acceptance or accepted_length) per second x drafter, where it is defined: drafters that drafted."""
    df = throughput_frame(state)
    return df[(df["drafter"] != PLAIN_LABEL) & df[field].notna()]


def per_drafter_line(state: SpindState, field: str, title: str, unit: str) -> alt.Chart:
    return alt.Chart(per_drafter_frame(state, field)).mark_line(point=True).encode(
        x=_time_axis(state), y=alt.Y(f"{field}:Q", title=title, axis=axis(unit)),
        color=alt.Color("drafter:N", scale=drafter_colours(state)),
        tooltip=["drafter:N", alt.Tooltip(f"{field}:Q", format=AXIS_FORMATS[unit])]).properties(height=HEIGHT)


def tokens_frame(state: SpindState) -> pd.DataFrame:
    """Tokens per second of the window, every second (0 when idle): generated (committed) and prefilled."""
    rows = [{"t": s.t - state.now, "tokens": what, "tok/s": n} for s in state.throughput
            for what, n in (("generated", sum(c.num_committed for c in s.drafters.values())),
                            ("prefilled", s.num_prompt_tokens))]
    return pd.DataFrame(rows, columns=["t", "tokens", "tok/s"])


def tokens_chart(state: SpindState) -> alt.Chart:
    return alt.Chart(tokens_frame(state)).mark_line(interpolate="step-after").encode(
        x=_time_axis(state), y=alt.Y("tok/s:Q", title="tok/s", axis=axis("tok/s")),
        color=alt.Color("tokens:N", title=None, scale=alt.Scale(domain=["generated", "prefilled"],
                                                                range=[VERIFY_COLOUR, PREFILL_COLOUR])),
        tooltip=["tokens:N", alt.Tooltip("tok/s:Q", format=",d")]).properties(height=HEIGHT)


def queue_frame(state: SpindState) -> pd.DataFrame:
    rows = [{"t": s.t - state.now, "queue": q, "requests": n} for s in state.throughput
            for q, n in (("running", s.num_running), ("waiting", s.num_waiting))]
    return pd.DataFrame(rows, columns=["t", "queue", "requests"])


def queue_chart(state: SpindState) -> alt.Chart:
    return alt.Chart(queue_frame(state)).mark_line(interpolate="step-after").encode(
        x=_time_axis(state), y=alt.Y("requests:Q", title="requests", axis=axis("count")),
        color=alt.Color("queue:N"), tooltip=["queue:N", "requests:Q"]).properties(height=HEIGHT)


# ---- latency --------------------------------------------------------------------------------------------------
def latency_long_frame(state: SpindState) -> pd.DataFrame:
    """measure x percentile -> ms, for the measures that have finished requests behind them."""
    lat = state.latency
    rows = [{"measure": name, "percentile": p, "ms": ms}
            for name, by_p in (("time to first token", lat.ttft_ms), ("request latency", lat.latency_ms))
            for p, ms in by_p.items()]
    return pd.DataFrame(rows, columns=["measure", "percentile", "ms"])


def latency_frame(state: SpindState) -> pd.DataFrame:
    """The percentiles as a table: one row per measure, one column per percentile, in ms with 1 decimal."""
    df = latency_long_frame(state)
    if df.empty:
        return pd.DataFrame(columns=["measure"])
    table = df.pivot(index="measure", columns="percentile", values="ms").reindex(
        [m for m in ("time to first token", "request latency") if m in set(df["measure"])])
    return table.map(lambda ms: f"{ms:,.1f}").rename(columns=lambda p: f"{p} (ms)").reset_index()


def latency_chart(state: SpindState) -> alt.Chart:
    df = latency_long_frame(state)
    return alt.Chart(df).mark_bar().encode(
        x=alt.X("ms:Q", title="milliseconds (ms)", axis=axis("ms")),
        y=alt.Y("measure:N", title=None), yOffset="percentile:N",
        color=alt.Color("percentile:N", scale=alt.Scale(scheme="blues")),
        tooltip=["measure:N", "percentile:N", alt.Tooltip("ms:Q", format=",.1f")]).properties(height=alt.Step(18))


# ---- workers --------------------------------------------------------------------------------------------------
def workers_frame(workers: list[WorkerState], busy: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per worker, numbers as text in their unit; `busy`: each worker's share of the rate window (else
    the snapshot's own 30 s utilisation)."""
    busy = busy or {}
    return pd.DataFrame([{
        "worker": w.name, "health": "alive" if w.alive else "DEAD", "device": w.device, "dtype": w.dtype,
        "model": w.model, "threads": str(w.threads), "pid": MISSING if w.pid is None else str(w.pid),
        "memory": MISSING if w.rss_bytes is None else f"{w.rss_bytes / 2**20:,.0f} MiB",
        "busy": f"{busy.get(w.name, w.utilisation):.0%}", "restarts": str(w.restarts), "hung (killed)": str(w.hangs)}
        for w in workers], columns=["worker", "health", "device", "dtype", "model", "threads", "pid", "memory",
                                    "busy", "restarts", "hung (killed)"])
