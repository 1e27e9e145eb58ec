"""`spind bench first-run`: a newcomer's first `spind generate`, timed as they meet it.

Each repeat runs the command twice in a fresh, empty HOME (no model cache, no profile: a fresh machine after
`pip install -e .`, whose kernels live in the package): first cold (the GGUF converted, the workers started, the
models profiled), then again with those caches. For each run: seconds to the first output byte (`spind generate`
prints its text when done: the first token is there), and every wait between two lines the user sees. A wait is
"announced" when the line that began it says how long its step takes (`~N s`, spind/progress.py); the run's
longest *unannounced* wait is what no step may exceed (2 s). Budgets: 20 s cold, 8 s cached (issue #24).
"""

from __future__ import annotations

import os
import re
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spind.bench.report import Progress, fmt, format_table

ANNOUNCED = re.compile(r"~\d+ s")
COLD_BUDGET_S, CACHED_BUDGET_S, SILENCE_BUDGET_S = 20.0, 8.0, 2.0


@dataclass
class Run:
    kind: str  # "cold" | "cached"
    first_output_s: float | None  # None: the command printed nothing on stdout
    exit_code: int
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, "out" | "err", text)

    def waits(self) -> list[tuple[float, str]]:
        """(seconds, the line that began it) for every wait up to the first output: the start, then each line."""
        end = self.first_output_s if self.first_output_s is not None else (self.lines[-1][0] if self.lines else 0.0)
        marks = [(0.0, "(process start)")] + [(t, text) for t, _, text in self.lines if t <= end]
        return [(b[0] - a[0], a[1]) for a, b in zip(marks, marks[1:] + [(end, "")])]

    def longest_unannounced(self) -> tuple[float, str]:
        quiet = [(s, line) for s, line in self.waits() if not ANNOUNCED.search(line)]
        return max(quiet, default=(0.0, ""))


def fresh_env(home: Path) -> dict[str, str]:
    """This environment with an empty HOME: no spind cache, no profile, no torch extensions cache (the install's
    kernels are in the package). Variables that point caches elsewhere are dropped."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_CACHE_HOME", "TORCH_EXTENSIONS_DIR", "SPIND_CACHE_DIR", "HF_HOME")}
    env["HOME"] = str(home)
    return env


def timed_run(argv: list[str], env: dict[str, str], kind: str, timeout_s: float) -> Run:
    """Run `argv`, stamping each stdout and stderr line with seconds since the start."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    run, partial = Run(kind, None, -1), {"out": b"", "err": b""}
    while sel.get_map() and time.perf_counter() - start < timeout_s:
        for key, _ in sel.select(timeout=0.5):
            chunk = os.read(key.fd, 65536)
            now = time.perf_counter() - start
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            if key.data == "out" and run.first_output_s is None:
                run.first_output_s = now
            *done, partial[key.data] = (partial[key.data] + chunk).split(b"\n")
            run.lines += [(now, key.data, line.decode(errors="replace")) for line in done]
    if sel.get_map():
        proc.kill()
    run.exit_code = proc.wait()
    return run


def run_first_runs(prompt: str, repeats: int, timeout_s: float = 300.0) -> list[Run]:
    argv = [sys.executable, "-m", "spind.cli", "generate", "--prompt", prompt]
    progress = Progress(2 * repeats)
    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="spind-first-run.") as home:
            env = fresh_env(Path(home))
            for kind in ("cold", "cached"):
                runs.append(timed_run(argv, env, kind, timeout_s))
                progress.step(f"{kind}: first output at {fmt(runs[-1].first_output_s, 1)} s")
    return runs


def summarize(runs: list[Run]) -> list[dict]:
    rows = []
    for kind, budget in (("cold", COLD_BUDGET_S), ("cached", CACHED_BUDGET_S)):
        mine = [r for r in runs if r.kind == kind]
        firsts = [r.first_output_s for r in mine if r.first_output_s is not None and r.exit_code == 0]
        quiet = max((r.longest_unannounced() for r in mine), default=(0.0, ""))
        median = statistics.median(firsts) if len(firsts) == len(mine) and mine else None
        rows.append({"run": kind, "runs": len(mine), "first_output_median_s": median,
                     "first_output_s": [r.first_output_s for r in mine], "budget_s": budget,
                     "met": median is not None and median <= budget and quiet[0] <= SILENCE_BUDGET_S,
                     "longest_unannounced_wait_s": quiet[0], "after_line": quiet[1]})
    return rows


def render(rows: list[dict]) -> str:
    table = format_table(
        "spind generate --prompt hi in an empty HOME (first output = the generated text)",
        ["run", "runs", "first output (median s)", "budget s", "longest unannounced wait s", "met"],
        [[r["run"], str(r["runs"]), fmt(r["first_output_median_s"], 1), fmt(r["budget_s"], 0),
          fmt(r["longest_unannounced_wait_s"], 1), "yes" if r["met"] else "NO"] for r in rows])
    notes = [f"  {r['run']}: the longest unannounced wait followed {r['after_line'][:100]!r}"
             for r in rows if r["after_line"]]
    return "\n".join([table, *notes])


def steps_table(run: Run) -> str:
    return format_table(f"where a {run.kind} run's time went (each wait, and the line that began it)",
                        ["line", "wait s"], [[text[:110], fmt(s, 1)] for s, text in run.waits()])


def to_json(runs: list[Run], rows: list[dict]) -> dict:
    return {"summary": rows, "runs": [asdict(r) for r in runs],
            "budgets": {"cold_s": COLD_BUDGET_S, "cached_s": CACHED_BUDGET_S, "silence_s": SILENCE_BUDGET_S}}


def add_parser(bench_sub) -> None:
    f = bench_sub.add_parser("first-run", help="a newcomer's first `spind generate`: seconds to output, cold (empty "
                                               "HOME) and cached, and every silent wait")
    f.add_argument("--prompt", default="hi")
    f.add_argument("--repeats", type=int, default=1, help="cold + cached pairs, each in its own empty HOME")
    f.add_argument("--check", action="store_true",
                   help=f"exit 1 when a budget is not met ({COLD_BUDGET_S:.0f} s cold, {CACHED_BUDGET_S:.0f} s "
                        f"cached, no unannounced wait over {SILENCE_BUDGET_S:.0f} s)")
    f.add_argument("--out", type=Path, default=Path("bench-results/first-run.json"))
    f.set_defaults(func=cmd_bench_first_run)


def cmd_bench_first_run(args) -> int:
    from spind.bench.report import write_json

    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    runs = run_first_runs(args.prompt, args.repeats)
    failed = next((r for r in runs if r.exit_code != 0), None)
    if failed is not None:
        tail = "\n".join(text for _, _, text in failed.lines[-10:])
        raise ValueError(f"a {failed.kind} `spind generate` exited with {failed.exit_code}:\n{tail}")
    rows = summarize(runs)
    print(steps_table(runs[0]))
    print(render(rows))
    print(f"JSON: {write_json(args.out, to_json(runs, rows))}")
    return 1 if args.check and not all(r["met"] for r in rows) else 0
