"""PNG plots of `spind bench e2e` results, mirroring the paper's figures (matplotlib, the `bench` extra):
goodput per system, the SSM choice shares over a request's slots, and LBSS against the selection baselines."""

from __future__ import annotations

from pathlib import Path

SELECTION = ("spin-nobatch-nopipe", "greedy-length", "epsilon-greedy", "random", "oracle", "none")


def write_plots(results: dict, out_dir: Path) -> list[Path]:
    """The plots as PNG files in out_dir; [] when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    s, rows = results["settings"], results["rows"]
    where = f"{s['workload']}, batch {s['batch_size']}"
    paths = []

    def bars(names: list[str], path: Path, title: str) -> None:
        fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(names)), 3.5))
        values = [next(r["goodput"] for r in rows if r["system"] == n) for n in names]
        ax.bar(names, values, color=["#4c72b0" if n.startswith("spin") else "#999999" for n in names])
        ax.set_ylabel("goodput (tokens/s)")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    bars([r["system"] for r in rows], out_dir / "goodput.png", f"Goodput per system ({where})")
    selection = [n for n in SELECTION if any(r["system"] == n for r in rows)]
    if len(selection) > 1:
        bars(selection, out_dir / "selection.png", f"LBSS vs the selection baselines ({where})")
    arms = results["requests"].get("spin") or results["requests"].get("spin-nopipe")
    if arms:
        longest = max(len(r["arms"]) for r in arms)
        drafters = sorted({a.split("@")[0] for r in arms for a in r["arms"]})
        shares = {d: [] for d in drafters}
        for slot in range(longest):
            here = [r["arms"][slot].split("@")[0] for r in arms if slot < len(r["arms"])]
            for d in drafters:
                shares[d].append(here.count(d) / len(here))
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.stackplot(range(longest), *shares.values(), labels=drafters)
        ax.set_xlabel("slot of the request")
        ax.set_ylabel("share of requests")
        ax.set_title(f"SSM choice over a request's life (spin, {where})")
        ax.legend(loc="upper right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "choices.png", dpi=120)
        plt.close(fig)
        paths.append(out_dir / "choices.png")
    return paths
