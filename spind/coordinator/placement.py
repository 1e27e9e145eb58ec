"""Where work runs: which worker processes a config asks for and how many torch threads each gets (pure)."""

from __future__ import annotations

import os

from spind.config import TARGET_WORKER, SpindConfig


def worker_names(cfg: SpindConfig) -> list[str]:
    """The workers to start: the target's, then every worker that hosts a configured drafter."""
    names = [TARGET_WORKER]
    for d in cfg.drafters:
        if d.worker not in names:
            names.append(d.worker)
    return names


def threads_for(cfg: SpindConfig, name: str, num_cores: int | None = None) -> int:
    """torch intra-op threads of one worker: its own setting, else [runtime].threads, else an even share
    of the cores, so that the workers of one machine never oversubscribe it."""
    w = cfg.worker(name)
    share = max(1, (num_cores or os.cpu_count() or 1) // len(worker_names(cfg)))
    return w.threads or cfg.runtime.threads or share


def describe_placement(workers: list[dict]) -> str:
    """One line of what runs where, from the workers' own greetings (`WorkerPool.describe()`): each worker's
    device (a tensor-parallel target: every rank's) and the drafters it hosts."""
    parts = []
    for w in workers:
        ranks = w.get("ranks") or []
        where = f"{' + '.join(ranks)} (tensor parallel)" if ranks else w.get("device", "?")
        hosts = (["the target"] if w.get("is_target") else []) + list(w.get("drafters", []))
        parts.append(f"{w['name']} on {where}: {', '.join(hosts) or 'nothing'}")
    return "; ".join(parts)
