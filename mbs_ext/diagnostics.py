"""What benchmarks, tests and the apps may measure with, beyond the public API.

The one module outside ``mbs_ext.__all__`` that code outside the core imports: probes
of memory (what autograd saves, the peak of one micro-batch), the unchecked fused op
(for measuring the cost of the checks), the native module (for the ring's low-level
tests), and the ring's staging-thread default.
"""

from __future__ import annotations

from mbs_ext._native import _C as native
from mbs_ext.ops import _OP as scale_accumulate_unchecked
from mbs_ext.planner import cuda_room
from mbs_ext.probe import PeakTracker, is_out_of_memory, measure_peak, measure_saved_bytes
from mbs_ext.ring import default_staging_threads

__all__ = [
    "PeakTracker",
    "cuda_room",
    "default_staging_threads",
    "is_out_of_memory",
    "measure_peak",
    "measure_saved_bytes",
    "native",
    "scale_accumulate_unchecked",
]
