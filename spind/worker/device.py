"""The worker's device: pinning it, naming it, timing work on it, and telling a failed op from a lost device.

torch is imported inside the functions: the coordinator's process (no torch) reads `EXIT_DEVICE_ERROR` from here.
"""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

from spind.config import is_cuda

if TYPE_CHECKING:
    import torch

# The exit status of a worker process whose device failed for good (EX_TEMPFAIL: a fresh process may well work):
# the coordinator's pool sees the exit, restarts the worker and replays its requests, as after a crash.
EXIT_DEVICE_ERROR = 75

# Errors after which a CUDA context is unusable ("sticky": every later call fails the same way), as the CUDA
# runtime, cuBLAS, cuDNN, NCCL and Triton word them. Out-of-memory is not one of them: that op fails alone.
_FATAL_MESSAGES = ("CUDA error", "CUDA driver error", "device-side assert", "illegal memory access",
                   "unspecified launch failure", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error",
                   "Triton Error [CUDA]")


def is_fatal_device_error(e: BaseException) -> bool:
    """True when `e` means this process's device is lost (replying and carrying on would fail every later op the
    same way): torch's AcceleratorError, a RuntimeError in the words of a CUDA-side failure, or a tensor-parallel
    group that lost a rank (spind/worker/tensor_parallel.py: the group is restarted whole)."""
    import torch

    from spind.models.tensor_parallel import TensorParallelError

    if isinstance(e, TensorParallelError):
        return True
    if isinstance(e, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(e, accelerator_error):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _FATAL_MESSAGES)


def pin_device(device: str) -> None:
    """Make `device` the calling thread's current CUDA device before any CUDA work, so nothing that asks for the
    current device (torch.cuda.synchronize(), pinned memory, Triton's launches) makes a context on another GPU.
    Per thread: the in-process pool pins each worker's own thread. Nothing to do on CPU."""
    if is_cuda(device):
        import torch

        torch.cuda.set_device(torch.device(device))


def bf16_supported(device: str) -> bool:
    """Whether the device computes in bfloat16 natively (CUDA: compute capability 8.0, Ampere, and later)."""
    if not is_cuda(device):
        return True
    import torch

    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)


def device_name(device: str) -> str:
    """What the device is (its cost profile is valid there only): the GPU's name on CUDA, the CPU's model name."""
    if is_cuda(device):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class DeviceClock:
    """Timestamps of device work. CUDA kernels run asynchronously: a timestamp taken when the host has only queued
    them says nothing of when they ran, so `now()` first waits for the device (a no-op on CPU). Every duration a
    worker measures (busy intervals, verify and draft seconds, cost profiles, switch costs) is taken through one.
    time.monotonic: busy intervals are compared with the coordinator's own clock (one clock per machine)."""

    def __init__(self, device: str | torch.device) -> None:
        import torch

        self.device = torch.device(device)
        self._synchronize = torch.cuda.synchronize if self.device.type == "cuda" else None

    def sync(self) -> None:
        if self._synchronize is not None:
            self._synchronize(self.device)

    def now(self) -> float:
        self.sync()
        return time.monotonic()
