"""What benchmarks, tests and the apps may measure with, beyond the public API.

The one module outside ``mbs_ext.__all__`` that code outside the core imports: probes
of memory (what autograd saves, the peak of one micro-batch), the unchecked fused op
(for measuring the cost of the checks), the step's accumulator layout and the rows a deferred
BatchNorm holds, the native
module (for the ring's low-level tests), the ring's staging-thread default; and for
measuring child processes, their environment, /proc memory figures, ``malloc_trim`` and
thread counts (all, or the ring's own by name), and matplotlib for writing figures without a display.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mbs_ext._native import _C as native
from mbs_ext.memory.backoff import is_out_of_memory
from mbs_ext.memory.planner import cuda_room
from mbs_ext.memory.probe import (
    PeakTracker,
    RssPeak,
    malloc_trim,
    measure_peak,
    measure_saved_bytes,
    proc_status,
)
from mbs_ext.model.batchnorm_rows import FOLD_EVERY as BATCHNORM_FOLD_EVERY
from mbs_ext.model.batchnorm_rows import held_rows as batchnorm_held_rows
from mbs_ext.model.grads import buffer_layout
from mbs_ext.ops import _OP as scale_accumulate_unchecked
from mbs_ext.streaming.ring import default_staging_threads, split_sizes

__all__ = [
    "BATCHNORM_FOLD_EVERY",
    "RING_PRODUCER_THREAD",
    "RING_STAGING_THREAD",
    "PeakTracker",
    "RssPeak",
    "batchnorm_held_rows",
    "buffer_layout",
    "child_env",
    "cuda_room",
    "default_staging_threads",
    "is_out_of_memory",
    "malloc_trim",
    "measure_peak",
    "measure_saved_bytes",
    "native",
    "os_threads",
    "proc_status",
    "pyplot",
    "scale_accumulate_unchecked",
    "split_sizes",
]


def child_env(threads: int) -> dict[str, str]:
    """Environment of a measuring child: this checkout importable, few malloc arenas, big
    tensors in their own mappings (freed memory returns to the OS), ``threads`` threads."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])  # the checkout holding mbs_ext/
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["MALLOC_ARENA_MAX"] = "2"
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    return env


def os_threads(*names: str) -> int:
    """Threads of this process as the OS counts them (Linux /proc); with ``names``, only the
    threads so named (``RING_PRODUCER_THREAD``: one per open stream; ``RING_STAGING_THREAD``:
    a ring's staging pool, ``staging_threads - 1`` of them while the ring lives), a count
    that other threads (torch's pools, a library's monitor started meanwhile) cannot blur."""
    if not names:
        return len(os.listdir("/proc/self/task"))
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{task}/comm").read_text().strip()
        except OSError:  # the thread ended between the listing and the read
            continue
        count += name in names
    return count


RING_PRODUCER_THREAD, RING_STAGING_THREAD = native.ring_thread_names


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
