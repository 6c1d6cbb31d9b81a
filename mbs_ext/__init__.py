"""mbs_ext: Micro-Batch Streaming for PyTorch.

Train with a mini-batch far larger than device memory: the batch stays on the host,
streams to the device in micro-batches, gradients accumulate with exact loss
normalization, and one optimizer step equals the full-batch step.
"""

from __future__ import annotations

from mbs_ext import diagnostics  # noqa: F401  (the README names mbs_ext.diagnostics: reachable after `import mbs_ext`)
from mbs_ext._native import _C
from mbs_ext._version import __version__
from mbs_ext.counts.agreement import CountWarning
from mbs_ext.counts.noise import Noise, NoiseScale
from mbs_ext.memory.planner import MicroBatchPlan, plan_forward, plan_micro_batch
from mbs_ext.model.batchnorm import BatchNormWarning, convert_batchnorm, set_batchnorm_across_ranks
from mbs_ext.model.options import StepOptions
from mbs_ext.ops import scale_accumulate_
from mbs_ext.step.cached import CachedLoss, forward
from mbs_ext.step.schedule import Autopilot, Ramp, SampleLR, Steps, adascale_gain, scaled_lr
from mbs_ext.step.streamable import check_streamable
from mbs_ext.step.streamer import MicroBatchStreamer, StepResult, accumulate, step
from mbs_ext.streaming.order import MiniBatches, SampleOrder
from mbs_ext.streaming.ring import StreamRing
from mbs_ext.streaming.tokens import TokenPlan, plan_tokens
from mbs_ext.world import PeerFailed


def build_info() -> dict:
    """What this installed build contains (CUDA kernels compiled, archs, OpenMP, versions)."""
    import torch

    return {
        "cuda_compiled": bool(_C.cuda_compiled),
        "cuda_archs": [a for a in str(_C.cuda_archs).split(",") if a],
        "torch_version": torch.__version__,
        "openmp": bool(_C.openmp),
        "version": __version__,
    }


__all__ = [
    "Autopilot",
    "BatchNormWarning",
    "CachedLoss",
    "CountWarning",
    "MicroBatchPlan",
    "MicroBatchStreamer",
    "MiniBatches",
    "Noise",
    "NoiseScale",
    "PeerFailed",
    "Ramp",
    "SampleLR",
    "SampleOrder",
    "StepOptions",
    "StepResult",
    "Steps",
    "StreamRing",
    "TokenPlan",
    "__version__",
    "accumulate",
    "adascale_gain",
    "build_info",
    "check_streamable",
    "convert_batchnorm",
    "forward",
    "plan_forward",
    "plan_micro_batch",
    "plan_tokens",
    "scale_accumulate_",
    "scaled_lr",
    "set_batchnorm_across_ranks",
    "step",
]


def __dir__() -> list[str]:
    """The public names (and mbs_ext.diagnostics), not what the module imported on the way."""
    return sorted({*__all__, "diagnostics"})
