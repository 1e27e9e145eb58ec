"""Where work runs: which worker processes a config asks for and how many torch threads each gets (pure)."""

from __future__ import annotations

from spind.config import TARGET_WORKER, SpindConfig


def worker_names(cfg: SpindConfig) -> list[str]:
    """The workers to start: the target's, then every worker that hosts a configured drafter."""
    names = [TARGET_WORKER]
    for d in cfg.drafters:
        if d.worker not in names:
            names.append(d.worker)
    return names


def usable_cores() -> int:
    """The cores this process may run on: the machine's, bounded by its CPU affinity (taskset, a container's
    cpuset) and by a cgroup CPU quota (a container's --cpus, rounded up), as loky, joblib's process pool, counts
    them. os.cpu_count() counts every core of the host, and threads sized by it oversubscribe a container."""
    from loky import cpu_count

    return max(1, cpu_count())


def threads_for(cfg: SpindConfig, name: str, num_cores: int | None = None) -> int:
    """torch intra-op threads of one worker: its own setting, else [runtime].threads, else an even share
    of the usable cores, so that the workers of one machine never oversubscribe it."""
    w = cfg.worker(name)
    share = max(1, (num_cores or usable_cores()) // len(worker_names(cfg)))
    return w.threads or cfg.runtime.threads or share


def target_all_threads(cfg: SpindConfig, num_cores: int | None = None) -> int:
    """The threads the target takes while nothing drafts on another worker ([runtime].adaptive_threads): every
    worker's threads together, at most the usable cores. That is the usable cores by default, and never more than
    the threads settings grant (`--threads 2` on a 16-core host keeps a one-worker spind on 2 cores)."""
    cores = num_cores or usable_cores()
    return min(cores, sum(threads_for(cfg, name, cores) for name in worker_names(cfg)))


def verify_threads(cfg: SpindConfig, target_device: str, num_cores: int | None = None) -> int:
    """The threads the target verifies with while nothing drafts on another worker: every core's where
    [runtime].adaptive_threads gives them to a CPU target (`target_all_threads`), else its own share. Most slots run
    so (plain decoding and the free drafters draft nothing elsewhere), so the start-up profile times the target
    with them and the verify-cost model learns from those forwards only (`VerifyOutcome.on_share`)."""
    if cfg.runtime.adaptive_threads and target_device == "cpu":
        return target_all_threads(cfg, num_cores)
    return threads_for(cfg, TARGET_WORKER, num_cores)


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
