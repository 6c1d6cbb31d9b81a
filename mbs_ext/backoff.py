"""Out-of-memory back-off: the largest micro-batch that fits, found with a few probes.

Halving after an out-of-memory error throws away up to half the micro-batch size the
device could hold. Instead, single-micro-batch probes (forward and backward of the
first rows, undone afterwards) bisect between 0 and the size that failed; the step
is redone once, at the largest size found, and the caller remembers it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mbs_ext import batch as _batch
from mbs_ext import loss as _loss
from mbs_ext import memory as _memory
from mbs_ext.batchnorm import deferred_layers
from mbs_ext.snapshot import Snapshot


def release_cached_memory(device: torch.device) -> None:
    """Free what a failed attempt left: unreachable tensors and the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fits(
    model: nn.Module,
    params: list[nn.Parameter],
    batch: Any,
    indices: torch.Tensor | None,
    size: int,
    device: torch.device,
    loss_call: Callable,
    autocast_dtype: torch.dtype | None,
) -> bool:
    """Whether one micro-batch of ``size`` rows runs forward and backward; leaves no trace."""
    snap = Snapshot(model, device)
    layers = deferred_layers(model)
    for layer in layers:
        layer.begin_mini_batch()
    try:
        picked = torch.arange(size) if indices is None else indices[:size]
        mb = _batch.to_device(_batch.take(batch, picked), device)
        with _loss.autocast(device, autocast_dtype):
            loss = loss_call(model, mb)
        loss.float().backward()
        return True
    except BaseException as exc:
        if not _memory.is_out_of_memory(exc):
            raise
        return False
    finally:
        for layer in layers:
            layer.discard()
        for p in params:
            p.grad = None
        snap.restore()
        release_cached_memory(device)


def largest_fitting(fits_at: Callable[[int], bool], failed: int) -> int | None:
    """Bisect (0, failed) to within 1/16 of ``failed``; None when not even one row fits."""
    lo, hi = 0, failed
    tolerance = max(1, failed // 16)
    while hi - lo > tolerance:
        mid = (lo + hi) // 2
        if fits_at(mid):
            lo = mid
        else:
            hi = mid
    if lo == 0 and hi > 1 and fits_at(1):
        lo = 1
    return lo or None
