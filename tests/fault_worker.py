"""`python tests/fault_worker.py ARGS`: spind's worker process (spind.worker.main, same arguments) whose verify number
SPIND_TEST_FAULT_AT loses the device, once: the first incarnation to get there writes SPIND_TEST_FAULT_MARKER, so the
restarted worker runs clean. SPIND_TEST_FAULT = "raise" raises the error torch raises for a lost CUDA device
(anywhere); "assert" makes a real one, an out-of-bounds index on the worker's GPU (a device-side assert)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from spind import protocol as P
from spind.worker import main, worker


def lose_the_device(device: str) -> None:
    if os.environ.get("SPIND_TEST_FAULT") == "assert":
        x = torch.zeros(4, device=device)
        x[torch.tensor([1 << 20], device=device)] = 1.0  # device-side assert: index out of bounds
        torch.cuda.synchronize(device)
    raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")


def run() -> int:
    at, marker = int(os.environ["SPIND_TEST_FAULT_AT"]), Path(os.environ["SPIND_TEST_FAULT_MARKER"])
    handle = worker.Worker.handle
    verifies = 0

    def faulty(self: worker.Worker, msg: object) -> object:
        nonlocal verifies
        if isinstance(msg, P.Verify):
            verifies += 1
            if verifies == at and not marker.exists():
                marker.write_text(str(os.getpid()))
                lose_the_device(self.device)
        return handle(self, msg)

    worker.Worker.handle = faulty
    return main.main()


if __name__ == "__main__":
    sys.exit(run())
