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
