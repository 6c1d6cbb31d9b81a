"""Python face of the fused ``mbs_ext::scale_accumulate_`` op.

Every argument is validated here, before the dispatcher sees it, and errors name the
argument (``grads[3]``): no bad input reaches C++, so no error is ever raised from
inside a kernel on this path. The C++ kernels repeat each check once, so that a
call straight through ``torch.ops`` cannot reach a kernel with bad arguments either.

The per-pair scan and the overlap sweep run in C++ (``_C._scan_arguments``):
with thousands of small tensors a Python loop would cost more than the op itself.
Those helpers only point at a suspect pair; the error and its wording come from here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from mbs_ext._native import _C  # also loads the op registrations

_OP = torch.ops.mbs_ext.scale_accumulate_
_FLOATS = frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16})
_DEVICE_TYPES = ("cpu", "cuda")


@torch.library.register_fake("mbs_ext::scale_accumulate_")
def _scale_accumulate_fake(accumulators, grads, scale, found_inf) -> None:
    # In-place op with no outputs: nothing to describe for fake tensors.
    return None


def _as_list(name: str, seq: object) -> list:
    if isinstance(seq, list):
        return seq
    if isinstance(seq, torch.Tensor) or isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(seq).__name__}")
    return list(seq)


def _check_tensor(name: str, i: int, t: object, device: torch.device | None, grad_mode: bool) -> torch.Tensor:
    """One list element: a dense float tensor on `device` (when known) that autograd does not track."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name}[{i}] must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name}[{i}] must be float32, float64, bfloat16 or float16, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}[{i}] is on {t.device} but accumulators[0] is on {device}")
    if grad_mode and t.requires_grad:
        # The op is not differentiable and writes in place outside autograd.
        raise ValueError(
            f"{name}[{i}] requires grad; scale_accumulate_ is not differentiable: pass .grad tensors or "
            "detached buffers, or call it under torch.no_grad()"
        )
    return t


def _check_pair(i: int, acc: object, grad: object, device: torch.device, grad_mode: bool) -> None:
    """Raises the named error for a bad pair (the slow path of `_check_pairs`)."""
    _check_tensor("accumulators", i, acc, device, grad_mode)
    _check_tensor("grads", i, grad, device, grad_mode)
    if acc.shape != grad.shape:
        raise ValueError(f"accumulators[{i}] has shape {tuple(acc.shape)} but grads[{i}] has shape {tuple(grad.shape)}")
    if not acc.is_contiguous() and any(st == 0 and sz > 1 for st, sz in zip(acc.stride(), acc.shape)):
        raise ValueError(
            f"accumulators[{i}] has elements that share memory (an expanded tensor) and cannot be written in place"
        )


def _check_pairs(accumulators: list, grads: list) -> torch.device | None:
    """Validates the two lists' lengths and first element; returns their device (None when
    they are empty). The other pairs are checked by `_check_arguments`."""
    if len(accumulators) != len(grads):
        raise ValueError(
            f"accumulators and grads must have the same length, got {len(accumulators)} accumulators "
            f"and {len(grads)} grads"
        )
    if not accumulators:
        return None
    first = _check_tensor("accumulators", 0, accumulators[0], None, torch.is_grad_enabled())
    if first.device.type not in _DEVICE_TYPES:
        raise ValueError(f"accumulators[0] is on {first.device}; scale_accumulate_ runs on cpu and cuda tensors")
    return first.device


_LISTS = ("accumulators", "grads", "found_inf", "scale")


def _check_arguments(
    accumulators: list, grads: list, device: torch.device, scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """Every pair, then memory overlap: no written tensor (an accumulator, found_inf) may
    share memory with any other argument, because the kernels update all pairs in parallel
    and an overlap would be a data race. Views of one buffer that interleave without sharing
    elements are refused too (address ranges are compared).

    Eagerly, one pass in C++ (``_C._scan_arguments``) points at the first suspect pair, which
    `_check_pair` then names, and sweeps the sorted address ranges. Traced or with fake
    tensors, the pairs are checked here (the checks become guards) and the overlap check is
    left to the kernels, which see real addresses.
    """
    grad_mode = torch.is_grad_enabled()
    if torch.compiler.is_compiling() or isinstance(found_inf, FakeTensor):
        for i, (acc, grad) in enumerate(zip(accumulators, grads)):
            _check_pair(i, acc, grad, device, grad_mode)
        return
    start = 0
    while True:
        suspect, hit = _C._scan_arguments(accumulators, grads, scale, found_inf, grad_mode, start)
        if suspect < 0:
            break
        _check_pair(suspect, accumulators[suspect], grads[suspect], device, grad_mode)
        start = suspect + 1
    if hit:
        a, b = (_LISTS[hit[k]] + (f"[{hit[k + 1]}]" if hit[k] < 2 else "") for k in (0, 2))
        raise ValueError(
            f"{a} and {b} may share memory; accumulators and found_inf must not overlap any other argument"
        )


def _as_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-dim float32/float64 tensor on `device` or on the CPU (then read by value, no copy)."""
    if isinstance(scale, torch.Tensor):
        if scale.layout != torch.strided:
            raise TypeError(f"scale must be a dense tensor, got layout {scale.layout}")
        if scale.dim() != 0:
            raise ValueError(f"scale must be a Python number or a 0-dim tensor, got shape {tuple(scale.shape)}")
        if not scale.is_floating_point():
            raise TypeError(f"scale must be a floating-point tensor, got {scale.dtype}")
        if scale.device != device and scale.device.type != "cpu":
            raise ValueError(f"scale is on {scale.device} but must be on {device} or be a CPU scalar")
        if scale.dtype not in (torch.float32, torch.float64):
            scale = scale.to(torch.float32)  # on its own device: no host sync
        return scale.detach()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python number or a 0-dim tensor, got {type(scale).__name__}")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    # A CPU scalar: the CUDA kernel takes its value as a kernel argument, no copy.
    return torch.tensor(value, dtype=torch.float64)


def _as_found_inf(found_inf: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if found_inf is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a 0-dim float32 tensor or None, got {type(found_inf).__name__}")
    if found_inf.layout != torch.strided or found_inf.dim() != 0 or found_inf.dtype != torch.float32:
        raise ValueError(
            f"found_inf must be a dense 0-dim float32 tensor, got {found_inf.dtype} of shape "
            f"{tuple(found_inf.shape)} ({found_inf.layout})"
        )
    if found_inf.device != device:
        raise ValueError(f"found_inf is on {found_inf.device} but the tensors are on {device}")
    if found_inf.requires_grad and torch.is_grad_enabled():
        raise ValueError("found_inf requires grad; it is written in place: pass a plain float32 tensor")
    return found_inf


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
    NaN and is never reset here; it is created when not given and returned. Nothing
    here synchronizes with the GPU: ``scale`` may be a device tensor, and the flag is
    written on the device.

    Raises TypeError/ValueError naming the argument for: lists of different lengths,
    non-tensors, non-float or sparse tensors, shape or device mismatches, devices
    other than cpu/cuda, tensors that require grad while grad mode is on (the op is
    not differentiable), expanded accumulators, and accumulators or a found_inf that
    share memory with another argument.
    """
    accumulators = _as_list("accumulators", accumulators)
    grads = _as_list("grads", grads)
    device = _check_pairs(accumulators, grads)
    if device is None:  # no pairs: the flag's (or scale's) device, else the CPU
        if isinstance(found_inf, torch.Tensor):
            device = found_inf.device
        elif isinstance(scale, torch.Tensor):
            device = scale.device
        else:
            device = torch.device("cpu")
        if device.type not in _DEVICE_TYPES:
            raise ValueError(f"found_inf is on {device}; scale_accumulate_ runs on cpu and cuda tensors")
    scale_t = _as_scale(scale, device)
    found_inf = _as_found_inf(found_inf, device)
    if accumulators:
        _check_arguments(accumulators, grads, device, scale_t, found_inf)
        _OP(accumulators, grads, scale_t, found_inf)
    return found_inf
