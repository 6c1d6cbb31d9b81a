"""Whether a loss streams exactly: the streamed gradient against the full batch's, on a sample.

Losses that add up over rows stream exactly; a loss that couples the rows (in-batch
negatives) or BatchNorm in training mode does not, silently. :func:`check_streamable` tells
which, with the streamed step itself (not a copy of its rules) on a float64 copy of the model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from mbs_ext.memory.probe import probing
from mbs_ext.step.model import model_device
from mbs_ext.step.streamer import accumulate
from mbs_ext.streaming import batch as _batch

__all__ = ["check_streamable"]


def check_streamable(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
                     micro_batch_size: int, rows: int = 32, tol: float = 1e-6, **options: Any) -> None:
    """Raise ValueError when streaming ``loss_fn`` in micro-batches of ``micro_batch_size`` gives
    another gradient than the full batch; return quietly for losses that add up over rows.

    On the first ``rows`` rows of ``batch`` (split so there are at least two micro-batches),
    a float64 copy of the model takes the gradient once as one micro-batch and once streamed
    (``options`` as for :func:`mbs_ext.accumulate`, e.g. ``normalize=``). Dropout is off in the
    copies (its draws differ by split anyway); BatchNorm in training mode stays on, since its
    per-micro-batch statistics are a cause of difference the message names. The model, its
    ``.grad``, buffers and the RNG are untouched.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1 for check_streamable, got {micro_batch_size!r}")
    info = _batch.check(batch, None, model_device(model))
    n = min(rows, info.rows)
    if n < 2:
        raise ValueError(f"check_streamable needs at least 2 rows to split, the batch has {info.rows}")
    sample = pytree.tree_map(_as_float64, _batch.take(batch, torch.arange(n)))
    m = min(micro_batch_size, max(1, n // 2))
    grads = []
    # probing() puts the RNG streams back (the CPU's and, for a CUDA model, the device's), as
    # after the planner's probes; the model's own buffers and .grad are not touched here.
    with probing(model, model_device(model)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for size in (n, m):
            twin = _float64_twin(model)
            accumulate(twin, sample, loss_fn, micro_batch_size=size, **options)
            grads.append([p.grad for p in twin.parameters() if p.grad is not None])
    full, streamed = grads
    worst = max((_rel(a, b) for a, b in zip(streamed, full)), default=0.0)
    if len(full) != len(streamed) or worst > tol:
        batchnorm = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training for mod in model.modules())
        cause = ("BatchNorm layers in training mode normalize each micro-batch by its own rows, and the loss may "
                 "couple rows too" if batchnorm else
                 "the loss couples the rows (each micro-batch would see only its own, e.g. in-batch negatives)")
        fix = "mbs_ext.CachedLoss(encode, loss)" + ("; for BatchNorm, eval mode or a model without it"
                                                    if batchnorm else "")
        raise ValueError(
            f"check_streamable: the streamed gradient differs from the full batch's by {worst:.2e} (relative, float64, "
            f"{n} rows in micro-batches of {m}): {cause}. For a loss over the whole mini-batch's encodings use {fix}"
        )


def _as_float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _float64_twin(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model).double()
    for mod in twin.modules():
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            mod.eval()
    return twin


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.norm().item()
    return (a - b).norm().item() / (den if den > 0 else 1.0)
