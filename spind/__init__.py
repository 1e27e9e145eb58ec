"""spind: an LLM serving daemon built on speculative decoding with heterogeneous draft models."""

import os

# OpenMP threads that sleep instead of spinning when they wait: on a machine with other busy processes,
# spinning barriers made a 2-thread decode step ~10x slower (measured: ~1,000 vs ~95 ms per slot), while
# passive waiting loses nothing when the machine is idle. It must be set before torch loads OpenMP; an
# explicit OMP_WAIT_POLICY from the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
