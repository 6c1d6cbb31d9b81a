"""Python face of the fused ``mbs_ext::scale_accumulate_`` op."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from mbs_ext._native import _C  # noqa: F401  (loads the op registrations)

_OP = torch.ops.mbs_ext.scale_accumulate_


@torch.library.register_fake("mbs_ext::scale_accumulate_")
def _scale_accumulate_fake(accumulators, grads, scale, found_inf) -> None:
    # In-place op with no outputs: nothing to describe for fake tensors.
    return None


def _as_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0:
            raise ValueError(f"scale must be a Python number or a 0-dim tensor, got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            scale = scale.to(torch.float32)
        elif scale.dtype not in (torch.float32, torch.float64):
            scale = scale.to(torch.float32)
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python number or a 0-dim tensor, got {type(scale).__name__}")
    # A CPU scalar: the CUDA kernel takes its value by argument, no host->device copy.
    return torch.tensor(float(scale), dtype=torch.float64)


def scale_accumulate_(
    accumulators: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    found_inf: torch.Tensor | None = None,
) -> torch.Tensor:
    """``accumulators[i] += scale * grads[i]`` for every i, in one fused pass.

    Math runs in float32 (float64 for float64 accumulators), so bf16/fp16 gradients
    can accumulate into float32 buffers without a cast copy. ``found_inf`` (a 0-dim
    float32 tensor on the tensors' device) is set to 1.0 when any grad holds inf or
    NaN and is never reset here; it is created when not given and returned.
    """
    if isinstance(accumulators, torch.Tensor) or isinstance(grads, torch.Tensor):
        raise TypeError("accumulators and grads must be sequences of tensors, not a single tensor")
    accumulators = list(accumulators)
    grads = list(grads)
    for name, seq in (("accumulators", accumulators), ("grads", grads)):
        for i, t in enumerate(seq):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if found_inf is None:
        device = accumulators[0].device if accumulators else torch.device("cpu")
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    elif not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a 0-dim float32 tensor or None, got {type(found_inf).__name__}")
    _OP(accumulators, grads, _as_scale(scale, found_inf.device), found_inf)
    return found_inf
