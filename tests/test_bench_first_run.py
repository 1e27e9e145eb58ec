"""`spind bench first-run`'s accounting: where a run's time went, which waits were announced, and the budgets; on
scripted lines, and on a real subprocess whose lines are stamped as they arrive."""

from __future__ import annotations

import sys

from spind.bench.first_run import Run, fresh_env, render, summarize, timed_run


def run(kind: str, first: float, lines: list[tuple[float, str]]) -> Run:
    return Run(kind, first, 0, [(t, "err", text) for t, text in lines])


def test_a_wait_is_announced_only_by_the_line_that_began_it_saying_how_long() -> None:
    r = run("cold", 16.0, [(1.5, "spind: converting x (once; ~7 s for the default model)"),
                           (9.0, "spind: loading default, ~5 s ..."), (13.0, "spind: some step"),
                           (15.8, "spind: loaded in 7.0s; generating")])
    assert [round(s, 1) for s, _ in r.waits()] == [1.5, 7.5, 4.0, 2.8, 0.2]
    assert r.longest_unannounced() == (2.8000000000000007, "spind: some step")


def test_budgets_take_the_median_first_output_and_the_longest_quiet_wait() -> None:
    quick = [(0.5, "spind: loading, ~20 s ...")]
    runs = [run("cold", 19.0, quick), run("cold", 25.0, quick), run("cold", 12.0, quick),
            run("cached", 6.0, quick), run("cached", 6.5, [(3.0, "spind: loading ..."), (6.0, "spind: loaded")])]
    cold, cached = summarize(runs)
    assert cold["first_output_median_s"] == 19.0 and cold["met"]
    assert cached["first_output_median_s"] == 6.25 and not cached["met"]  # 3 s unannounced after "loading ..."
    assert cached["after_line"] == "spind: loading ..." and "NO" in render([cold, cached])
    failed = Run("cold", None, 1, [])
    assert summarize([failed])[0]["first_output_median_s"] is None and not summarize([failed])[0]["met"]


def test_a_real_process_lines_are_stamped_as_they_arrive(tmp_path) -> None:
    script = ("import sys, time\nprint('spind: step one, ~1 s', file=sys.stderr, flush=True)\ntime.sleep(0.6)\n"
              "print('spind: step two', file=sys.stderr, flush=True)\ntime.sleep(0.3)\nprint('text', flush=True)")
    r = timed_run([sys.executable, "-c", script], fresh_env(tmp_path), "cold", 30)
    assert r.exit_code == 0 and [(src, text) for _, src, text in r.lines] == [
        ("err", "spind: step one, ~1 s"), ("err", "spind: step two"), ("out", "text")]
    waits = dict((line, s) for s, line in r.waits())
    assert waits["spind: step one, ~1 s"] >= 0.55 and waits["spind: step two"] >= 0.25
    assert r.first_output_s == r.lines[-1][0]
    assert fresh_env(tmp_path)["HOME"] == str(tmp_path)
